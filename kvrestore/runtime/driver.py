"""The driver loops: ask, begin the decision on the lanes, apply what finishes; written once.

Every way a restore runs is one of these over some lanes. `drive` runs one restore's policy: the
`Engine` over real lanes (anyio tasks, worker and lane threads, a real clock), `simulate` over simulated
ones (a heap of future events, a simulated clock), and `simulate_independent` runs one per request over
a simulated plain engine. `drive_batch` runs a `BatchScheduler` over many jobs: the `BatchEngine` on a
real clock, `simulate_batch` on a simulated one. Writing them once keeps the rules in one place: a
decision is begun with `bookkeeping` between stopping the loads it drops and starting its units, the
finished units are applied in the order they finished, and a restore with nothing running, nothing due
to wake it and chunks left fails with `PolicyStalledError`.

The loops are coroutines so that real lanes can suspend while they wait. Simulated lanes never suspend,
so the simulator runs a loop with `run_sync` (one `send`), without an event loop and at a plain loop's
speed; `simulate_independent` steps its requests' loops itself, one `send` per wake-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.policies.base import Decision, Policy, Progress
from kvrestore.policies.batch import BatchJob, BatchScheduler, ComputeStep, LoadGrant
from kvrestore.runtime.bookkeeping import (
    PolicyError,
    apply_event,
    begin,
    begin_loads,
    begin_step,
    note_step,
    stalled,
)

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


# -- many restores under one batch scheduler -----------------------------------------------------------


class BatchLanes(Protocol):
    """Shared lanes for the jobs of a batch, and the clock they run on (global: jobs keep their own)."""

    load_lanes: int
    #: whether a compute step is running
    computing: bool

    def now(self) -> float:
        """Seconds on the lanes' clock (every job's `arrival_s` is on it)."""

    def jobs(self) -> dict[int, BatchJob] | None:
        """The jobs to schedule now, by id (None: the batch is over and the driver returns)."""

    def loads_in_flight(self) -> int:
        """Loads started and not yet reported."""

    def busy(self) -> bool:
        """Whether anything may still report or arrive without the scheduler starting more."""

    def stop(self, drops: Sequence[tuple[int, int]]) -> None:
        """Stop the loads (job, chunk) that a compute step takes over (before `begin_step`)."""

    def start_step(self, step: ComputeStep) -> None:
        """Run a compute step's units, one after another (after `begin_step`)."""

    def start_loads(self, grant: LoadGrant) -> None:
        """Start a grant's loads (after `begin_loads`)."""

    def fail(self, jobs: Sequence[BatchJob], error: Exception) -> None:
        """The scheduling of `jobs` broke a rule or stalled: they fail with `error`."""

    async def wait(self, wake_at: float | None) -> list[tuple[BatchJob, TraceEvent]]:
        """The units that finished next (job, event on the job's own clock), to apply in order."""

    def record(self, job: BatchJob, event: TraceEvent) -> None:
        """A unit of `job` was applied to its progress: trace it and note whether the job finished."""


async def drive_batch(scheduler: BatchScheduler, lanes: BatchLanes, max_steps: int | None = None) -> None:
    """Run the jobs `lanes` hand over under `scheduler` until `lanes.jobs()` says the batch is over."""
    steps = 0
    while (jobs := lanes.jobs()) is not None:
        if max_steps is not None:
            if steps >= max_steps:
                raise PolicyError(f"{scheduler!r} did not finish the batch within {max_steps} steps")
            steps += 1
        wake: float | None = None
        if jobs:
            try:
                wake = _schedule(scheduler, lanes, jobs)
            except Exception as exc:  # a scheduler or policy broke a rule: its jobs fail, not the driver
                lanes.fail(list(jobs.values()), exc)
        for job, event in await lanes.wait(wake):
            apply_event(job.progress, event)
            lanes.record(job, event)


def _schedule(scheduler: BatchScheduler, lanes: BatchLanes, jobs: dict[int, BatchJob]) -> float | None:
    """Ask the scheduler for a compute step (if the lane is free) and loads for the free load lanes;
    start them; returns when to ask again (None: when something reports)."""
    now = lanes.now()
    for job in jobs.values():  # each job's progress on its own clock, as its policy sees it
        job.progress.now = now - job.arrival_s
    wake = math.inf
    if not lanes.computing:
        step = scheduler.compute_step(list(jobs.values()), now)
        note_step(jobs, step)
        if step.drops:
            lanes.stop(step.drops)
        begin_step(jobs, step)
        if step.units:
            lanes.start_step(step)
        if step.wake_at is not None:
            wake = step.wake_at
    free = lanes.load_lanes - lanes.loads_in_flight()
    if free > 0:
        grant = scheduler.load_grants(list(jobs.values()), free, now)
        begin_loads(jobs, grant)
        if grant.loads:
            lanes.start_loads(grant)
        if grant.wake_at is not None:
            wake = min(wake, grant.wake_at)
    if wake == math.inf and not lanes.busy():  # nothing runs and nobody asked to be woken
        left = {j: job.progress.pending() for j, job in jobs.items()}
        lanes.fail(
            list(jobs.values()),
            PolicyStalledError(f"{scheduler!r} left chunks {left} (job: chunks) with no unit running"),
        )
    return None if wake == math.inf else wake
