"""Layer-wise reads of stored chunks: layer l of many chunks, one range read per chunk.

The chunk wire format (`codec`) keeps each layer's K and V in one section, so a restore along layers
(CacheFlow's layer-wise two-pointer, CacheBlend's pipelined loading) reads layer l of chunk 0, 1, ... with
one `get_range` each, concurrently, and places every section at its chunk's token range of the cache.
Each section carries its own checksum, so a layer is verified on its own, without the rest of the object.

`open` fetches and checks every chunk's header first (one concurrent round of small reads) and says
which chunks can be read; `read_layer` raises `ChunkLoadFailed` naming the chunks whose section could
not be used. Either way the fault is noted in `errors`, a damaged object is deleted so it is never
served again, and nothing unverified reaches the cache -- except with deferred checks
(`chunkio.deferred`), for a caller that keeps the cache to itself until `verify` has passed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.chunkio.deferred import DeferredChecks
from kvrestore.chunkio.load import pinned_host
from kvrestore.chunkio.pool import Staging, StagingPool
from kvrestore.chunkio.stored import ChunkLoadFailed, StoredChunk, each
from kvrestore.codec.checksums import device_checkable, segment_checksums
from kvrestore.core.errors import (
    LOAD_FAULTS,
    ChunkDecodeError,
    CorruptChunkError,
    MissingChunkError,
    TruncatedChunkError,
)
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.core.streams import on_stream
from kvrestore.stores.base import ChunkStore


class LayerReader:
    """Reads one layer of many stored chunks at a time into a KVCache.

    Subclasses may override `place` to transform a section once it is verified (CacheBlend re-rotates
    the keys of a chunk placed somewhere other than where it was saved).
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[StoredChunk],
        stream: torch.cuda.Stream | None = None,
        pool: StagingPool | None = None,
        defer_checks: bool | None = False,
        ahead: int = 4,
    ) -> None:
        self.spec = spec
        self.store = store
        self.chunks = list(chunks)
        self.stream = stream  # where a CUDA cache's sections are uploaded (None: the current stream)
        self.pool = pool or StagingPool(pinned=torch.cuda.is_available())
        self.headers: dict[int, codec.ChunkHeader] = {}  # of every chunk whose header checked out
        self.dropped: set[int] = set()  # chunks no longer read (a fault, or the caller's `drop`)
        self.opened = False
        self.errors: list[str] = []
        self.bytes_read = 0
        # Deferred checks (`chunkio.deferred`): None means on a CUDA cache only; True runs the device
        # path on a CPU cache too (tests of the same code, without streams). At most `ahead` layers
        # are queued on the device at once.
        self.defer_checks = defer_checks
        self.ahead = ahead
        self.checks: DeferredChecks | None = None

    async def open(self) -> list[bool]:
        """Fetch and check every chunk's header, concurrently; which chunks can be read."""
        await each(self._open_one, range(len(self.chunks)))
        self.opened = True
        return [self.readable(j) for j in range(len(self.chunks))]

    def readable(self, j: int) -> bool:
        return j in self.headers and j not in self.dropped

    @property
    def unusable(self) -> list[int]:
        """Chunks that cannot be read (after `open`): missing, damaged, or dropped."""
        return [j for j in range(len(self.chunks)) if not self.readable(j)]

    def drop(self, j: int) -> None:
        """Stop reading chunk j (its tokens are computed instead)."""
        self.dropped.add(j)

    async def read_layer(self, layer: int, kv: KVCache) -> int:
        """Place layer `layer` of every open chunk into `kv`; returns the bytes read.

        The sections are fetched concurrently (on the device path a store that `reads_now` is read in
        the worker thread instead), then verified and placed in one worker-thread call: one thread hop
        per layer, not one per chunk. Raises `ChunkLoadFailed` naming the chunks whose section was
        missing or damaged (the others are placed). With deferred checks the layer is only queued on
        the device when this returns (`wait_placed`) and damage shows in `verify`.
        """
        device_path = kv.data.device.type == "cuda" or bool(self.defer_checks)
        js = [j for j in self.headers if j not in self.dropped]
        sections: dict[int, bytes | memoryview | None] = dict.fromkeys(js)
        failed: list[int] = []
        if not (device_path and self.store.reads_now):  # else each is read in the worker thread

            async def fetch(j: int) -> None:
                a, b = codec.layer_ranges(self.headers[j], [layer])[0]
                try:
                    sections[j] = await self._get(self.chunks[j].key, a, b)
                except LOAD_FAULTS as exc:
                    await self._fault(j, exc, f" layer {layer}")
                    failed.append(j)
                    del sections[j]

            await each(fetch, js)
        work = self._upload_layer if device_path else self._place_all
        bad = await anyio.to_thread.run_sync(work, layer, sections, kv, abandon_on_cancel=False)
        for j, exc in bad:
            await self._fault(j, exc, f" layer {layer}")
            failed.append(j)
        total = sum(self._section_size(layer, j) for j in sections if j not in failed)
        self.bytes_read += total
        if failed:
            raise ChunkLoadFailed(sorted(failed), self.errors[-1])
        return total

    def place(self, layer: int, j: int, data: bytes | memoryview, kv: KVCache) -> None:
        """Verify one section and copy it to chunk j's token range of layer `layer` in a CPU cache
        (blocking)."""
        codec.decode_layers(self.headers[j], {layer: data}, self.spec, [layer], out=self._dest(layer, j, kv))

    def after_layer(self, layer: int, placed: Sequence[int], kv: KVCache) -> None:
        """A hook run once the sections of chunks `placed` of `layer` are verified and in place (on the
        upload stream for a CUDA cache); CacheBlend re-rotates the keys there."""

    def _dest(self, layer: int, j: int, kv: KVCache) -> torch.Tensor:
        chunk = self.chunks[j]
        return kv.data[layer : layer + 1, :, :, chunk.offset : chunk.offset + chunk.n_tokens]

    def _section_size(self, layer: int, j: int) -> int:
        a, b = codec.layer_ranges(self.headers[j], [layer])[0]
        return b - a

    def _upload_layer(
        self, layer: int, sections: dict[int, bytes | memoryview | None], kv: KVCache
    ) -> list[tuple[int, BaseException]]:
        """Layer `layer` of chunks `sections` (their fetched bytes, or None to read them here from a store
        that `reads_now`) into a CUDA cache, blocking, in a worker thread. Each section goes up to one
        device buffer on `stream` (a pinned `MemoryStore`'s object as it lies, other bytes through pinned
        staging); one `segment_checksums` checks them all there, then each is copied to its chunk's rows
        and `after_layer` runs, on the same stream. Returns the chunks whose section was unusable."""
        bad: list[tuple[int, BaseException]] = []
        ups: list[tuple[int, torch.Tensor, Staging | None]] = []
        decoded: list[tuple[int, torch.Tensor]] = []  # compressed, or rows not whole words: host-checked
        checks = self._deferred(kv)
        if checks is not None:
            checks.throttle(self.ahead)  # bounds the staging buffers and uploads in flight
        try:
            for j, data in sections.items():
                try:
                    got = self._section_bytes(layer, j, data)
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
                    self.pool.release(staging)
            raise
        with on_stream(self.stream):
            if checks is not None:
                checks.start(layer)
            placed = self._place_uploads(layer, ups, kv, bad, checks)
            for j, host in decoded:
                self._dest(layer, j, kv).copy_(host)
                placed.append(j)
            self.after_layer(layer, placed, kv)
            if checks is not None:
                checks.placed(layer)
                return bad
            done = self.pool.event()
            done.record()
        done.synchronize()
        self.pool.give_event(done)
        return bad

    def _deferred(self, kv: KVCache) -> DeferredChecks | None:
        """This reader's deferred checks for `kv` (made on first use), or None if it checks each layer."""
        cuda = kv.data.device.type == "cuda"
        if not (self.defer_checks or (self.defer_checks is None and cuda)):
            return None
        if self.checks is None or self.checks.device != kv.data.device:
            with on_stream(self.stream):
                self.checks = DeferredChecks(
                    self.headers, len(self.chunks), self.spec.num_layers, kv.data.device
                )
        if cuda and self.stream is not None:  # written on the load stream: not reused before that is done
            kv.data.record_stream(self.stream)
        return self.checks

    def wait_placed(self, layer: int) -> None:
        """Make the current stream wait (on the device) for `layer`, read with deferred checks."""
        if self.checks is not None:
            self.checks.wait(layer)

    def placed_seconds(self, layer: int) -> float | None:
        """The device time of placing `layer` (waiting for it), if it was read with deferred checks."""
        return None if self.checks is None else self.checks.seconds(layer)

    async def verify(self) -> None:
        """Wait for every layer read with deferred checks and read their flags: a chunk with a damaged
        section is faulted (noted, deleted from the store) and `ChunkLoadFailed` names those chunks."""
        checks = self.checks
        if checks is None:
            return
        found = await anyio.to_thread.run_sync(checks.failures, self.stream, abandon_on_cancel=False)
        failed = [j for j in sorted(found) if j not in self.dropped]
        for j in failed:
            error = CorruptChunkError(f"layer {found[j]}: device checksum mismatch")
            await self._fault(j, error, f" layer {found[j]}")
        if failed:
            raise ChunkLoadFailed(failed, self.errors[-1])

    def _section_bytes(
        self, layer: int, j: int, data: bytes | memoryview | None
    ) -> tuple[torch.Tensor, Staging | None] | torch.Tensor:
        """Chunk j's section of `layer` in page-locked memory, as (uint8 tensor, its staging buffer or
        None); for a section that must be checked on the host (compressed, rows not whole int64 words),
        its verified and decoded KV instead."""
        chunk, header = self.chunks[j], self.headers[j]
        a, b = codec.layer_ranges(header, [layer])[0]
        staging = None
        if data is None and self.store.reads_in_memory:
            whole = self.store.get_now(chunk.key)
            data = None if whole is None else memoryview(whole)[a:b]
        elif data is None:  # a local file: the section alone, into pinned staging
            staging = self.pool.acquire(b - a)
            n = self.store.scatter_into_now(chunk.key, a, [staging.view[: b - a]])
            data = None if n is None else staging.view[:n]
        handed_on = False
        try:
            if data is None:
                raise MissingChunkError(f"chunk {chunk.key[:12]} disappeared from the store")
            if len(data) != b - a:
                raise TruncatedChunkError(f"layer {layer}: section is {len(data)} bytes, header says {b - a}")
            if header.compression != "none" or not device_checkable(
                self.spec.head_dim * self.spec.dtype.itemsize
            ):
                return codec.decode_layers(header, {layer: data}, self.spec, [layer])  # verified on the host
            if staging is None:
                host, staging = pinned_host(memoryview(data), self.pool)
            else:
                host = staging.tensor
            handed_on = True
            return host[: b - a], staging
        finally:
            if staging is not None and not handed_on:
                self.pool.release(staging)

    def _place_uploads(
        self,
        layer: int,
        ups: list[tuple[int, torch.Tensor, Staging | None]],
        kv: KVCache,
        bad: list[tuple[int, BaseException]],
        checks: DeferredChecks | None = None,
    ) -> list[int]:
        """On the current (upload) stream: the sections up to one device buffer, their checksums, then
        each good one to its rows. Notes the damaged ones in `bad`; returns the chunks placed. With
        `checks`, every section is placed and the sums are compared on the device (`DeferredChecks`)."""
        if not ups:
            return []
        sizes = [host.numel() for _, host, _ in ups]
        cuda = kv.data.device.type == "cuda"
        uploaded, queued = None, False
        try:
            device_buf = torch.empty(sum(sizes), dtype=torch.uint8, device=kv.data.device)
            at = 0
            for (_, host, _), n in zip(ups, sizes, strict=True):
                device_buf[at : at + n].copy_(host, non_blocking=True)
                at += n
            if cuda:  # off CUDA (the device path in tests) the copies are done already
                uploaded = self.pool.event()
                uploaded.record()
            queued = True
        finally:
            if cuda and not queued:  # a copy may have been queued: let it finish before reusing its buffer
                torch.cuda.current_stream().synchronize()
            for _, _, staging in ups:
                if staging is not None:
                    self.pool.release(staging, busy_until=uploaded)
        sums = segment_checksums(device_buf.view(torch.int64), [n // 8 for n in sizes])
        if checks is not None:
            checks.note(layer, [j for j, _, _ in ups], sums)
            at = 0
            for (j, _, _), n in zip(ups, sizes, strict=True):
                self._place(layer, j, kv, device_buf[at : at + n])
                at += n
            return [j for j, _, _ in ups]
        sums = sums.to("cpu", non_blocking=True)
        synced = self.pool.event()
        synced.record()
        synced.synchronize()
        self.pool.give_event(synced)
        placed = []
        at = 0
        for (j, _, _), n, got in zip(ups, sizes, sums.tolist(), strict=True):
            if got != self.headers[j].layers[layer].device_sum:
                bad.append((j, CorruptChunkError(f"layer {layer}: device checksum mismatch")))
            else:
                self._place(layer, j, kv, device_buf[at : at + n])
                placed.append(j)
            at += n
        return placed

    def _place(self, layer: int, j: int, kv: KVCache, section: torch.Tensor) -> None:
        """Copy chunk j's uploaded section (uint8, laid out as its rows) to its rows of `layer`."""
        dest = self._dest(layer, j, kv)
        dest.copy_(section.view(dest.dtype).view(dest.shape))

    # -- internals -------------------------------------------------------------------------------

    async def _open_one(self, j: int) -> None:
        chunk = self.chunks[j]
        try:
            head = await self._get(chunk.key, 0, codec.HEADER_PROBE)
            if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
                head = await self._get(chunk.key, 0, codec.header_length(head))
            header, _ = codec.read_header(head)
            codec.check_header(header, self.spec, chunk.key, chunk.stored_at, chunk.n_tokens)
        except LOAD_FAULTS as exc:
            # a chunk gone before the restore reads it is a plain miss; anything else is worth reporting
            await self._fault(j, exc, note=not isinstance(exc, MissingChunkError))
            return
        self.bytes_read += len(head)
        self.headers[j] = header

    def _place_all(
        self, layer: int, sections: dict[int, bytes | memoryview | None], kv: KVCache
    ) -> list[tuple[int, BaseException]]:
        """`read_layer` into a CPU cache: verify and place the fetched sections (blocking)."""
        bad: list[tuple[int, BaseException]] = []
        placed = []
        for j, data in sections.items():
            assert data is not None  # fetched: only the device path reads in the worker thread
            try:
                self.place(layer, j, data, kv)
                placed.append(j)
            except ChunkDecodeError as exc:
                bad.append((j, exc))
        self.after_layer(layer, placed, kv)
        return bad

    async def _get(self, key: str, start: int, end: int) -> bytes:
        data = await self.store.get_range(key, start, end)
        if data is None:
            raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
        return data

    async def _fault(self, j: int, exc: BaseException, where: str = "", note: bool = True) -> None:
        """Stop reading chunk j, note its fault, and delete a damaged object (best effort: the miss is
        what matters)."""
        self.drop(j)
        if note:
            self.errors.append(f"chunk {j}{where}: {type(exc).__name__}: {exc}")
        if isinstance(exc, ChunkDecodeError) and not isinstance(exc, MissingChunkError):
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.store.delete(self.chunks[j].key)
