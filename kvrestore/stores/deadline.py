"""Every call to a store under a deadline, and a store that timed out left alone for a back-off.

A store whose server accepts connections and never answers (a black hole) holds a call for as long as
its client library's read timeouts and retries allow: minutes per batch of keys on s3. The restorer
therefore reaches its store through a `DeadlineStore`, which bounds each call by what the restorer can
afford for it (`Deadlines`): a lookup about 2 s, a load or a write tens of seconds. A call past its
deadline is cancelled and raises `StoreTimeoutError` (a `StoreError`): the restore recomputes, the
save reports the chunk unwritten.

After a timeout the store is not asked again until a back-off has passed (doubling from `backoff_s`
on each timeout in a row, up to `max_backoff_s`, back to the start after a call that answers): every
call meanwhile fails at once, so a restore while the store is down costs no wait at all, and the store
is probed again by the first call after the back-off.

A `TieredStore` is bounded tier by tier instead: a view of it whose tiers are each under the deadlines,
with a back-off of its own (`bound_store`; the caller's store is not changed), so a tier that is down
(a dead S3 under a memory and a disk tier) costs one deadline once and then nothing, while the tiers
above it keep answering.

Blocking reads (`reads_sync`: memory of this process, a local directory) pass through without a deadline
of their own: they run on threads, which cannot be interrupted. For those alone the restore's engine
enforces `load_timeout_s` (`Parts.engine_load_timeout_s`; a load's deadline is enforced in one place): it
abandons a read past it (its late bytes never placed) and tells the store (`timed_out`), which then
counts as down as after any timeout: blocking reads are refused at once until the back-off ends.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio

from kvrestore.core.errors import InvalidInputError, StoreTimeoutError
from kvrestore.core.settings import check_seconds
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.wrapper import WrapperStore

T = TypeVar("T")

#: a lookup (which chunks exist) may take this long before the store counts as down (as the vLLM
#: connector's `lookup_timeout_s`)
LOOKUP_TIMEOUT_S = 2.0
#: one chunk's write, or a flush of the writes accepted so far
SAVE_TIMEOUT_S = 30.0
#: a store that timed out is left alone this long, doubling on each timeout in a row
BACKOFF_S = 5.0
MAX_BACKOFF_S = 60.0


@dataclass
class Deadlines:
    """Seconds each kind of store call may take (None: no limit)."""

    lookup_s: float | None = LOOKUP_TIMEOUT_S
    load_s: float | None = 30.0
    save_s: float | None = SAVE_TIMEOUT_S
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def __post_init__(self) -> None:
        for name in ("lookup_s", "load_s", "save_s"):
            setattr(self, name, check_seconds(name.replace("_s", "_timeout_s"), getattr(self, name)))
        for name in ("backoff_s", "max_backoff_s"):
            if check_seconds(name, getattr(self, name)) is None:
                raise InvalidInputError(f"{name} must be a positive number of seconds")


class DeadlineStore(WrapperStore):
    """`inner` with every async call bounded by `deadlines` and a back-off after a timeout (see the
    module docstring). `deadlines` is read at each call, so a caller may change it between calls."""

    def __init__(self, inner: ChunkStore, deadlines: Deadlines | None = None) -> None:
        super().__init__(inner)
        self.deadlines = deadlines or Deadlines()
        self._down_until = 0.0
        self._backoff = 0.0  # the current back-off (0: the last call answered)
        self.timeouts = 0  # calls that ran past their deadline
        self._unflushed = False  # whether a write was accepted since the last flush

    @property
    def down_for(self) -> float:
        """Seconds until the store is asked again (0: it is asked now)."""
        return max(0.0, self._down_until - time.monotonic())

    async def _within(self, what: str, seconds: float | None, call: Callable[[], Awaitable[T]]) -> T:
        self._refuse_while_down(what)
        await self.inner.connect()  # no request to the server: not on the deadline's clock
        if seconds is None:
            out = await call()
        else:
            with anyio.move_on_after(seconds) as scope:
                out = await call()
            if scope.cancelled_caught:
                self.timed_out(seconds)
                raise StoreTimeoutError(
                    f"{self.name}: {what} did not finish within {seconds:g} s; the store counts as down "
                    f"for {self._backoff:g} s"
                )
        self._backoff = 0.0
        return out

    def timed_out(self, seconds: float) -> None:
        """A call ran past `seconds` (its own deadline, or a blocking read a restore abandoned past
        `load_timeout_s`): the store counts as down for the next back-off, unless it does already (calls
        in flight together, such as one read per load lane, that time out together are one outage)."""
        if self.down_for > 0:
            self.timeouts += 1
            return
        self._back_off()

    def failed(self) -> None:
        """A call failed otherwise than by its deadline (refused, unreachable): the store counts as down
        for the next back-off, as after a timeout, unless it does already."""
        if self.down_for <= 0:
            self._back_off()

    def _back_off(self) -> None:
        """Count the store as down for the next back-off (doubling)."""
        self.timeouts += 1
        d = self.deadlines
        self._backoff = min(d.max_backoff_s, self._backoff * 2 if self._backoff else d.backoff_s)
        self._down_until = time.monotonic() + self._backoff

    def _refuse_while_down(self, what: str) -> None:
        """StoreTimeoutError at once while the store counts as down (a blocking read has no deadline of
        its own: one abandoned past it marks the store down, and the reads after it are not started)."""
        wait = self.down_for
        if wait > 0:
            raise StoreTimeoutError(
                f"{self.name} timed out recently: not asked again for {wait:.1f} s ({what} skipped)"
            )

    # -- reads -------------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        return await self._within("a read", self.deadlines.load_s, lambda: self.inner.get(key))

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        return await self._within("a read", self.deadlines.load_s, lambda: self.inner.read_into(key, buffer))

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return await self._within(
            "a range read", self.deadlines.load_s, lambda: self.inner.get_range(key, start, end)
        )

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return await self._within(
            "range reads", self.deadlines.load_s, lambda: self.inner.get_ranges(key, ranges)
        )

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return await self._within("a lookup", self.deadlines.lookup_s, lambda: self.inner.contains(keys))

    # -- writes ------------------------------------------------------------------------------------

    async def put(self, key: str, data: bytes) -> None:
        await self._within("a write", self.deadlines.save_s, lambda: self.inner.put(key, data))
        self._unflushed = True

    async def delete(self, key: str) -> None:
        await self._within("a delete", self.deadlines.save_s, lambda: self.inner.delete(key))

    async def flush(self) -> None:
        """Flush the writes accepted so far. While the store is down, one that accepted none through
        this wrapper has nothing to flush, and returns (a restorer that only read closes cleanly)."""
        if not self._unflushed and self.down_for > 0:
            return
        await self._within("a flush", self.deadlines.save_s, self.inner.flush)
        self._unflushed = False

    def __repr__(self) -> str:  # the store it bounds, as named in learned costs and logs
        return repr(self.inner)

    # -- blocking reads: local, passed on as they are, refused while the store is down -------------

    @property
    def reads_sync(self) -> bool:  # type: ignore[override]
        return self.inner.reads_sync

    def contains_sync(self, keys: Sequence[str]) -> list[bool] | None:
        self._refuse_while_down("a lookup")
        return self.inner.contains_sync(keys)

    def get_sync(self, key: str) -> bytes | memoryview | None:
        self._refuse_while_down("a read")
        return self.inner.get_sync(key)

    def read_into_sync(self, key: str, buffer: memoryview) -> int | None:
        self._refuse_while_down("a read")
        return self.inner.read_into_sync(key, buffer)

    def scatter_into_sync(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int | None:
        self._refuse_while_down("a read")
        return self.inner.scatter_into_sync(key, offset, buffers)


def bound_store(store: ChunkStore, deadlines: Deadlines) -> ChunkStore:
    """`store` with every call under `deadlines`: a `DeadlineStore` around it, or, for a `TieredStore`, a
    view of it with a `DeadlineStore` around each tier (`TieredStore.over_tiers`; a tier bounded already
    keeps the deadlines it has). The caller's store is left as it is."""
    from kvrestore.stores.tiered import TieredStore

    if isinstance(store, TieredStore):
        return store.over_tiers(lambda t: t if isinstance(t, DeadlineStore) else DeadlineStore(t, deadlines))
    return DeadlineStore(store, deadlines)


__all__ = ["BACKOFF_S", "LOOKUP_TIMEOUT_S", "SAVE_TIMEOUT_S", "DeadlineStore", "Deadlines", "bound_store"]
