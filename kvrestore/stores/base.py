"""The ChunkStore contract: an async key -> bytes store.

Modelled on LMCache's remote connector base: a small required async core (`get`, `get_range`, `put`,
`contains`, `delete`, `close`) and optional batch methods whose default fallbacks call the core
concurrently; a store overrides them when its backend can do better (one round trip for many keys).
Keys are opaque lowercase hex strings (chunk digests); `check_key` rejects anything else, so a key can
never name a path outside the store.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.to_thread

from ..errors import StoreError

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")

#: How many leading bytes of an object `read_into` hands to `ReadPlan.locate` (enough for a chunk header).
PROBE_BYTES = 4096


class ReadPlan(Protocol):
    """Where the bytes of one object go, decided from its first bytes (see `ChunkStore.read_into`)."""

    def locate(self, prefix: memoryview) -> tuple[int, Sequence[Sequence[memoryview]]]:
        """From the object's first `PROBE_BYTES` (fewer if it is shorter): (offset, groups of buffers).

        The object's bytes from `offset` on fill the groups' writable buffers in order.
        """
        ...

    def filled(self, group: int) -> None:
        """Group `group` is completely filled (raise to stop the read)."""
        ...


def scatter(data: memoryview, offset: int, groups: Sequence[Sequence[memoryview]], plan: ReadPlan) -> int:
    """Copy data[offset:] into the groups' buffers in order, telling `plan` of each group filled.

    Returns the bytes placed (short when data ends early).
    """
    pos = offset
    for i, group in enumerate(groups):
        for buf in group:
            n = max(0, min(buf.nbytes, len(data) - pos))
            buf[:n] = data[pos : pos + n]
            pos += n
            if n < buf.nbytes:
                return pos - offset
        plan.filled(i)
    return pos - offset


async def place(data: bytes, plan: ReadPlan) -> int:
    """Copy a whole fetched object into the buffers `plan` names (off the event loop); bytes placed."""

    def run() -> int:
        mv = memoryview(data)
        offset, groups = plan.locate(mv[:PROBE_BYTES])
        return scatter(mv, offset, groups, plan)

    return await anyio.to_thread.run_sync(run)


def check_key(key: str) -> str:
    """Return `key` if it is a valid store key (16-128 lowercase hex digits), else raise ValueError."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"invalid store key {key!r}: keys are 16-128 lowercase hex digits")
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

    # -- optional batch methods with default fallbacks -------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Fetch several objects concurrently."""
        out: list[bytes | None] = [None] * len(keys)

        async def one(i: int, k: str) -> None:
            out[i] = await self.get(k)

        async with anyio.create_task_group() as tg:
            for i, k in enumerate(keys):
                tg.start_soon(one, i, k)
        return out

    async def read_into(self, key: str, plan: ReadPlan) -> int | None:
        """Read an object straight into caller memory: `plan` sees its first bytes and names the buffers.

        Returns the bytes placed in the buffers (fewer than they hold when the object ends early), or
        None when the object is absent. Errors raised by the plan propagate. The default fetches the object whole (one round trip, right for
        object stores) and copies; a local store overrides it to read into the buffers with no copy.
        """
        data = await self.get(key)
        return None if data is None else await place(data, plan)

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        """Several byte ranges of one object, fetched concurrently."""
        out: list[bytes | None] = [None] * len(ranges)

        async def one(i: int, a: int, b: int) -> None:
            out[i] = await self.get_range(key, a, b)

        async with anyio.create_task_group() as tg:
            for i, (a, b) in enumerate(ranges):
                tg.start_soon(one, i, a, b)
        return out

    async def scan(self) -> list[StoredObject]:
        """Every object the store holds (to rebuild a capacity index after a restart).

        Optional: stores that cannot list raise NotImplementedError.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its objects")

    def prefetch(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Hint: these keys will be read soon, in this order. Stores with a read-ahead buffer start them."""

    async def flush(self) -> None:  # noqa: B027 - optional hook
        """Wait until every write accepted so far has reached its final place (write-back stores)."""

    async def __aenter__(self) -> ChunkStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = [
    "PROBE_BYTES",
    "ChunkStore",
    "ReadPlan",
    "StoreError",
    "StoredObject",
    "check_key",
    "is_key",
    "place",
    "scatter",
]
