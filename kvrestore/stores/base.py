"""The ChunkStore contract: an async key -> bytes store.

Modelled on LMCache's remote connector base: a small required async core (`get`, `get_range`, `put`,
`contains`, `delete`, `close`) and optional batch methods whose default fallbacks call the core
concurrently; a store overrides them when its backend can do better (one round trip for many keys).
Keys are opaque lowercase hex strings (chunk digests); `check_key` rejects anything else, so a key can
never name a path outside the store.
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np

from kvrestore.core.errors import InvalidInputError, StoreError

T = TypeVar("T")

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")

#: objects up to this size are copied into a caller's buffer on the event loop; larger ones in a thread
INLINE_COPY_BYTES = 1 << 20


def copy_into(buffer: memoryview, data: bytes | bytearray | memoryview) -> int:
    """Copy as much of `data` as fits into `buffer` with one bulk copy that releases the GIL (numpy's
    copy, one thread: torch's CPU copy would spread over every core and starve a launching thread).
    Returns the bytes copied."""
    n = min(len(buffer), len(data))
    if n:
        np.copyto(np.frombuffer(buffer, np.uint8, n), np.frombuffer(data, np.uint8, n))
    return n


async def copy_object(buffer: memoryview, data: bytes | bytearray | memoryview) -> int:
    """`copy_into`, off the event loop for a large object; returns the object's size (see `read_into`)."""
    if len(data) <= INLINE_COPY_BYTES:
        copy_into(buffer, data)
    else:
        await anyio.to_thread.run_sync(copy_into, buffer, data)
    return len(data)


async def in_order(calls: Sequence[Callable[[], Awaitable[T]]], limit: int | None = None) -> list[T]:
    """Run `calls` concurrently, at most `limit` at a time where given; their results in order."""
    out: list[Any] = [None] * len(calls)
    limiter = anyio.CapacityLimiter(limit) if limit else contextlib.nullcontext()

    async def one(i: int) -> None:
        async with limiter:
            out[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return out


def mirrors_reads_of(
    store: ChunkStore, owner: type[ChunkStore], methods: Sequence[str] = ("get", "read_into")
) -> bool:
    """Whether `store` reads as `owner` does: a subclass that overrides `get` or `read_into` (to delay,
    count or transform reads; or whichever `methods` a blocking face stands for, e.g. `contains`) must
    not be bypassed by `owner`'s blocking `*_sync` faces."""
    cls = type(store)
    return all(getattr(cls, m) is getattr(owner, m) for m in methods)


def check_key(key: str) -> str:
    """Return `key` if it is a valid store key (16-128 lowercase hex digits), else raise InvalidInputError."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise InvalidInputError(f"invalid store key {key!r}: keys are 16-128 lowercase hex digits")
    return key


def is_key(name: str) -> bool:
    """Whether `name` is a valid store key (for scans that must skip foreign files)."""
    return bool(_KEY_RE.match(name))


@dataclass(frozen=True)
class StoredObject:
    """One object found by `ChunkStore.scan`: its key, size in bytes and last write time (epoch s)."""

    key: str
    size: int
    mtime: float = 0.0


class ChunkStore(ABC):
    """Async byte store for chunk objects."""

    #: URL-ish description for logs and stats
    name: str = "store"
    #: whether `get` hands out bytes the store already holds in this process (no I/O, no copy), so a
    #: reader that verifies and places them itself is best served by `get` rather than `read_into`
    reads_in_memory: bool = False
    #: whether `get_sync` / `read_into_sync` work: the store can hand over an object from any thread without
    #: the event loop (memory of this process, a local directory), so a chunk load runs start to end on a
    #: load-lane thread (`kvrestore.runtime.lanes`). A wrapper that does anything on a read (throttle, count,
    #: promote) leaves it False, and its reads go through its async methods; see `mirrors_reads_of`.
    reads_sync: bool = False
    #: the local directory that holds the objects, where processes of this host can share them (None
    #: for any other store); a `BoundedStore` over it keeps one capacity for all of those processes
    local_dir: str | None = None

    @abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The whole object, or None when absent."""

    @abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of the object (shorter if the object is shorter), or None when absent."""

    @abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Store an object atomically: a reader sees the old object, the new one, or none, never a part."""

    @abstractmethod
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` exist."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove an object; absent keys are ignored."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    async def connect(self) -> None:  # noqa: B027 - optional hook
        """Make ready what a call needs that is no request to the server (a client session, built on
        the running event loop), so a deadline on the call measures the server alone."""

    # -- optional batch methods with default fallbacks -------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Fetch several objects concurrently."""
        return await in_order([partial(self.get, k) for k in keys])

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        """Read the object into `buffer` from its first byte, with as few bulk copies as the store allows.

        Returns the object's size (when it is larger than `buffer`, only `len(buffer)` bytes were
        placed: read it again into a larger buffer), or None when absent. A store that reads no more
        than fits (a ranged read) may answer `len(buffer) + 1` for any larger object. The default fetches the object
        whole (one round trip, right for object stores) and copies it; a local directory reads straight
        into the buffer (`preadv`). Nothing is verified here: the caller checks the bytes.
        """
        data = await self.get(key)
        return None if data is None else await copy_object(buffer, data)

    def contains_sync(self, keys: Sequence[str]) -> list[bool] | None:
        """`contains` from any thread, blocking, for a store that answers without its event loop (a local
        directory, memory of this process); None for every other store (ask `contains`)."""
        return None

    def get_sync(self, key: str) -> bytes | memoryview | None:
        """`get` from any thread, blocking, where `reads_sync` (else NotImplementedError)."""
        raise NotImplementedError(f"{type(self).__name__} reads through its event loop")

    def read_into_sync(self, key: str, buffer: memoryview) -> int | None:
        """`read_into` from any thread, blocking, where `reads_sync` (else NotImplementedError)."""
        data = self.get_sync(key)
        if data is None:
            return None
        copy_into(buffer, data)
        return len(data)

    def scatter_into_sync(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int | None:
        """Read the object's bytes from `offset` on into `buffers`, filling one after another (a scatter
        read, e.g. straight into a KV cache's rows), from any thread, where `reads_sync`. Returns the bytes
        placed (fewer than the buffers hold when the object ends first), or None when absent. The default
        takes the object whole (`get_sync`) and copies it."""
        data = self.get_sync(key)
        if data is None:
            return None
        view, placed = memoryview(data)[offset:], 0
        for buf in buffers:
            n = copy_into(buf, view[placed:])
            placed += n
            if n < len(buf):
                break
        return placed

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        """Several byte ranges of one object, fetched concurrently."""
        return await in_order([partial(self.get_range, key, a, b) for a, b in ranges])

    async def scan(self) -> list[StoredObject]:
        """Every object the store holds (to rebuild a capacity index after a restart).

        Optional: stores that cannot list raise NotImplementedError.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its objects")

    def prefetch(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Hint: these keys will be read soon, in this order. Stores with a read-ahead buffer start them."""

    def delivered_bytes(self) -> float | None:
        """Bytes the store's reads have received so far, those of reads still in flight included, where
        it sees a read's bytes arrive (a throttled link); None where it sees them only once the read
        has finished. A restore that knows nothing of the link yet judges its speed by how this grows
        while its first fetches are in flight, instead of waiting for one of them to land."""
        return None

    async def flush(self) -> None:  # noqa: B027 - optional hook
        """Wait until every write accepted so far has reached its final place (write-back stores)."""

    async def __aenter__(self) -> ChunkStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = [
    "ChunkStore",
    "StoreError",
    "StoredObject",
    "check_key",
    "copy_into",
    "copy_object",
    "is_key",
    "mirrors_reads_of",
]
