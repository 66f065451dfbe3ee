"""How a layer read reaches a device: the device path of `LayerReader` (`chunkio.layers`).

Each chunk's span of the layers read (`codec.layer_span`: its sections back to back) goes up to one
device buffer on the reader's stream -- a pinned `MemoryStore`'s object as it lies, a file's bytes read
straight into pinned staging, anything else copied into pinned staging -- and one `segment_checksums`
call checks every section there. Then either each good chunk's span is copied to its rows once the
sums were read back (a host round trip per read), or, with deferred checks (`chunkio.deferred`), every
span is placed at once and the sums are compared on the device. Quantized sections (`codec.quant`) are
checked as stored and decoded into their rows there, on the same stream. Sections that cannot be
checked on the device (compressed, native rows not whole int64 words, not back to back) are decoded and
checked on the host.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from kvrestore import codec
from kvrestore.chunkio.deferred import DeferredChecks
from kvrestore.chunkio.stored import layers_name
from kvrestore.chunkio.transfer import Transfer, pinned_view
from kvrestore.codec.checksums import device_checkable, segment_checksums
from kvrestore.core.errors import LOAD_FAULTS, CorruptChunkError, MissingChunkError, TruncatedChunkError
from kvrestore.core.kv import KVCache

if TYPE_CHECKING:
    from kvrestore.chunkio.layers import LayerReader


class LayerUploads:
    """The device path of a `LayerReader` (made for each read; see the module doc): the reader
    decides which layers of which chunks to read, and hands each read that goes to a CUDA cache here."""

    def __init__(self, reader: LayerReader) -> None:
        self.reader = reader

    def upload(
        self, layers: range, sections: dict[int, bytes | memoryview | None], kv: KVCache
    ) -> list[tuple[int, BaseException]]:
        """`layers` of chunks `sections` (their fetched spans, or None to read them here from a store
        that `reads_sync`) into a CUDA cache, blocking, in a worker thread, as one `Transfer` on the
        reader's lane. Each chunk's span goes up to one device buffer on its stream (a pinned
        `MemoryStore`'s object as it lies, other bytes through pinned staging); one `segment_checksums` checks every section there, then each chunk's span is
        copied to its rows and `after_layers` runs, on the same stream. Returns the unusable chunks."""
        bad: list[tuple[int, BaseException]] = []
        ups: list[tuple[int, torch.Tensor, bool]] = []  # (chunk, its pinned span, whether it was staged)
        decoded: list[tuple[int, torch.Tensor]] = []  # compressed, or rows not whole words: host-checked
        checks = self.reader._deferred(kv)
        if checks is not None:  # bounds the staging buffers and uploads in flight
            checks.throttle(self.reader.ahead, len(layers))
        with self.reader.lane.open(kv.data.device) as transfer:
            for j, data in sections.items():
                try:
                    got = self._section_bytes(layers, j, data, transfer)
                except LOAD_FAULTS as exc:
                    bad.append((j, exc))
                    continue
                if isinstance(got, tuple):
                    ups.append((j, *got))
                else:
                    decoded.append((j, got))
            with transfer.running():
                if checks is not None:
                    checks.start()
                placed = self._place_uploads(layers, ups, kv, bad, transfer, checks)
                for j, host in decoded:
                    self.reader._dest(layers, j, kv).copy_(host)
                    placed.append(j)
                self.reader.after_layers(layers, placed, kv)
                if checks is not None:
                    checks.placed(layers)
                    return bad
            transfer.wait()
        return bad

    def _section_bytes(
        self, layers: range, j: int, data: bytes | memoryview | None, transfer: Transfer
    ) -> tuple[torch.Tensor, bool] | torch.Tensor:
        """Chunk j's span of `layers` (`codec.layer_span`) in page-locked memory, as (uint8 tensor,
        whether `transfer` staged it); for sections that must be checked on the host (compressed, rows
        not whole int64 words, not back to back), their verified and decoded KV [n, 2, H, T, D] instead.
        A buffer staged for a span that goes no further is given back at once."""
        chunk, header = self.reader.chunks[j], self.reader.headers[j]
        a, b = codec.layer_span(header, layers)
        staging = None
        if data is None and self.reader.store.reads_in_memory:
            whole = self.reader.store.get_sync(chunk.key)
            data = None if whole is None else memoryview(whole)[a:b]
        elif data is None:  # a local file: the span alone, into pinned staging
            staging = transfer.stage(b - a)
            n = self.reader.store.scatter_into_sync(chunk.key, a, [staging.view[: b - a]])
            data = None if n is None else staging.view[:n]
        try:
            if data is None:
                raise MissingChunkError(f"chunk {chunk.key[:12]} disappeared from the store")
            if len(data) != b - a:
                raise TruncatedChunkError(f"{layers_name(layers)}: {len(data)} bytes, header says {b - a}")
            word = self.reader.spec.head_dim * self.reader.spec.dtype.itemsize
            if (
                header.compression != "none"
                or (self.reader.encoding.native and not device_checkable(word))
                or not codec.back_to_back(header, layers)
            ):
                decoded = codec.decode_layers(
                    header, codec.span_sections(header, layers, data), self.reader.spec, list(layers)
                )
                transfer.give_back(staging)  # read on the host: no copy will read it
                return decoded
        except BaseException:
            transfer.give_back(staging)
            raise
        if staging is None:
            host = pinned_view(memoryview(data))
            if host is not None:  # a pinned store's object as it lies
                return host[: b - a], False
            staging = transfer.copy_in(memoryview(data))
        return staging.tensor[: b - a], True

    def _place_uploads(
        self,
        layers: range,
        ups: list[tuple[int, torch.Tensor, bool]],
        kv: KVCache,
        bad: list[tuple[int, BaseException]],
        transfer: Transfer,
        checks: DeferredChecks | None = None,
    ) -> list[int]:
        """On `transfer`'s stream (entered): the spans up to one device buffer, the checksums of every
        section in it, then each good chunk's span to its rows. Notes the damaged chunks in `bad`;
        returns the chunks placed. With `checks`, every span is placed and the sums are compared on the
        device (`DeferredChecks`)."""
        if not ups:
            return []
        sizes = [host.numel() for _, host, _ in ups]
        device_buf = torch.empty(sum(sizes), dtype=torch.uint8, device=kv.data.device)
        at = 0
        for (_, host, staged), n in zip(ups, sizes, strict=True):
            device_buf[at : at + n].copy_(host, non_blocking=True)
            at += n
            if checks is not None and not staged:
                checks.hold(host)
        transfer.copied()  # the staged spans are reused once these copies are done
        words = [self.reader.headers[j].layers[i].length // 8 for j, _, _ in ups for i in layers]
        sums = segment_checksums(device_buf.view(torch.int64), words)
        spans = list(zip(ups, itertools.accumulate(sizes), sizes, strict=True))
        if checks is not None:
            checks.note(layers, [j for j, _, _ in ups], sums)
            for (j, _, _), end, n in spans:
                self._place(layers, j, kv, device_buf[end - n : end])
            return [j for j, _, _ in ups]
        sums = sums.to("cpu", non_blocking=True)
        transfer.wait()
        got = sums.view(len(ups), len(layers)).tolist()
        placed = []
        for ((j, _, _), end, n), chunk_sums in zip(spans, got, strict=True):
            wrong = [
                i
                for i, g in zip(layers, chunk_sums, strict=True)
                if g != self.reader.headers[j].layers[i].device_sum
            ]
            if wrong:
                bad.append((j, CorruptChunkError(f"layer {wrong[0]}: device checksum mismatch")))
            else:
                self._place(layers, j, kv, device_buf[end - n : end])
                placed.append(j)
        return placed

    def _place(self, layers: range, j: int, kv: KVCache, span: torch.Tensor) -> None:
        """Copy chunk j's uploaded span (uint8, its sections of `layers` laid out as its rows) to its rows,
        or decode it there where the sections are encoded."""
        dest = self.reader._dest(layers, j, kv)
        if self.reader.encoding.native:
            dest.copy_(span.view(dest.dtype).view(dest.shape))
        else:
            self.reader.encoding.decode(span.view(len(layers), -1), dest)
