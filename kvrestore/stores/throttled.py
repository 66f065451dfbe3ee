"""ThrottledStore: any store, delivered at a fixed rate or a bandwidth trace (reproducible I/O).

The Cake paper controlled its I/O bandwidth to compare policies at chosen speeds (§5.1) and under a
fluctuating link (§5.7); this wrapper does the same for any inner store. Reads fetch from the inner store
at its own speed, then wait until a `Link` (first come, first served in the order the reads were
requested, shared by all concurrent reads) would have delivered those bytes. Writes, `contains` and `delete` pass through; `contains` and a miss
cost one round trip of latency.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from ..bandwidth import BandwidthTrace, Link
from .base import ChunkStore

T = TypeVar("T")


def _length(data: bytes | None) -> int:
    return 0 if data is None else len(data)


class ThrottledStore(ChunkStore):
    """`inner`, read through a link of `bytes_per_s` (or a time-varying `trace`) plus `latency_s`.

    The link's clock starts at construction and at every `reset()`; call it before each measured restore
    so that a trace replays from its start and no earlier transfer is still queued.
    """

    def __init__(
        self,
        inner: ChunkStore,
        bytes_per_s: float | None = None,
        *,
        trace: BandwidthTrace | None = None,
        latency_s: float = 0.0,
    ) -> None:
        if (bytes_per_s is None) == (trace is None):
            raise ValueError("give ThrottledStore exactly one of bytes_per_s or trace")
        if trace is None:
            if not bytes_per_s or bytes_per_s <= 0:
                raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s!r}")
            trace = BandwidthTrace.constant(bytes_per_s)
        self.inner = inner
        self.link = Link(trace, latency_s)
        self.name = f"throttled({inner.name})"
        self.reset()

    @property
    def trace(self) -> BandwidthTrace:
        return self.link.trace

    def reset(self) -> None:
        """Restart the link: an empty queue and the trace from its beginning."""
        self._t0 = time.monotonic()
        self.link.reset()
        self._last_booking: anyio.Event | None = None

    def clock(self) -> float:
        """Seconds on the link's clock."""
        return time.monotonic() - self._t0

    async def _through_link(self, fetch: Callable[[], Awaitable[T]], size: Callable[[T], int]) -> T:
        """Fetch from the inner store, then deliver its bytes in request order (a read's size is known
        only once it has been read, so a read books the link after every earlier request has)."""
        requested_at = self.clock()
        previous, mine = self._last_booking, anyio.Event()
        self._last_booking = mine
        booked = False
        try:
            result = await fetch()
            if previous is not None:
                await previous.wait()
            done = self.link.reserve(requested_at, size(result))
            booked = True
            mine.set()
            await anyio.sleep(max(0.0, done - self.clock()))
            return result
        finally:
            if not booked:  # failed or cancelled before booking: later requests must not wait on it
                mine.set()

    @property
    def reads_in_memory(self) -> bool:  # type: ignore[override]
        return self.inner.reads_in_memory

    async def get(self, key: str) -> bytes | None:
        return await self._through_link(lambda: self.inner.get(key), _length)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return await self._through_link(lambda: self.inner.get_range(key, start, end), _length)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        return await self._through_link(
            lambda: self.inner.read_into(key, buffer), lambda n: min(n or 0, len(buffer))
        )

    async def put(self, key: str, data: bytes) -> None:
        await self.inner.put(key, data)

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        found = await self.inner.contains(keys)
        await anyio.sleep(self.link.latency_s)
        return found

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()
