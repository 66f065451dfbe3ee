"""Whole chunks of a prompt into their rows of a KV cache (a token-wise restore's loads).

A damaged chunk is forgotten as every read forgets one (`stored.forget`); a fault raises before the
chunk counts as loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrestore.chunkio.load import ChunkLoader, Fetched
from kvrestore.chunkio.stored import forget
from kvrestore.core.errors import ChunkDecodeError, proves_damage
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.streams import on_stream


async def load_chunk(loader: ChunkLoader, ref: ChunkRef, kv: KVCache, first: int = 0) -> int:
    """Fetch, verify and place `ref` in its token range of `kv` (`ChunkLoader.load`), which begins at
    token `first` of the prompt; returns the stored bytes read. A damaged chunk (`proves_damage`) is
    forgotten before its error propagates."""
    try:
        return await loader.load(ref.key, ref.start, kv.chunk(ref.start - first, ref.end - first).data)
    except ChunkDecodeError as exc:
        if proves_damage(exc):
            await forget(loader.store, ref.key)
        raise


async def load_chunks(loader: ChunkLoader, refs: list[ChunkRef], kv: KVCache, first: int = 0) -> int:
    """`load_chunk` of each of `refs` (a unit's chunks), one after another; the stored bytes read."""
    nbytes = 0
    for ref in refs:
        nbytes += await load_chunk(loader, ref, kv, first)
    return nbytes


async def load_chunks_aside(
    loader: ChunkLoader, refs: list[ChunkRef], kv: KVCache
) -> tuple[int, Callable[[], None]]:
    """`load_chunks` into a buffer of their own (a fetch that may overtake the compute unit writing the
    chunks' rows); returns the stored bytes read and what copies the chunks into `kv` (on the loader's
    stream, the load lane's), to call once nothing else writes those rows."""
    first = refs[0].start
    rows = kv.chunk(first, refs[-1].end).data
    stream = loader.stream_for(rows.device)
    with on_stream(stream, rows.device):  # from the load stream's memory: only it writes the buffer
        aside = KVCache(kv.spec, torch.empty_like(rows))
    nbytes = await load_chunks(loader, refs, aside, first)

    def commit() -> None:
        with on_stream(stream, rows.device):
            rows.copy_(aside.data, non_blocking=True)
        if stream is not None:
            stream.synchronize()

    return nbytes, commit


def fetch_chunk_sync(loader: ChunkLoader, ref: ChunkRef, kv: KVCache, damaged: list[str]) -> Fetched:
    """The read of `load_chunk` on a load-lane thread (stores that read without the loop), nothing yet
    written into `kv`: returns what places the chunk (`Fetched.place`) or gives its bytes back unused
    (`discard`: the load was abandoned). A damaged chunk's key goes to `damaged`, to be forgotten on the
    loop (`forget`) once the restore is over."""
    try:
        fetched = loader.fetch_sync(ref.key, ref.start, kv.chunk(ref.start, ref.end).data)
    except ChunkDecodeError as exc:
        if proves_damage(exc):
            damaged.append(ref.key)
        raise
    fetched.damaged = damaged
    return fetched


def fetch_chunks_sync(
    loader: ChunkLoader, refs: list[ChunkRef], kv: KVCache, damaged: list[str]
) -> Fetched | AllFetched:
    """`fetch_chunk_sync` of each of `refs` (a unit's chunks): every read first, then one `place` places
    them all, or one `discard` drops them all."""
    fetched: list[Fetched] = []
    try:
        for ref in refs:
            fetched.append(fetch_chunk_sync(loader, ref, kv, damaged))
    except BaseException:
        for f in fetched:
            f.discard()
        raise
    return fetched[0] if len(fetched) == 1 else AllFetched(fetched)


class AllFetched:
    """Several chunks read (`Fetched`), placed or dropped together."""

    def __init__(self, fetched: list[Fetched]) -> None:
        self.fetched = fetched

    def place(self) -> int:
        nbytes = 0
        try:
            for f in self.fetched:
                nbytes += f.place()
        finally:
            self.discard()  # those not placed (after a fault): a placed one gave its bytes back already
        return nbytes

    def discard(self) -> None:
        for f in self.fetched:
            f.discard()
