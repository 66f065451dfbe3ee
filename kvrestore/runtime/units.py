"""The units a restore's lanes run, as the engine tracks them while they may still be stopped.

`Unit` is a compute unit running in place with the fetches aside that may overtake it
(`Decision.overtake`); `ThreadLoad` is a load on a lane thread, which a drop can skip or disown but not
interrupt. `timed_load` runs one load as a task and says how it ended.
"""

from __future__ import annotations

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
    def cancel(self) -> None: ...


class ThreadLoad:
    """A load on a lane thread. `cancel()` drops it: skipped if it has not started, its outcome reported
    as dropped if it has; `stopped` is set once it will write no more."""

    __slots__ = ("cancelled", "stopped")

    def __init__(self) -> None:
        self.cancelled = False
        self.stopped = anyio.Event()

    def cancel(self) -> None:
        self.cancelled = True


async def timed_load(
    load: Callable[[int], Awaitable[int]],
    i: int,
    timeout_s: float | None,
    now: Callable[[], float],
    kind: str = "load",
) -> TraceEvent:
    """Run one load; its event on the `now` clock: `kind` ("load", or "aside" for a fetch aside), or
    `kind`-failed for a fault that makes the chunk a miss (cancellation passes through)."""
    start = now()
    try:
        with anyio.fail_after(timeout_s):
            nbytes = await load(i)
    except LOAD_FAULTS as exc:
        return TraceEvent(f"{kind}-failed", i, i, start, now(), error=f"{type(exc).__name__}: {exc}")
    return TraceEvent(kind, i, i, start, now(), nbytes)
