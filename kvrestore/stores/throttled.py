"""ThrottledStore: any store, delivered at a fixed rate or a bandwidth trace (reproducible I/O).

The Cake paper controlled its I/O bandwidth to compare policies at chosen speeds (§5.1) and under a
fluctuating link (§5.7); this wrapper does the same for any inner store. Reads fetch from the inner store
at its own speed, then wait until a `Link` (first come, first served in the order the reads were
requested, shared by all concurrent reads) would have delivered those bytes. `contains` and a miss cost
one round trip of latency; everything else (writes, deletes, `scan`, `flush`, `close`) passes through
unthrottled (`WrapperStore`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.settings import check_number
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.wrapper import WrapperStore

T = TypeVar("T")


def _length(data: bytes | None) -> int:
    return 0 if data is None else len(data)


class ThrottledStore(WrapperStore):
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
            raise InvalidInputError("give ThrottledStore exactly one of bytes_per_s or trace")
        if trace is None:
            trace = BandwidthTrace.constant(
                check_number("bytes_per_s", bytes_per_s, positive=True, finite=True)
            )
        elif not isinstance(trace, BandwidthTrace):
            raise InvalidInputError(f"trace must be a BandwidthTrace, got {type(trace).__name__}")
        super().__init__(inner)
        self.link = Link(trace, check_number("latency_s", latency_s, 0, finite=True))
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

    def delivered_bytes(self) -> float | None:
        """Bytes the link has delivered since the last `reset()`, part of the read crossing it now
        included (as a reader watching them arrive would count)."""
        return self.link.delivered(self.clock())

    async def _sleep(self, seconds: float) -> None:
        """Wait `seconds` on the link's clock (a test replaces this and `clock` with a simulated clock)."""
        await anyio.sleep(seconds)

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
            await self._sleep(max(0.0, done - self.clock()))
            return result
        finally:
            if not booked:  # failed or cancelled before booking: later requests must not wait on it
                mine.set()

    async def get(self, key: str) -> bytes | None:
        return await self._through_link(lambda: self.inner.get(key), _length)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        return await self._through_link(
            lambda: self.inner.read_into(key, buffer), lambda n: min(n or 0, len(buffer))
        )

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return await self._through_link(lambda: self.inner.get_range(key, start, end), _length)

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return await self._through_link(
            lambda: self.inner.get_ranges(key, ranges), lambda got: sum(map(_length, got))
        )

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        found = await self.inner.contains(keys)
        await self._sleep(self.link.latency_s)
        return found
