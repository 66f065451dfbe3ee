"""Layer-wise reads of stored chunks: layer l of many chunks, one range read per chunk.

The chunk wire format (`codec`) keeps each layer's K and V in one section, so a restore along layers
(CacheFlow's layer-wise two-pointer, CacheBlend's pipelined loading) reads layer l of chunk 0, 1, ... with
one `get_range` each, concurrently, and places every section at its chunk's token range of the cache.
Each section carries its own checksum, so a layer is verified on its own, without the rest of the object.

`open` fetches and checks every chunk's header first (one concurrent round of small reads) and says
which chunks can be read; `read_layer` raises `ChunkLoadFailed` naming the chunks whose section could
not be used. Either way the fault is noted in `errors`, a damaged object is deleted so it is never
served again, and nothing unverified reaches the cache.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread

from . import codec
from .engine import LOAD_FAULTS
from .errors import ChunkDecodeError, MissingChunkError
from .kv import KVCache
from .spec import ModelSpec
from .stores.base import ChunkStore

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


class ChunkLoadFailed(ChunkDecodeError):
    """A layer of some chunks could not be read after their headers were: those chunks are misses."""

    def __init__(self, indices: Sequence[int], error: str) -> None:
        super().__init__(f"chunks {list(indices)}: {error}")
        self.indices = list(indices)
        self.error = error


async def _each(fn: Callable[[int], Awaitable[None]], indices: Sequence[int]) -> None:
    """fn(j) for every j concurrently; an unexpected error is raised as itself, not as a group."""
    try:
        async with anyio.create_task_group() as tg:
            for j in indices:
                tg.start_soon(fn, j)
    except BaseExceptionGroup as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        raise exc from None


@dataclass(frozen=True)
class StoredChunk:
    """Where a stored chunk comes from (`key`, saved at position `stored_at`) and goes (`offset`)."""

    key: str
    stored_at: int
    offset: int
    n_tokens: int


class LayerReader:
    """Reads one layer of many stored chunks at a time into a KVCache.

    Subclasses may override `place` to transform a section once it is verified (CacheBlend re-rotates
    the keys of a chunk placed somewhere other than where it was saved).
    """

    def __init__(self, spec: ModelSpec, store: ChunkStore, chunks: Sequence[StoredChunk]) -> None:
        self.spec = spec
        self.store = store
        self.chunks = list(chunks)
        self.headers: dict[int, codec.ChunkHeader] = {}  # of every chunk whose header checked out
        self.dropped: set[int] = set()  # chunks no longer read (a fault, or the caller's `drop`)
        self.opened = False
        self.errors: list[str] = []
        self.bytes_read = 0

    async def open(self) -> list[bool]:
        """Fetch and check every chunk's header, concurrently; which chunks can be read."""
        await _each(self._open_one, range(len(self.chunks)))
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

        The sections are fetched concurrently, then verified and placed in one worker-thread call (one
        thread hop per layer, not one per chunk: short prompts have many small sections). Raises
        `ChunkLoadFailed` naming the chunks whose section was missing or damaged (the others are placed).
        """
        sections: dict[int, bytes] = {}
        failed: list[int] = []

        async def fetch(j: int) -> None:
            (a, b) = codec.layer_ranges(self.headers[j], [layer])[0]
            try:
                sections[j] = await self._get(self.chunks[j].key, a, b)
            except LOAD_FAULTS as exc:
                await self._fault(j, exc, f" layer {layer}")
                failed.append(j)

        await _each(fetch, [j for j in self.headers if j not in self.dropped])
        bad = await anyio.to_thread.run_sync(self._place_all, layer, sections, kv, abandon_on_cancel=False)
        for j, exc in bad:
            await self._fault(j, exc, f" layer {layer}")
            failed.append(j)
        total = sum(len(data) for j, data in sections.items() if j not in failed)
        self.bytes_read += total
        if failed:
            raise ChunkLoadFailed(sorted(failed), self.errors[-1])
        return total

    def place(self, layer: int, j: int, data: bytes, kv: KVCache) -> None:
        """Verify one section and copy it to chunk j's token range of layer `layer` (blocking)."""
        chunk, header = self.chunks[j], self.headers[j]
        o, n = chunk.offset, chunk.n_tokens
        dest = kv.data[layer : layer + 1, :, :, o : o + n]
        if dest.device.type == "cpu":
            codec.decode_layers(header, {layer: data}, self.spec, [layer], out=dest)
        else:
            dest.copy_(codec.decode_layers(header, {layer: data}, self.spec, [layer]))

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
        self, layer: int, sections: dict[int, bytes], kv: KVCache
    ) -> list[tuple[int, ChunkDecodeError]]:
        bad = []
        for j, data in sections.items():
            try:
                self.place(layer, j, data, kv)
            except ChunkDecodeError as exc:
                bad.append((j, exc))
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
