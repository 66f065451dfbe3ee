"""A byte capacity for any store: `BoundedStore(inner, capacity_bytes)` evicts by a pluggable policy.

The wrapper keeps an index {key: size} and an `EvictionPolicy` (LRU by default). A write first makes
room: it reserves its bytes, deletes victims from the inner store until they fit beside the objects and
every other write in flight, and only then writes. So a disk directory or an S3 prefix never holds more
than the capacity, also while many writes run at once (never write first and evict after). An object
larger than the whole capacity is refused with StoreError: it could never be stored, and a write that
returned must have stored its object. The index is rebuilt from `inner.scan()` on first use (a restarted
process keeps its disk tier, oldest write first), and objects other processes wrote are adopted when
they are read.

Several processes sharing one store:

* a local directory (`inner.local_dir`, seen through any wrappers, on a POSIX system): one capacity for
  all of them, room made under a lock with the directory as the account (`shared_dir`). The price is a
  listing per write; a `LocalStore` re-reads only the shard directories changed since the last one.
* any other store (S3, memory, a tiered store): a per-process limit. Each process enforces the capacity
  from its own view (its scan plus what it wrote and read since), so N processes sharing a prefix can
  hold up to N times the capacity; none ever loses an object it was not asked to evict.

Writers that do not go through a BoundedStore (a plain FsspecStore on the same directory) are not held
back; their objects count from the next listing, or once read.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial

import anyio
import anyio.lowlevel
import anyio.to_thread

from kvrestore.core.errors import StoreError
from kvrestore.core.settings import check_int
from kvrestore.stores.base import ChunkStore, check_key, in_order
from kvrestore.stores.eviction import EvictionPolicy, make_policy
from kvrestore.stores.shared_dir import SharedDir
from kvrestore.stores.wrapper import WrapperStore


class BoundedStore(WrapperStore):
    """`inner` capped at `capacity_bytes`, evicting by `eviction` ("lru", "fifo" or a policy object);
    see the module docstring."""

    #: seconds a write waits for room held by other writes in flight before it fails (StoreError)
    room_timeout_s: float = 30.0

    def __init__(
        self, inner: ChunkStore, capacity_bytes: int, *, eviction: EvictionPolicy | str | None = None
    ) -> None:
        capacity_bytes = check_int("capacity_bytes", capacity_bytes)
        super().__init__(inner)
        self.capacity_bytes = capacity_bytes
        self.eviction = make_policy(eviction)
        root = inner.local_dir
        #: the directory whose processes share this capacity; None: a per-process limit
        self.shared = SharedDir(root) if root is not None and SharedDir.available() else None
        self._sizes: dict[str, int] = {}
        self.bytes_used = 0  # bytes of the objects in the index
        self._reserved = 0  # bytes of this process's writes in flight (per-process limit only)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.evict_errors = 0
        self._listed = False  # per-process: the one listing was made
        self._fresh: set[str] | None = None  # keys tracked while a listing runs
        self._started = False  # the first call made room (a restart over a smaller capacity)
        self._lock: anyio.Lock | None = None
        self._lock_loop: object = None

    def __len__(self) -> int:
        return len(self._sizes)

    # -- index -------------------------------------------------------------------------------------

    def _track(self, key: str, size: int) -> None:
        if self._fresh is not None:
            self._fresh.add(key)
        self._untrack(key)
        self._sizes[key] = size
        self.bytes_used += size
        self.eviction.add(key, size)

    def _untrack(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.bytes_used -= size
        self.eviction.remove(key)

    async def _list(self) -> None:
        """Make the index what a listing finds: objects gone leave it, new ones join oldest first. An
        object tracked while the listing ran (a write that landed meanwhile) is newer than the listing."""
        self._fresh = fresh = set[str]()
        try:
            found = await self.inner.scan()
        finally:
            self._fresh = None
        sizes = self._sizes
        differ = [o for o in found if sizes.get(o.key) != o.size]
        if len(sizes) + len(differ) > len(found):  # else every indexed object was listed
            for key in sizes.keys() - {o.key for o in found} - fresh:
                self._untrack(key)
        for obj in sorted((o for o in differ if o.key not in fresh), key=lambda o: o.mtime):
            self._track(obj.key, obj.size)

    async def _refresh(self) -> int:
        """Bring the index up to date (with room-making exclusive); returns the bytes of writes in flight."""
        if self.shared is not None:
            held = await anyio.to_thread.run_sync(self.shared.reserved)  # before the objects: shared_dir
            await self._list()
            return held
        if not self._listed:
            self._listed = True  # a failed listing is not retried on every call
            with contextlib.suppress(NotImplementedError, StoreError, OSError):  # start from what we write
                await self._list()
        return self._reserved

    # -- making room ---------------------------------------------------------------------------------

    def _process_lock(self) -> anyio.Lock:
        """One lock per event loop (a store may serve several `anyio.run`s one after another)."""
        loop = anyio.lowlevel.current_token()
        if self._lock is None or self._lock_loop != loop:
            self._lock, self._lock_loop = anyio.Lock(), loop
        return self._lock

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Room-making alone: in this process, and in every process sharing the directory."""
        async with self._process_lock():
            if self.shared is None:
                yield
                return
            fd = await anyio.to_thread.run_sync(self.shared.lock)
            try:
                yield
            finally:
                self.shared.unlock(fd)

    def _victim(self, keep: str | None) -> str | None:
        while (victim := self.eviction.victim()) is not None:
            if victim == keep:  # the policy would evict what was just read: take the next
                return next((k for k in self._sizes if k != keep), None)
            if victim in self._sizes:
                return victim
            self.eviction.remove(victim)  # a policy out of step with the index
        return None

    async def _make_room(
        self, size: int, keep: str | None = None, first: str | None = None
    ) -> tuple[int, int]:
        """Evict until `size` more bytes fit (with room-making exclusive): `first` (the old copy of an
        object being rewritten) before the policy's victims, never `keep`. Returns (bytes still short,
        bytes held by writes in flight): short > 0 when those writes, or objects that could not be
        deleted, leave too little room."""
        held = await self._refresh()
        victims = []
        while self.bytes_used + held + size > self.capacity_bytes:
            v = first if first in self._sizes else self._victim(keep)
            if v is None:
                break
            victims.append((v, self._sizes[v]))
            self._untrack(v)
        stuck = 0
        if victims:
            self.evictions += len(victims)

            async def drop(key: str, nbytes: int) -> None:
                nonlocal stuck
                try:
                    await self.inner.delete(key)
                except (StoreError, OSError):
                    self.evict_errors += 1  # still there, untracked: the next listing finds it
                    stuck += nbytes

            with anyio.CancelScope(shield=True):  # an eviction half done would leave the index wrong
                await in_order([partial(drop, key, nbytes) for key, nbytes in victims])
        return max(0, self.bytes_used + held + stuck + size - self.capacity_bytes), held

    async def _reserve(self, key: str, size: int) -> Callable[[], None]:
        """Make room for `size` bytes and hold it; returns the call that gives it back once the write
        has landed (or failed). Waits while writes in flight hold the room, up to `room_timeout_s`."""
        deadline, pause = time.monotonic() + self.room_timeout_s, 0.001
        while True:
            async with self._exclusive():
                short, held = await self._make_room(size, first=key)
                self._started = True
                if not short:
                    if self.shared is not None:
                        return partial(SharedDir.release, self.shared.reserve(size))
                    self._reserved += size
                    return partial(self._unreserve, size)
            if not held or time.monotonic() > deadline:
                raise StoreError(
                    f"cannot write {key[:12]}: {self.name} is {short} bytes short of room for {size} "
                    f"(capacity {self.capacity_bytes}, writes in flight hold {held}, "
                    f"{self.evict_errors} evictions failed)"
                )
            await anyio.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _unreserve(self, size: int) -> None:
        self._reserved -= size

    async def _start(self) -> None:
        """On first use, list the store and evict down to the capacity (a restart with a smaller one).
        A local directory not made yet holds nothing to evict: a read neither makes it nor its lock file."""
        if self._started:
            return
        self._started = True
        if self.shared is not None and not os.path.isdir(self.shared.root):
            return
        with contextlib.suppress(StoreError, OSError):  # a read does not fail over bookkeeping
            async with self._exclusive():
                await self._make_room(0)

    async def _read(self, key: str, found: bool, size: int | None) -> None:
        """Account for a read: a hit is a use; a miss leaves the index; an object another process wrote
        is adopted (and room made when the index is then over the capacity)."""
        if not found:
            self.misses += 1
            self._untrack(key)
            return
        self.hits += 1
        if key in self._sizes:
            self.eviction.touch(key)
            return
        if size is None:
            return
        self._track(key, size)
        if self.bytes_used > self.capacity_bytes:
            with contextlib.suppress(StoreError, OSError):
                async with self._exclusive():
                    await self._make_room(0, keep=key)

    # -- ChunkStore ----------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        await self._start()
        data = await self.inner.get(key)
        await self._read(key, data is not None, None if data is None else len(data))
        return data

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        check_key(key)
        await self._start()
        size = await self.inner.read_into(key, buffer)
        await self._read(key, size is not None, size)
        return size

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_key(key)
        await self._start()
        data = await self.inner.get_range(key, start, end)
        await self._read(key, data is not None, None)
        return data

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        check_key(key)
        await self._start()
        out = await self.inner.get_ranges(key, ranges)
        if out:
            await self._read(key, out[0] is not None, None)
        return out

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        size = len(data)
        if size > self.capacity_bytes:
            raise StoreError(
                f"cannot write {key[:12]}: {size} bytes is more than the whole capacity of {self.name} "
                f"({self.capacity_bytes} bytes)"
            )
        release = await self._reserve(key, size)
        try:
            await self.inner.put(key, data)
            self._track(key, size)
        finally:
            release()  # after the object counts in the index: never neither

    async def delete(self, key: str) -> None:
        check_key(key)
        self._untrack(key)
        await self.inner.delete(key)

    def __repr__(self) -> str:
        return f"BoundedStore({self.inner!r}, capacity_bytes={self.capacity_bytes})"


__all__ = ["BoundedStore"]
