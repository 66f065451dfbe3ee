"""Writing a prompt's chunks: encode each off the event loop and store it, a few at a time.

A store fault fails its chunk only (the others are written and stay stored); once every write has
ended they raise one `SaveError` that says which keys were written and which were not. Any other error
is a bug and propagates as itself, not wrapped in an exception group.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import anyio.to_thread

from kvrestore import codec
from kvrestore.chunkio.stored import each
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import WRITE_FAULTS, SaveError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.stores.base import ChunkStore


@dataclass
class SaveStats:
    n_chunks: int
    written_chunks: int
    skipped_chunks: int  # already stored
    bytes_written: int
    seconds: float


async def write_chunks(
    store: ChunkStore,
    spec: ModelSpec,
    kv: KVCache,
    refs: list[ChunkRef],
    lanes: int,
    compression: str,
    encoding: str = "native",
    seal: Seal | None = None,
) -> int:
    """Encode (in `encoding`, `codec.quant`; signed with `seal` where given) and store `refs`' chunks of
    `kv`, `lanes` at a time; returns the bytes written. Store faults (`WRITE_FAULTS`) fail their chunk only: `SaveError` once all writes
    have ended."""
    nbytes = 0
    written: list[str] = []
    failed: dict[str, Exception] = {}
    limiter = anyio.CapacityLimiter(lanes)

    async def write(ref: ChunkRef) -> None:
        nonlocal nbytes
        async with limiter:
            chunk = kv.chunk(ref.start, ref.end)
            blob = await anyio.to_thread.run_sync(
                lambda: codec.encode_chunk(
                    chunk, spec, ref.key, compression=compression, encoding=encoding, seal=seal
                )
            )
            try:
                await store.put(ref.key, blob)
            except WRITE_FAULTS as exc:
                failed[ref.key] = exc
                return
            written.append(ref.key)
            nbytes += len(blob)

    await each(write, refs)  # a bug, not a store fault, is raised as itself
    if failed:
        first = next(iter(failed.values()))
        raise SaveError(
            f"{len(failed)} of {len(refs)} chunks could not be written ({len(written)} were, and stay "
            f"stored); first error: {type(first).__name__}: {first}",
            written,
            failed,
        ) from first
    return nbytes
