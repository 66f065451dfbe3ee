"""In-process chunk store with a byte capacity that evicts (LRU unless another policy is given)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.settings import check_bool, check_int
from kvrestore.stores.base import ChunkStore, StoredObject, check_key, copy_object, mirrors_reads_of
from kvrestore.stores.eviction import EvictionPolicy, make_policy
from kvrestore.stores.files import check_range


class MemoryStore(ChunkStore):
    """A dict of objects, evicted by `eviction` (default LRU) once `bytes_used` exceeds `capacity_bytes`.

    `get` and `get_range` count as use; `contains` does not. Without a capacity nothing is evicted, and
    the policy is told nothing. An object larger than the whole capacity is
    not stored (and any older object under its key is dropped). Reads may also come from load-lane threads
    (`get_sync`), so the index and the eviction state change under a lock.

    `pinned=True` keeps every object in page-locked host memory (a CUDA machine's host tier, as vLLM's
    CPU offload keeps it): `get` then hands out a memoryview of it, and a chunk goes to the GPU with one
    DMA copy straight from the store, no host copy first (`chunkio`). Writing costs one copy into it.
    """

    name = "memory://"
    reads_in_memory = True

    @property
    def reads_sync(self) -> bool:  # type: ignore[override]
        """From any thread, unless a subclass changed how it reads."""
        return mirrors_reads_of(self, MemoryStore)

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        eviction: EvictionPolicy | str | None = None,
        pinned: bool = False,
    ) -> None:
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
        if check_bool("pinned", pinned) and not torch.cuda.is_available():
            raise InvalidInputError("MemoryStore(pinned=True) needs CUDA: page-locked memory is for uploads")
        self.pinned = pinned
        self.capacity_bytes = capacity_bytes
        self.eviction = make_policy(eviction)
        self._objects: dict[str, bytes | memoryview] = {}
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._objects)

    def __repr__(self) -> str:
        cap = f"capacity_bytes={self.capacity_bytes}" if self.capacity_bytes is not None else ""
        return f"{type(self).__name__}({cap})"

    def _lookup(self, key: str) -> bytes | memoryview | None:
        check_key(key)
        with self._lock:
            data = self._objects.get(key)
            if data is None:
                self.misses += 1
                return None
            if self.capacity_bytes is not None:
                self.eviction.touch(key)
            self.hits += 1
            return data

    def get_sync(self, key: str) -> bytes | memoryview | None:
        return self._lookup(key)

    def _drop(self, key: str) -> None:
        old = self._objects.pop(key, None)
        if self.capacity_bytes is not None:
            self.eviction.remove(key)
        if old is not None:
            self.bytes_used -= len(old)

    async def get(self, key: str) -> bytes | None:
        return self._lookup(key)  # type: ignore[return-value]  # a memoryview when pinned: bytes-like

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        data = self._lookup(key)
        return None if data is None else bytes(data[start:end])

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        if self.pinned:  # one GIL-free copy into page-locked memory, before any state changes
            host = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
            # keeps `host` alive; an ndarray has the buffer protocol (numpy's stubs say so only on 3.12+)
            view = memoryview(host.numpy()).cast("B")  # type: ignore[arg-type,unused-ignore]
            await copy_object(view, data)
            stored: bytes | memoryview = view
        else:
            stored = bytes(data)  # no copy for bytes; snapshot for bytearray / memoryview
        with self._lock:
            self._drop(key)
            if self.capacity_bytes is not None and len(stored) > self.capacity_bytes:
                return
            self._objects[key] = stored
            self.bytes_used += len(stored)
            if self.capacity_bytes is not None:
                self.eviction.add(key, len(stored))
                while self.bytes_used > self.capacity_bytes:
                    victim = self.eviction.victim()
                    if victim is None or victim not in self._objects:  # a policy out of step: fall back
                        victim = next(iter(self._objects))
                    self._drop(victim)
                    self.evictions += 1

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return self._has(keys)

    def contains_sync(self, keys: Sequence[str]) -> list[bool] | None:
        return self._has(keys) if mirrors_reads_of(self, MemoryStore, ("contains",)) else None

    def _has(self, keys: Sequence[str]) -> list[bool]:
        return [check_key(k) in self._objects for k in keys]

    async def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._drop(key)

    async def scan(self) -> list[StoredObject]:
        with self._lock:
            return [StoredObject(k, len(v)) for k, v in self._objects.items()]
