"""The one driver loop: ask the policy, start its decision on the lanes, apply what finishes.

Every way a restore runs is this loop over some `Lanes`: the `Engine` runs it over real lanes (anyio
tasks, worker and lane threads, a real clock), the simulator over simulated ones (a heap of future
events, a simulated clock). Writing it once keeps the rules in one place: the decision is taken on a
fresh view of the progress, started with `bookkeeping.begin` between stopping the dropped loads and
starting the new units, and the finished units are applied in the order they finished; a restore with
nothing running, nothing due to wake it and chunks left fails with `PolicyStalledError`.

The loop is a coroutine so that real lanes can suspend in `wait`. Simulated lanes never suspend, so
the simulator runs it with `run_sync` (one `send`), without an event loop and at a plain loop's speed.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.policies.base import Decision, Policy, Progress
from kvrestore.runtime.bookkeeping import PolicyError, apply_event, begin, stalled

T = TypeVar("T")


class PolicyStalledError(PolicyError):
    """The policy started nothing while nothing was running and chunks were left."""


class Lanes(Protocol):
    """Where a restore's units run, and the clock they run on."""

    #: load lanes the restore may use at once
    load_lanes: int

    def now(self) -> float:
        """Seconds since the restore began, on these lanes' clock."""

    def stop(self, drops: Sequence[int]) -> None:
        """Stop the loads of `drops` (called before `begin` marks them dropped)."""

    def start(self, decision: Decision) -> None:
        """Start the decision's loads and compute unit (called after `begin` marked them started)."""

    async def wait(self, wake_at: float | None) -> list[TraceEvent | BaseException]:
        """The units that finished next, in order, once at least one has or `wake_at` has come (None:
        no wake-up asked). An exception in the list is a unit's own error: the restore fails with it."""


async def drive(
    progress: Progress,
    policy: Policy,
    lanes: Lanes,
    on_event: Callable[[TraceEvent], None] | None = None,
    max_steps: int | None = None,
) -> Trace:
    """Run one restore to the end on `lanes`; returns its trace (events on the lanes' clock)."""
    trace = Trace()
    steps = 0
    while not progress.finished:
        if max_steps is not None:
            if steps >= max_steps:
                raise PolicyError(f"{policy!r} did not finish within {max_steps} steps")
            steps += 1
        progress.now = lanes.now()
        progress.free_load_lanes = max(0, lanes.load_lanes - progress.loads_in_flight)
        decision = policy.decide(progress)
        if decision.drop:
            lanes.stop(decision.drop)
        begin(progress, decision, policy)
        lanes.start(decision)
        if stalled(progress, decision):
            raise PolicyStalledError(f"{policy!r} left chunks {progress.pending()} with no unit running")
        for item in await lanes.wait(decision.wake_at):
            if isinstance(item, BaseException):
                raise item
            apply_event(progress, item)
            trace.add(item)
            if on_event is not None:
                on_event(item)
    return trace


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the driver over simulated lanes) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a coroutine run without an event loop suspended")
