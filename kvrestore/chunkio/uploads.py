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
from kvrestore.chunkio.load import pinned_host
from kvrestore.chunkio.pool import Staging
from kvrestore.chunkio.stored import layers_name
from kvrestore.codec.checksums import device_checkable, segment_checksums
from kvrestore.core.errors import LOAD_FAULTS, CorruptChunkError, MissingChunkError, TruncatedChunkError
from kvrestore.core.kv import KVCache
from kvrestore.core.streams import on_stream

if TYPE_CHECKING:
    from kvrestore.chunkio.layers import LayerReader


class LayerUploads:
    """The device path of a `LayerReader` (its part `reader.uploads`; see the module doc): the reader
    decides which layers of which chunks to read, and hands each read that goes to a CUDA cache here."""

    def __init__(self, reader: LayerReader) -> None:
        self.reader = reader

    def upload(
        self, layers: range, sections: dict[int, bytes | memoryview | None], kv: KVCache
    ) -> list[tuple[int, BaseException]]:
        """`layers` of chunks `sections` (their fetched spans, or None to read them here from a store
        that `reads_sync`) into a CUDA cache, blocking, in a worker thread. Each chunk's span goes up to
        one device buffer on `stream` (a pinned `MemoryStore`'s object as it lies, other bytes through
        pinned staging); one `segment_checksums` checks every section there, then each chunk's span is
        copied to its rows and `after_layers` runs, on the same stream. Returns the unusable chunks."""
        bad: list[tuple[int, BaseException]] = []
        ups: list[tuple[int, torch.Tensor, Staging | None]] = []
        decoded: list[tuple[int, torch.Tensor]] = []  # compressed, or rows not whole words: host-checked
        checks = self.reader._deferred(kv)
        if checks is not None:
            checks.throttle(self.reader.ahead, len(layers))  # bounds the staging buffers and uploads in flight
        try:
            for j, data in sections.items():
                try:
                    got = self._section_bytes(layers, j, data)
                except LOAD_FAULTS as exc:
                    bad.append((j, exc))
                    continue
                if isinstance(got, tuple):
                    ups.append((j, *got))
                else:
                    decoded.append((j, got))
        except BaseException:
            for _, _, staging in ups:
                if staging is not None:
                    self.reader.pool.release(staging)
            raise
        with on_stream(self.reader.stream, kv.data.device):
            if checks is not None:
                checks.start()
            placed = self._place_uploads(layers, ups, kv, bad, checks)
            for j, host in decoded:
                self.reader._dest(layers, j, kv).copy_(host)
                placed.append(j)
            self.reader.after_layers(layers, placed, kv)
            if checks is not None:
                checks.placed(layers)
                return bad
            done = self.reader.pool.event()
            done.record()
        done.synchronize()
        self.reader.pool.give_event(done)
        return bad

    def _section_bytes(
        self, layers: range, j: int, data: bytes | memoryview | None
    ) -> tuple[torch.Tensor, Staging | None] | torch.Tensor:
        """Chunk j's span of `layers` (`codec.layer_span`) in page-locked memory, as (uint8 tensor, its staging
        buffer or None); for sections that must be checked on the host (compressed, rows not whole int64
        words, not back to back), their verified and decoded KV [n, 2, H, T, D] instead."""
        chunk, header = self.reader.chunks[j], self.reader.headers[j]
        a, b = codec.layer_span(header, layers)
        staging = None
        if data is None and self.reader.store.reads_in_memory:
            whole = self.reader.store.get_sync(chunk.key)
            data = None if whole is None else memoryview(whole)[a:b]
        elif data is None:  # a local file: the span alone, into pinned staging
            staging = self.reader.pool.acquire(b - a)
            n = self.reader.store.scatter_into_sync(chunk.key, a, [staging.view[: b - a]])
            data = None if n is None else staging.view[:n]
        handed_on = False
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
                return codec.decode_layers(
                    header, codec.span_sections(header, layers, data), self.reader.spec, list(layers)
                )
            if staging is None:
                host, staging = pinned_host(memoryview(data), self.reader.pool)
            else:
                host = staging.tensor
            handed_on = True
            return host[: b - a], staging
        finally:
            if staging is not None and not handed_on:
                self.reader.pool.release(staging)

    def _place_uploads(
        self,
        layers: range,
        ups: list[tuple[int, torch.Tensor, Staging | None]],
        kv: KVCache,
        bad: list[tuple[int, BaseException]],
        checks: DeferredChecks | None = None,
    ) -> list[int]:
        """On the current (upload) stream: the spans up to one device buffer, the checksums of every
        section in it, then each good chunk's span to its rows. Notes the damaged chunks in `bad`;
        returns the chunks placed. With `checks`, every span is placed and the sums are compared on the
        device (`DeferredChecks`)."""
        if not ups:
            return []
        sizes = [host.numel() for _, host, _ in ups]
        cuda = kv.data.device.type == "cuda"
        uploaded, queued = None, False
        try:
            device_buf = torch.empty(sum(sizes), dtype=torch.uint8, device=kv.data.device)
            at = 0
            for (_, host, staging), n in zip(ups, sizes, strict=True):
                device_buf[at : at + n].copy_(host, non_blocking=True)
                at += n
                if checks is not None and staging is None:
                    checks.hold(host)
            if cuda:  # off CUDA (the device path in tests) the copies are done already
                uploaded = self.reader.pool.event()
                uploaded.record()
            queued = True
        finally:
            if cuda and not queued:  # a copy may have been queued: let it finish before reusing its buffer
                torch.cuda.current_stream(kv.data.device).synchronize()
            for _, _, staging in ups:
                if staging is not None:
                    self.reader.pool.release(staging, busy_until=uploaded)
        words = [self.reader.headers[j].layers[i].length // 8 for j, _, _ in ups for i in layers]
        sums = segment_checksums(device_buf.view(torch.int64), words)
        spans = list(zip(ups, itertools.accumulate(sizes), sizes, strict=True))
        if checks is not None:
            checks.note(layers, [j for j, _, _ in ups], sums)
            for (j, _, _), end, n in spans:
                self._place(layers, j, kv, device_buf[end - n : end])
            return [j for j, _, _ in ups]
        sums = sums.to("cpu", non_blocking=True)
        synced = self.reader.pool.event()
        synced.record()
        synced.synchronize()
        self.reader.pool.give_event(synced)
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
