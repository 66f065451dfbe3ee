"""One chunk of a prompt into its rows of a KV cache, and what happens to a damaged one.

A chunk whose bytes, as read, fail their checks (corrupt, truncated, foreign: `DAMAGE_FAULTS`) is deleted
from the store: it is never served again, and the next save writes a good copy. Nothing else deletes a
chunk: a missing one, one without a valid MAC, and a failure to place good bytes (the caller's buffer, a
device, a cancelled copy) leave the store as it was. A fault raises before the chunk counts as loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import anyio
import torch

from kvrestore.chunkio.load import ChunkLoader, Fetched
from kvrestore.core.errors import DAMAGE_FAULTS
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.streams import on_stream
from kvrestore.stores.base import ChunkStore

log = logging.getLogger("kvrestore.chunkio")


async def load_chunk(loader: ChunkLoader, ref: ChunkRef, kv: KVCache) -> int:
    """Fetch, verify and place `ref` in its token range of `kv` (`ChunkLoader.load`); returns the stored
    bytes read. A damaged chunk (`DAMAGE_FAULTS`) is forgotten before its error propagates."""
    try:
        return await loader.load(ref.key, ref.start, kv.chunk(ref.start, ref.end).data)
    except DAMAGE_FAULTS:
        await forget(loader.store, ref.key)
        raise


async def load_chunk_aside(loader: ChunkLoader, ref: ChunkRef, kv: KVCache) -> tuple[int, Callable[[], None]]:
    """`load_chunk` into a buffer of its own (a fetch that may overtake the compute unit writing the
    chunk's rows); returns the stored bytes read and what copies the chunk into `kv` (on the loader's
    stream, the load lane's), to call once nothing else writes those rows."""
    rows = kv.chunk(ref.start, ref.end).data
    stream = loader.stream_for(rows.device)
    with on_stream(stream, rows.device):  # from the load stream's memory: only it writes the buffer
        aside = torch.empty_like(rows)
    try:
        nbytes = await loader.load(ref.key, ref.start, aside)
    except DAMAGE_FAULTS:
        await forget(loader.store, ref.key)
        raise

    def commit() -> None:
        with on_stream(stream, rows.device):
            rows.copy_(aside, non_blocking=True)
        if stream is not None:
            stream.synchronize()

    return nbytes, commit


def load_chunk_sync(loader: ChunkLoader, ref: ChunkRef, kv: KVCache, damaged: list[str]) -> int:
    """`load_chunk`, blocking (`fetch_chunk_sync`, then its `place`)."""
    return fetch_chunk_sync(loader, ref, kv, damaged).place()


def fetch_chunk_sync(loader: ChunkLoader, ref: ChunkRef, kv: KVCache, damaged: list[str]) -> Fetched:
    """The read of `load_chunk` on a load-lane thread (stores that read without the loop), nothing yet
    written into `kv`: returns what places the chunk (`Fetched.place`) or gives its bytes back unused
    (`discard`: the load was abandoned). A damaged chunk's key goes to `damaged`, to be forgotten on the
    loop (`forget`) once the restore is over."""
    try:
        fetched = loader.fetch_sync(ref.key, ref.start, kv.chunk(ref.start, ref.end).data)
    except DAMAGE_FAULTS:
        damaged.append(ref.key)
        raise
    return _NotingDamage(fetched, damaged)


class _NotingDamage(Fetched):
    """A `Fetched` whose placing, when it finds the bytes damaged, notes the key in `damaged`."""

    __slots__ = ("damaged",)

    def __init__(self, fetched: Fetched, damaged: list[str]) -> None:
        super().__init__(
            fetched.loader, fetched.key, fetched.start, fetched.dest, fetched.data, fetched.staged
        )
        self.damaged = damaged

    def place(self) -> int:
        try:
            return super().place()
        except DAMAGE_FAULTS:
            self.damaged.append(self.key)
            raise


async def forget(store: ChunkStore, key: str) -> None:
    """Delete a damaged chunk: never serve it again; the next save writes a good copy."""
    log.warning("chunk %s is damaged: deleted from the store (the next save writes it again)", key)
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await store.delete(key)  # best effort: the miss is what matters
