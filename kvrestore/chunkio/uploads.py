"""How a layer read reaches a device: the device path of `LayerReader` (`chunkio.layers`).

Each chunk's span of the layers read (`codec.layer_span`: its sections back to back) goes up to one
device buffer on the reader's stream -- a pinned `MemoryStore`'s object as it lies, a file's bytes read
straight into pinned staging, anything else copied into pinned staging -- and one `segment_checksums`
call checks every section there. The spans that need staging share one pinned buffer, in read order,
and go up in one copy; consecutive chunks of the same length are placed with one copy too. A read
costs the host a few calls whatever the number of chunks: the loader shares the host with a compute
lane bound by its kernel launches. Then either each good chunk's span is copied to its rows once the
sums were read back (a host round trip per read), or, with deferred checks (`chunkio.deferred`), every
span is placed at once and the sums are compared on the device. Quantized sections (`codec.quant`) are
checked as stored and decoded into their rows there, on the same stream. Sections that cannot be
checked on the device (compressed, native rows not whole int64 words, not back to back) are decoded and
checked on the host. With a secret, every section's tag (`codec.seal`) is checked on the host while the
spans are copied to the device buffer, and a span that fails is never placed in the cache.
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
from kvrestore.core.errors import (
    LOAD_FAULTS,
    ChunkDecodeError,
    CorruptChunkError,
    MissingChunkError,
    TruncatedChunkError,
)
from kvrestore.core.kv import KVCache
from kvrestore.stores.base import copy_into

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
        that `reads_sync`) into a CUDA cache as the module doc says, blocking, in a worker thread, as one
        `Transfer` on the reader's lane; the reader's `dest.placed` runs on its stream last. Returns the
        unusable chunks."""
        bad: list[tuple[int, BaseException]] = []
        ups: list[tuple[int, torch.Tensor, bool]] = []  # (chunk, its pinned span, whether it was staged)
        decoded: list[tuple[int, torch.Tensor]] = []  # compressed, or rows not whole words: host-checked
        checks = self.reader._deferred(kv)
        if checks is not None:  # bounds the staging buffers and uploads in flight
            checks.throttle(self.reader.ahead, len(layers))
        with self.reader.lane.open(kv.data.device) as transfer:
            # (chunk, its span where it lies -- None: a file's, read into staging --, its offset in the
            # object and length, whether it is checked on the host)
            found: list[tuple[int, memoryview | torch.Tensor | None, int, int, bool]] = []
            need = 0  # bytes of the spans that go through staging
            for j, data in sections.items():
                a, b = codec.layer_span(self.reader.headers[j], layers)
                checked = self._host_checked(layers, j)
                try:
                    got = self._span(j, data, a, b, layers)
                    if isinstance(got, memoryview) and checked:
                        decoded.append((j, self._decode(layers, j, got)))
                        continue
                except LOAD_FAULTS as exc:
                    bad.append((j, exc))
                    continue
                host = pinned_view(got) if isinstance(got, memoryview) else None
                found.append((j, got if host is None else host, a, b - a, checked))
                if host is None:
                    need += b - a
            staging = transfer.stage(need) if need else None
            at = 0
            for j, span, a, n, checked in found:
                if isinstance(span, torch.Tensor):  # a pinned store's object as it lies
                    ups.append((j, span, False))
                    continue
                assert staging is not None
                try:
                    self._stage(j, span, a, staging.view[at : at + n], layers)
                    if checked:  # a file's span that cannot be checked on the device
                        decoded.append((j, self._decode(layers, j, staging.view[at : at + n])))
                    else:
                        ups.append((j, staging.tensor[at : at + n], True))
                except LOAD_FAULTS as exc:
                    bad.append((j, exc))
                at += n
            with transfer.running():
                if checks is not None:
                    checks.start()
                placed = self._place_uploads(
                    layers, ups, kv, bad, transfer, checks, None if staging is None else staging.tensor
                )
                for j, host in decoded:
                    self.reader.rows_of(layers, j, kv).copy_(host)
                    placed.append(j)
                self.reader.dest.placed(self.reader, layers, placed, kv)
                if checks is not None:
                    checks.placed(layers)
                    return bad
            transfer.wait()
        return bad

    def _span(
        self, j: int, data: bytes | memoryview | None, a: int, b: int, layers: range
    ) -> memoryview | None:
        """Chunk j's span [a, b) of its object where it lies: the bytes fetched or held by an in-memory
        store, or None for a local file (read into staging later). Raises MissingChunkError or
        TruncatedChunkError."""
        chunk = self.reader.chunks[j]
        if data is None and self.reader.store.reads_in_memory:
            whole = self.reader.store.get_sync(chunk.key)
            if whole is None:
                raise MissingChunkError(f"chunk {chunk.key[:12]} disappeared from the store")
            data = memoryview(whole)[a:b]
        elif data is None:
            return None
        if len(data) != b - a:
            raise TruncatedChunkError(f"{layers_name(layers)}: {len(data)} bytes, header says {b - a}")
        return memoryview(data)

    def _host_checked(self, layers: range, j: int) -> bool:
        """Whether chunk j's sections of `layers` are checked and decoded on the host: compressed, native
        rows not whole int64 words, or not back to back."""
        header = self.reader.headers[j]
        word = self.reader.spec.head_dim * self.reader.spec.dtype.itemsize
        return (
            header.compression != "none"
            or (self.reader.encoding.native and not device_checkable(word))
            or not codec.back_to_back(header, layers)
        )

    def _decode(self, layers: range, j: int, data: memoryview) -> torch.Tensor:
        """Chunk j's span, verified and decoded on the host: KV [n, 2, H, T, D]."""
        header = self.reader.headers[j]
        sections = codec.span_sections(header, layers, data)
        return codec.decode_layers(header, sections, self.reader.spec, list(layers), seal=self.reader.seal)

    def _stage(self, j: int, data: memoryview | None, a: int, slot: memoryview, layers: range) -> None:
        """Fill `slot` (chunk j's place in the shared staging buffer) with its span: copied there (one
        copy, off the GIL), or read there from the file (`data` None) at offset `a`."""
        if data is not None:
            copy_into(slot, data)
            return
        chunk = self.reader.chunks[j]
        got = self.reader.store.scatter_into_sync(chunk.key, a, [slot])
        if got is None:
            raise MissingChunkError(f"chunk {chunk.key[:12]} disappeared from the store")
        if got != len(slot):
            raise TruncatedChunkError(f"{layers_name(layers)}: {got} bytes, header says {len(slot)}")

    def _place_uploads(
        self,
        layers: range,
        ups: list[tuple[int, torch.Tensor, bool]],
        kv: KVCache,
        bad: list[tuple[int, BaseException]],
        transfer: Transfer,
        checks: DeferredChecks | None = None,
        staging: torch.Tensor | None = None,
    ) -> list[int]:
        """On `transfer`'s stream (entered): the spans up to one device buffer (staged spans that lie
        back to back in `staging` in one copy), the checksums of every section in it, then the good
        chunks' spans to their rows. Notes the damaged chunks in `bad`; returns the chunks placed. With
        `checks`, every span is placed and the sums are compared on the device (`DeferredChecks`)."""
        if not ups:
            return []
        sizes = [host.numel() for _, host, _ in ups]
        device_buf = torch.empty(sum(sizes), dtype=torch.uint8, device=kv.data.device)
        for at, host in _coalesced(ups, sizes, staging):
            device_buf[at : at + host.numel()].copy_(host, non_blocking=True)
        forged = self._authenticate(layers, ups, bad)  # on the host, while the copies run
        if checks is not None:
            for _, host, staged in ups:
                if not staged:
                    checks.hold(host)
        transfer.copied()  # the staged spans are reused once these copies are done
        words = [self.reader.headers[j].layers[i].length // 8 for j, _, _ in ups for i in layers]
        sums = segment_checksums(device_buf.view(torch.int64), words)
        spans = [
            (j, end - n, n) for (j, _, _), end, n in zip(ups, itertools.accumulate(sizes), sizes, strict=True)
        ]
        if checks is not None:
            checks.note(layers, [j for j, _, _ in ups], sums)
            authentic = [span for span in spans if span[0] not in forged]
            self._place_runs(layers, authentic, kv, device_buf)
            return [j for j, _, _ in authentic]
        sums = sums.to("cpu", non_blocking=True)
        transfer.wait()
        got = sums.view(len(ups), len(layers)).tolist()
        good = []
        for span, chunk_sums in zip(spans, got, strict=True):
            j = span[0]
            if j in forged:
                continue
            wrong = [
                i
                for i, g in zip(layers, chunk_sums, strict=True)
                if g != self.reader.headers[j].layers[i].device_sum
            ]
            if wrong:
                bad.append((j, CorruptChunkError(f"layer {wrong[0]}: device checksum mismatch")))
            else:
                good.append(span)
        self._place_runs(layers, good, kv, device_buf)
        return [j for j, _, _ in good]

    def _authenticate(
        self, layers: range, ups: list[tuple[int, torch.Tensor, bool]], bad: list[tuple[int, BaseException]]
    ) -> set[int]:
        """With a secret, check every section of `ups`' spans against its tag on the host (the GIL
        released), while their copies to the device buffer run; a chunk that fails goes to `bad` and
        is in the returned set: its span is never placed. Nothing without a secret."""
        seal = self.reader.seal
        failed: set[int] = set()
        if seal is None:
            return failed
        for j, host, _ in ups:
            header = self.reader.headers[j]
            try:
                for i, stored in codec.span_sections(header, layers, host.numpy().data).items():
                    codec.check_section(header, i, stored, seal)
            except ChunkDecodeError as exc:
                bad.append((j, exc))
                failed.add(j)
        return failed

    def _place_runs(
        self, layers: range, spans: list[tuple[int, int, int]], kv: KVCache, device_buf: torch.Tensor
    ) -> None:
        """Copy each chunk's uploaded span (`spans`: chunk, start and length in `device_buf`) to its rows:
        in the native encoding a run of chunks of one length, consecutive in the cache and in the
        buffer, with one copy; otherwise one chunk at a time."""
        chunks, i = self.reader.chunks, 0
        while i < len(spans):
            run = [spans[i]]
            while self._runs(spans[i][0]) and i + len(run) < len(spans):
                (pj, pat, pn), (j, at, n) = run[-1], spans[i + len(run)]
                if not self._runs(j):
                    break
                prev, chunk = chunks[pj], chunks[j]
                if (n, chunk.n_tokens) != (pn, prev.n_tokens) or at != pat + pn:
                    break
                if chunk.offset != prev.offset + prev.n_tokens:
                    break
                run.append((j, at, n))
            i += len(run)
            j0, at0, n0 = run[0]
            if len(run) == 1:
                self._place(layers, j0, kv, device_buf[at0 : at0 + n0])
                continue
            T = chunks[j0].n_tokens
            dest = self.reader.dest.rows(layers, chunks[j0].offset, len(run) * T, kv)  # [L', 2, H, J*T, D]
            Lp, _, H, _, D = dest.shape
            src = device_buf[at0 : at0 + len(run) * n0].view(dest.dtype).view(len(run), Lp, 2, H, T, D)
            dest.unflatten(3, (len(run), T)).copy_(src.permute(1, 2, 3, 0, 4, 5))

    def _runs(self, j: int) -> bool:
        """Whether chunk j's span can be placed in one copy with its neighbours': native, keys row-major."""
        return self.reader.encoding.native and not codec.key_tile(self.reader.headers[j])

    def _place(self, layers: range, j: int, kv: KVCache, span: torch.Tensor) -> None:
        """Copy chunk j's uploaded span (uint8, its sections of `layers` laid out as its rows) to its rows,
        or decode it there where the sections are encoded."""
        dest = self.reader.rows_of(layers, j, kv)
        if self.reader.encoding.native:  # keys a writer stored in tiles turned row-major on the way
            tile = codec.key_tile(self.reader.headers[j])
            codec.place_rows(dest, span.view(dest.dtype).view(dest.shape), tile)
        else:
            self.reader.encoding.decode(span.view(len(layers), -1), dest)


def _coalesced(
    ups: list[tuple[int, torch.Tensor, bool]], sizes: list[int], staging: torch.Tensor | None
) -> list[tuple[int, torch.Tensor]]:
    """The host-to-device copies of `ups` (their spans back to back in the device buffer), as (where in
    the device buffer, what): staged spans that also lie back to back in `staging` go up as one copy
    (one slice of it), each other span alone."""
    runs: list[list] = []  # [device offset, staging offset (None: not staged), length, host span]
    at = 0
    for (_, host, staged), n in zip(ups, sizes, strict=True):
        here = host.data_ptr() - staging.data_ptr() if staged and staging is not None else None
        if here is not None and runs and runs[-1][1] is not None and runs[-1][1] + runs[-1][2] == here:
            runs[-1][2] += n
        else:
            runs.append([at, here, n, host])
        at += n
    copies: list[tuple[int, torch.Tensor]] = []
    for a, here, n, host in runs:
        copies.append((a, host if here is None or staging is None else staging[here : here + n]))
    return copies
