"""In-process chunk store with a byte-capacity LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .base import ChunkStore, check_key


class MemoryStore(ChunkStore):
    """A dict of objects, least-recently-used first, evicted once `bytes_used` exceeds `capacity_bytes`.

    `get` and `get_range` count as use; `contains` does not. An object larger than the whole capacity is
    not stored (and any older object under its key is dropped). Everything runs on the event loop
    thread without awaiting, so no locking is needed.
    """

    name = "memory://"

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._objects)

    def _lookup(self, key: str) -> bytes | None:
        data = self._objects.get(check_key(key))
        if data is None:
            self.misses += 1
            return None
        self._objects.move_to_end(key)
        self.hits += 1
        return data

    def _drop(self, key: str) -> None:
        old = self._objects.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old)

    async def get(self, key: str) -> bytes | None:
        return self._lookup(key)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        data = self._lookup(key)
        return None if data is None else data[start:end]

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        data = bytes(data)  # no copy for bytes; snapshot for bytearray / memoryview
        self._drop(key)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            return
        self._objects[key] = data
        self.bytes_used += len(data)
        if self.capacity_bytes is not None:
            while self.bytes_used > self.capacity_bytes:
                _, victim = self._objects.popitem(last=False)
                self.bytes_used -= len(victim)
                self.evictions += 1

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [check_key(k) in self._objects for k in keys]

    async def delete(self, key: str) -> None:
        self._drop(check_key(key))
