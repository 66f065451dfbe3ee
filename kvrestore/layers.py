"""Layer-wise reads of stored chunks: layer l of every chunk of a prompt, one range read per chunk.

The chunk wire format (`codec`) keeps each layer's K and V in one section, so restoring a prompt along
layers (CacheFlow's layer-wise two-pointer) reads layer l of chunk 0, 1, ... with one `get_range` each,
concurrently, and places every section at its chunk's token range of the cache. Each section carries its
own checksum, so a layer is verified on its own, without the rest of the object.

`open` fetches and checks every chunk's header first (one concurrent round of small reads). Any fault
-- a missing, truncated, corrupt or foreign chunk, a store error -- makes `open` or `read_layer` raise
(the engine turns that into a miss: the layer is computed instead); a damaged object is deleted so it is
never served again.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread

from . import codec
from .errors import ChunkDecodeError, MissingChunkError
from .kv import KVCache
from .spec import ModelSpec
from .stores.base import ChunkStore

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


async def _each(fn: Callable[[int], Awaitable[None]], n: int) -> None:
    """fn(0), ..., fn(n-1) concurrently; the first fault is raised as itself (not as a group), so
    callers (the engine) can tell a chunk's fault from a bug."""
    try:
        async with anyio.create_task_group() as tg:
            for j in range(n):
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
    """Reads one layer of many stored chunks at a time into a KVCache."""

    def __init__(self, spec: ModelSpec, store: ChunkStore, chunks: Sequence[StoredChunk]) -> None:
        self.spec = spec
        self.store = store
        self.chunks = list(chunks)
        self.headers: dict[int, codec.ChunkHeader] = {}
        self.bytes_read = 0

    async def open(self) -> None:
        """Fetch and check every chunk's header, concurrently; raises the first fault."""
        await _each(self._open_one, len(self.chunks))

    async def _open_one(self, j: int) -> None:
        chunk = self.chunks[j]
        try:
            head = await self._get(chunk.key, 0, codec.HEADER_PROBE)
            if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
                head = await self._get(chunk.key, 0, codec.header_length(head))
            header, _ = codec.read_header(head)
            codec.check_header(header, self.spec, chunk.key, chunk.stored_at, chunk.n_tokens)
        except ChunkDecodeError as exc:
            if not isinstance(exc, MissingChunkError):
                await self._forget(chunk.key)
            raise
        self.bytes_read += len(head)
        self.headers[j] = header

    async def read_layer(self, layer: int, kv: KVCache) -> int:
        """Place layer `layer` of every chunk into `kv`; returns the bytes read. Call `open` first.

        The sections are fetched concurrently, then verified and placed in one worker-thread call (one
        thread hop per layer, not one per chunk: short prompts have many small sections)."""
        sections: list[bytes] = [b""] * len(self.chunks)

        async def fetch(j: int) -> None:
            (a, b) = codec.layer_ranges(self.headers[j], [layer])[0]
            sections[j] = await self._get(self.chunks[j].key, a, b)

        await _each(fetch, len(self.chunks))
        bad = await anyio.to_thread.run_sync(self._place_all, layer, sections, kv, abandon_on_cancel=False)
        if bad:
            for j, _ in bad:
                await self._forget(self.chunks[j].key)
            raise bad[0][1]
        total = sum(len(data) for data in sections)
        self.bytes_read += total
        return total

    def _place_all(
        self, layer: int, sections: list[bytes], kv: KVCache
    ) -> list[tuple[int, ChunkDecodeError]]:
        bad = []
        for j, data in enumerate(sections):
            try:
                self.place(layer, j, data, kv)
            except ChunkDecodeError as exc:
                bad.append((j, exc))
        return bad

    def place(self, layer: int, j: int, data: bytes, kv: KVCache) -> None:
        """Verify one section and copy it to chunk j's token range of layer `layer` (blocking)."""
        chunk, header = self.chunks[j], self.headers[j]
        o, n = chunk.offset, chunk.n_tokens
        dest = kv.data[layer : layer + 1, :, :, o : o + n]
        if dest.device.type == "cpu":
            codec.decode_layers(header, {layer: data}, self.spec, [layer], out=dest)
        else:
            dest.copy_(codec.decode_layers(header, {layer: data}, self.spec, [layer]))

    async def _get(self, key: str, start: int, end: int) -> bytes:
        data = await self.store.get_range(key, start, end)
        if data is None:
            raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
        return data

    async def _forget(self, key: str) -> None:
        """A damaged object is never served again (best effort: the miss is what matters)."""
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.store.delete(key)
