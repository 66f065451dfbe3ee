"""A byte capacity for any store: `BoundedStore(inner, capacity_bytes)` evicts by a pluggable policy.

The wrapper keeps an index {key: size} and an `EvictionPolicy` (LRU by default). Writes past the capacity
delete victims from the inner store, so a disk directory or an S3 prefix really stays under its size.
The index is rebuilt from `inner.scan()` on first use (a restarted process keeps its disk tier, oldest
write first), and objects other processes wrote are adopted when they are read.

In a fleet sharing one directory or bucket, each process enforces the capacity from its own view (its
scan plus what it wrote and read since), so the total can exceed the capacity between scans by what the
others wrote meanwhile; it never loses an object it was not asked to evict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio

from ..errors import StoreError
from .base import ChunkStore, StoredObject, check_key
from .eviction import EvictionPolicy, make_policy


class BoundedStore(ChunkStore):
    """`inner` capped at `capacity_bytes`, evicting by `eviction` ("lru", "fifo" or a policy object)."""

    def __init__(
        self, inner: ChunkStore, capacity_bytes: int, *, eviction: EvictionPolicy | str | None = None
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.inner = inner
        self.capacity_bytes = capacity_bytes
        self.eviction = make_policy(eviction)
        self.name = inner.name
        self._sizes: dict[str, int] = {}
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.evict_errors = 0
        self._indexed = False

    def __len__(self) -> int:
        return len(self._sizes)

    # -- index -------------------------------------------------------------------------------------

    def _track(self, key: str, size: int) -> None:
        self._untrack(key)
        self._sizes[key] = size
        self.bytes_used += size
        self.eviction.add(key, size)

    def _untrack(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.bytes_used -= size
        self.eviction.remove(key)

    async def _ensure_index(self) -> None:
        """Rebuild the index from a listing of the inner store, once (oldest write = first victim)."""
        if self._indexed:
            return
        self._indexed = True  # a failed listing is not retried on every call
        try:
            found = await self.inner.scan()
        except NotImplementedError:
            return
        except (StoreError, OSError):
            return  # the store is down: start from what this process writes
        for obj in sorted(found, key=lambda o: o.mtime):
            if obj.key not in self._sizes:
                self._track(obj.key, obj.size)
        await self._evict()

    async def _evict(self, keep: str | None = None) -> None:
        victims = []
        while self.bytes_used > self.capacity_bytes:
            victim = self.eviction.victim()
            if victim is None or victim == keep:
                if victim == keep:  # the policy would evict what was just written: take the next
                    others = [k for k in self._sizes if k != keep]
                    if not others:
                        break
                    victim = others[0]
                else:
                    break
            if victim not in self._sizes:  # a policy out of step with the index
                self.eviction.remove(victim)
                continue
            self._untrack(victim)
            victims.append(victim)
        if not victims:
            return
        self.evictions += len(victims)

        async def drop(key: str) -> None:
            try:
                await self.inner.delete(key)
            except (StoreError, OSError):
                self.evict_errors += 1  # stays on the store, untracked; the next scan finds it

        with anyio.CancelScope(shield=True):  # an eviction half done would leave the index wrong
            async with anyio.create_task_group() as tg:
                for key in victims:
                    tg.start_soon(drop, key)

    async def _seen(self, key: str, size: int | None) -> None:
        """A read hit: use it, or adopt an object another process wrote."""
        self.hits += 1
        if key in self._sizes:
            self.eviction.touch(key)
        elif size is not None:
            self._track(key, size)
            await self._evict(keep=key)

    def _missed(self, key: str) -> None:
        self.misses += 1
        self._untrack(key)

    # -- ChunkStore ----------------------------------------------------------------------------------

    @property
    def reads_in_memory(self) -> bool:  # type: ignore[override]
        return self.inner.reads_in_memory

    async def get(self, key: str) -> bytes | None:
        await self._ensure_index()
        data = await self.inner.get(key)
        if data is None:
            self._missed(key)
        else:
            await self._seen(key, len(data))
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        await self._ensure_index()
        data = await self.inner.get_range(key, start, end)
        if data is None:
            self._missed(key)
        else:
            await self._seen(key, None)
        return data

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        await self._ensure_index()
        out = await self.inner.get_ranges(key, ranges)
        if out and out[0] is None:
            self._missed(key)
        elif out:
            await self._seen(key, None)
        return out

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        await self._ensure_index()
        size = await self.inner.read_into(key, buffer)
        if size is None:
            self._missed(key)
        else:
            await self._seen(key, None)
        return size

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        await self._ensure_index()
        if len(data) > self.capacity_bytes:  # can never fit: drop any older copy, store nothing
            self._untrack(key)
            with contextlib.suppress(StoreError, OSError):
                await self.inner.delete(key)
            return
        await self.inner.put(key, data)
        self._track(key, len(data))
        await self._evict(keep=key)

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.contains(keys)

    async def delete(self, key: str) -> None:
        check_key(key)
        self._untrack(key)
        await self.inner.delete(key)

    async def scan(self) -> list[StoredObject]:
        return await self.inner.scan()

    def prefetch(self, keys: Sequence[str]) -> None:
        self.inner.prefetch(keys)

    async def flush(self) -> None:
        await self.inner.flush()

    async def close(self) -> None:
        await self.inner.close()

    def __repr__(self) -> str:
        return f"BoundedStore({self.inner!r}, capacity_bytes={self.capacity_bytes})"


__all__ = ["BoundedStore"]
