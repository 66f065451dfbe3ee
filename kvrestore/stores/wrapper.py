"""WrapperStore: the base of every store that wraps one other store (throttle, bound, prefetch).

Every call a wrapper does not change is passed on to `inner`, so whatever stack of wrappers surrounds a
store, its writes, deletes, lookups, listings (`scan`), hints (`prefetch`), `flush` and `close` reach the
innermost one: a write-back tier below a throttle is still flushed, a capacity below a read-ahead buffer
still rebuilds its index after a restart.

Reads pass through too, in pairs that must change together: a wrapper that overrides `get` overrides
`read_into`, and one that overrides `get_range` overrides `get_ranges` (checked when the class is made),
else one of the pair would bypass what the wrapper does on a read. `get_many` is not passed on: its
default calls the wrapper's own `get`. Nor are the blocking faces (`reads_sync`, `get_sync`,
`read_into_sync`, `scatter_into_sync`): a thread reading the inner store directly would skip the wrapper,
so a wrapper offers them only by implementing them itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrestore.core.settings import check_instance
from kvrestore.stores.base import ChunkStore, StoredObject

#: read methods that must be overridden together (see the module docstring)
READ_PAIRS = (("get", "read_into"), ("get_range", "get_ranges"))


class WrapperStore(ChunkStore):
    """`inner`, with every call passed on unless a subclass changes it."""

    def __init__(self, inner: ChunkStore) -> None:
        check_instance("inner", inner, ChunkStore, f"a ChunkStore ({type(self).__name__} wraps one)")
        self.inner = inner
        self.name = inner.name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for pair in READ_PAIRS:
            passed_on = [m for m in pair if getattr(cls, m) is getattr(WrapperStore, m)]
            if passed_on and len(passed_on) < len(pair):
                raise TypeError(
                    f"{cls.__name__} changes {' and '.join(m for m in pair if m not in passed_on)} but "
                    f"passes {' and '.join(passed_on)} on unchanged: override {', '.join(pair)} together"
                )

    @property
    def reads_in_memory(self) -> bool:  # type: ignore[override]
        return self.inner.reads_in_memory

    @property
    def local_dir(self) -> str | None:  # type: ignore[override]
        return self.inner.local_dir

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        return await self.inner.read_into(key, buffer)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return await self.inner.get_range(key, start, end)

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return await self.inner.get_ranges(key, ranges)

    async def put(self, key: str, data: bytes) -> None:
        await self.inner.put(key, data)

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.contains(keys)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def scan(self) -> list[StoredObject]:
        return await self.inner.scan()

    def prefetch(self, keys: Sequence[str]) -> None:
        self.inner.prefetch(keys)

    def delivered_bytes(self) -> float | None:
        return self.inner.delivered_bytes()

    async def flush(self) -> None:
        await self.inner.flush()

    async def close(self) -> None:
        await self.inner.close()

    async def connect(self) -> None:
        await self.inner.connect()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


__all__ = ["READ_PAIRS", "WrapperStore"]
