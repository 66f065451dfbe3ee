"""What every read of stored chunks shares: the chunks it could not read (`ChunkLoadFailed`), the one
rule for a damaged chunk (`forget`), the one schedule of a read along layers (`read_plan`), and how it
runs one read per chunk concurrently (`each`).

Only proven damage deletes: a chunk whose bytes, as read, fail their checks (corrupt, truncated,
foreign: `core.errors.proves_damage`) is deleted from the store, so it is never served again and the next save
writes a good copy. A missing chunk, one without a valid MAC, a store fault and a failure to place good
bytes (the caller's buffer, a device, a cancelled copy) leave the store as it was.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio

from kvrestore.core.errors import ChunkDecodeError, MissingChunkError
from kvrestore.stores.base import ChunkStore, in_order

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")

log = logging.getLogger("kvrestore.chunkio")


class ChunkLoadFailed(ChunkDecodeError):
    """A layer of some chunks could not be read after their headers were: those chunks are misses."""

    def __init__(self, indices: Sequence[int], error: str) -> None:
        super().__init__(f"chunks {list(indices)}: {error}")
        self.indices = list(indices)
        self.error = error


async def each(fn: Callable[[T], Coroutine[Any, Any, None]], items: Sequence[T]) -> None:
    """fn(item) for every item concurrently; an unexpected error is raised as itself (the first inside
    the exception groups), not as a group."""
    try:
        await in_order([partial(fn, x) for x in items])
    except BaseExceptionGroup as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        raise exc from None


async def get_all(store: ChunkStore, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """`ranges` of the object `key`, in one `get_ranges` call; MissingChunkError where it is gone."""
    got = await store.get_ranges(key, ranges)
    found = [g for g in got if g is not None]
    if len(found) < len(got):
        raise MissingChunkError(f"chunk {key[:12]} is not in the store")
    return found


async def forget(store: ChunkStore, key: str) -> None:
    """Delete a damaged chunk: never serve it again; the next save writes a good copy (best effort: the
    miss is what matters, and a cancelled caller still deletes it)."""
    log.warning("chunk %s is damaged: deleted from the store (the next save writes it again)", key)
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await store.delete(key)


def read_plan(first: int, stop: int, per_read: int) -> list[range]:
    """The reads that cover layers [first, stop): the first layer alone (what the compute waits for
    first, and what a restore times the link by), then `per_read` consecutive layers at a time (their
    sections lie back to back: one range read per chunk, fewer host calls per layer)."""
    step = max(1, per_read)
    plan = [range(first, min(first + 1, stop))] if first < stop else []
    return plan + [range(a, min(a + step, stop)) for a in range(first + 1, stop, step)]


def layers_name(layers: range) -> str:
    """How errors name the layers of a read: "layer 3", "layers 3-6"."""
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
