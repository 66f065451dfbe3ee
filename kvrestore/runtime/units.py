"""The units a restore's lanes run, as the engine tracks them while they may still be stopped.

`Unit` is a compute unit running in place with the fetches aside that may overtake it
(`Decision.overtake`); `ThreadLoad` is a load on a lane thread, which a drop can skip or disown but not
interrupt. `timed_load` runs one load as a task and says how it ended.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio

from kvrestore.core.cancel import Checkpoints
from kvrestore.core.errors import LOAD_FAULTS
from kvrestore.core.trace import TraceEvent


class Unit:
    """A compute unit running in place, and the fetches aside that may overtake it (`Decision.overtake`):
    `scope` stops it (at its next layer boundary) once every chunk of it has `landed` aside."""

    __slots__ = ("a", "b", "checkpoints", "fetching", "landed", "scope")

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b
        self.scope = anyio.CancelScope()
        self.checkpoints = Checkpoints()  # how far it got, if it is stopped part-way
        self.fetching: dict[int, anyio.CancelScope] = {}
        self.landed: dict[int, tuple[int, Callable[[], None]]] = {}

    def overtaken(self) -> bool:
        return len(self.landed) == self.b - self.a


class Stoppable(Protocol):
    def cancel(self) -> object: ...


class ThreadLoad:
    """A load on a lane thread: its read (which may stall), then its placing into the KV. `cancel()`
    drops it: skipped if it has not started; abandoned if it is reading (what the read brings is
    discarded, never placed), and then it writes no more at once; let finish if it is placing (bounded
    work). `stopped` is set once it will write no more; `started_at` (the restore's clock) once a lane
    thread has begun it; `work` is what the lane thread runs."""

    __slots__ = ("cancelled", "lock", "placing", "started_at", "stopped", "work")

    def __init__(self) -> None:
        self.cancelled = False
        self.placing = False
        self.started_at: float | None = None
        self.stopped = anyio.Event()
        self.lock = threading.Lock()
        self.work: Callable[[], None] | None = None

    def cancel(self) -> bool:
        """Drop the load; True if it can write no more from now on (it is not placing)."""
        with self.lock:
            self.cancelled = True
            return not self.placing

    def begin_placing(self) -> bool:
        """On the lane thread, once the read has ended: whether to place (False: dropped meanwhile)."""
        with self.lock:
            self.placing = not self.cancelled
            return self.placing


async def timed_load(
    load: Callable[[int], Awaitable[int]],
    i: int,
    timeout_s: float | None,
    now: Callable[[], float],
    kind: str = "load",
    timed_out: Callable[[float], None] | None = None,
) -> TraceEvent:
    """Run one load; its event on the `now` clock: `kind` ("load", or "aside" for a fetch aside), or
    `kind`-failed for a fault that makes the chunk a miss (cancellation passes through). A load past
    `timeout_s` is cancelled (a blocking read in it abandoned) and `timed_out` told the seconds, unless
    the store itself timed it out (`StoreTimeoutError`: it counts itself down)."""
    start = now()
    deadline: anyio.CancelScope | None = None
    try:
        with anyio.fail_after(timeout_s) as deadline:
            nbytes = await load(i)
    except LOAD_FAULTS as exc:
        error = f"{type(exc).__name__}: {exc}"
        if deadline is not None and deadline.cancelled_caught and timeout_s is not None:
            error = past_deadline(timeout_s)
            if timed_out is not None:
                timed_out(timeout_s)
        return TraceEvent(f"{kind}-failed", i, i, start, now(), error=error)
    return TraceEvent(kind, i, i, start, now(), nbytes)


def past_deadline(timeout_s: float) -> str:
    """The error of a load abandoned past its deadline, as a trace reports it."""
    return f"TimeoutError: the load did not finish within {timeout_s:g} s (load_timeout_s): abandoned"
