"""The driver loop: ask, begin the decision on the lanes, apply what finishes; written once.

Every way a restore runs is `run_loop` over some lanes. What differs between one restore and a batch
is only who decides and what a result belongs to, and that lives in two small deciders:

* `drive` runs one restore's `Policy` (`_PolicyDecider`): the `Engine` over real lanes (anyio tasks,
  worker and lane threads, a real clock), `simulate` over simulated ones (a heap of future events, a
  simulated clock), and `simulate_independent` runs one per request over a simulated plain engine. Its
  one phase is the policy's `Decision`; a broken rule or a stall raises.
* `drive_batch` runs a `BatchScheduler` over many jobs (`_BatchDecider`): the `BatchEngine` on a real
  clock, `simulate_batch` on a simulated one. Its phases are a `ComputeStep` while the compute lane is
  free, then a `LoadGrant` for the free load lanes (asked after the step was begun, so it sees the step's
  drops); a broken rule or a stall fails that batch's jobs, not the loop.

Writing the loop once keeps the rules in one place: each phase is asked (a pure decision), the loads it
drops are stopped, it is begun with `bookkeeping`, then started on the lanes; the loop waits until the
earliest wake-up any phase asked for or a unit finishes, and applies the finished units in the order they
finished; work left with nothing running and no wake-up asked fails with `PolicyStalledError`.

The loop is a coroutine so that real lanes can suspend while they wait. Simulated lanes never suspend,
so the simulator runs it with `run_sync` (one `send`), without an event loop and at a plain loop's
speed; `simulate_independent` steps its requests' loops itself, one `send` per wake-up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.estimates import NO_PRIORS, Arrivals, Estimates, Priors
from kvrestore.policies.base import Decision, Policy, Progress
from kvrestore.policies.batch import BatchJob, BatchScheduler, ComputeStep, LoadGrant
from kvrestore.runtime.bookkeeping import (
    PolicyError,
    apply_event,
    begin,
    begin_loads,
    begin_step,
    note_step,
    observe,
    stalled,
)

T = TypeVar("T")
#: what one wait of the lanes hands back per finished unit
R = TypeVar("R")


class PolicyStalledError(PolicyError):
    """The policy started nothing while nothing was running and chunks were left."""


class _Wakes(Protocol):
    """A decision: whatever else it starts, it may ask to be asked again at `wake_at`."""

    @property
    def wake_at(self) -> float | None: ...


D = TypeVar("D", bound=_Wakes)


class Phase(ABC, Generic[D]):
    """One kind of decision the loop begins: asked, its dropped loads stopped, begun, started."""

    @abstractmethod
    def decide(self) -> D:
        """Ask for the decision (pure: changes no progress)."""

    @abstractmethod
    def stop(self, decision: D) -> None:
        """Stop on the lanes the loads the decision drops (before `begin` marks them dropped)."""

    @abstractmethod
    def begin(self, decision: D) -> None:
        """Mark the decision's units started in the progress (`bookkeeping`, which checks the rules)."""

    @abstractmethod
    def start(self, decision: D) -> None:
        """Start the decision's units on the lanes (after `begin`)."""


class Decider(ABC, Generic[R]):
    """What the loop runs: who decides (in phases), what a finished unit is applied to, and what a
    broken rule does. `who` and `finishing` name it in errors."""

    finishing = ""
    #: the lanes' wait: the units that finished next, once one has or the wake-up has come
    wait: Callable[[float | None], Awaitable[list[R]]]

    @property
    @abstractmethod
    def who(self) -> str:
        """Who decides, as errors name it."""

    @abstractmethod
    def open(self) -> bool:
        """Whether there is anything left to run (False: the loop returns)."""

    @abstractmethod
    def phases(self) -> Iterable[Phase[Any]]:
        """The decisions to ask for now, in order; each is asked only once the one before was begun."""

    @abstractmethod
    def stuck(self) -> str | None:
        """With no wake-up asked: the chunks left if nothing runs or can arrive (the loop fails with
        `PolicyStalledError`), else None."""

    @abstractmethod
    def fail(self, error: Exception) -> None:
        """A decision broke a rule or stalled."""

    @abstractmethod
    def apply(self, item: R) -> None:
        """Apply a finished unit to its progress, and trace it."""


async def run_loop(decider: Decider[Any], max_steps: int | None = None) -> None:
    """The one driver loop: run `decider` on its lanes until it has nothing left to run."""
    steps = 0
    while decider.open():
        if max_steps is not None:
            if steps >= max_steps:
                raise PolicyError(f"{decider.who} did not finish{decider.finishing} within {max_steps} steps")
            steps += 1
        wake: float | None = None
        try:
            for phase in decider.phases():
                decision = phase.decide()
                phase.stop(decision)
                phase.begin(decision)
                phase.start(decision)
                at = decision.wake_at
                if at is not None and (wake is None or at < wake):
                    wake = at
            if wake is None and (left := decider.stuck()) is not None:
                raise PolicyStalledError(f"{decider.who} left chunks {left} with no unit running")
        except Exception as exc:
            wake = None  # what the failed decisions asked for goes with them
            decider.fail(exc)
        for item in await decider.wait(wake):
            decider.apply(item)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the driver over simulated lanes) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a coroutine run without an event loop suspended")


# -- one restore under its policy ------------------------------------------------------------------


class Lanes(Protocol):
    """Where a restore's units run, and the clock they run on."""

    #: load lanes the restore may use at once
    load_lanes: int

    def now(self) -> float:
        """Seconds since the restore began, on these lanes' clock."""

    def delivered(self) -> float | None:
        """Tokens' worth of bytes the store's count shows delivered, those of fetches in flight included
        (a running count: only how it grows is used; None: the store cannot say before a fetch lands)."""

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
    priors: Priors = NO_PRIORS,
) -> Trace:
    """Run one restore to the end on `lanes`; returns its trace (events on the lanes' clock). Before each
    decision the lanes are observed and their `Estimates` worked out once, on top of `priors`."""
    decider = _PolicyDecider(progress, policy, lanes, on_event, priors)
    await run_loop(decider, max_steps)
    return decider.trace


class _PolicyDecider(Decider[TraceEvent | BaseException], Phase[Decision]):
    """One restore: its policy's `Decision` is the only phase; a broken rule or a stall raises."""

    def __init__(
        self,
        progress: Progress,
        policy: Policy,
        lanes: Lanes,
        on_event: Callable[[TraceEvent], None] | None,
        priors: Priors = NO_PRIORS,
    ) -> None:
        self.progress, self.policy, self.lanes, self.on_event = progress, policy, lanes, on_event
        self.priors, self.arrivals = priors, Arrivals()
        self.trace = Trace()
        self.wait = lanes.wait

    @property
    def who(self) -> str:
        return repr(self.policy)

    def open(self) -> bool:
        return not self.progress.finished

    def phases(self) -> Iterable[Phase[Any]]:
        return (self,)  # made per call: a tuple kept on self would be a reference cycle

    def decide(self) -> Decision:
        progress, lanes = self.progress, self.lanes
        now = lanes.now()
        observe(progress, now, max(0, lanes.load_lanes - progress.loads_in_flight))
        self.arrivals.see(now, lanes.delivered())
        return self.policy.decide(progress, Estimates(progress, self.priors, self.arrivals.samples))

    def stop(self, decision: Decision) -> None:
        if decision.drop:
            self.lanes.stop(decision.drop)

    def begin(self, decision: Decision) -> None:
        begin(self.progress, decision, self.policy)

    def start(self, decision: Decision) -> None:
        self.lanes.start(decision)

    def stuck(self) -> str | None:
        return str(self.progress.pending()) if stalled(self.progress) else None

    def fail(self, error: Exception) -> None:
        raise error

    def apply(self, item: TraceEvent | BaseException) -> None:
        if isinstance(item, BaseException):
            raise item
        apply_event(self.progress, item)
        self.trace.add(item)
        if self.on_event is not None:
            self.on_event(item)


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
    await run_loop(_BatchDecider(scheduler, lanes), max_steps)


class _BatchDecider(Decider[tuple[BatchJob, TraceEvent]]):
    """A batch: a compute step while the compute lane is free, then loads for the free load lanes. A
    broken rule or a stall fails the jobs scheduled with it (`BatchLanes.fail`), not the loop."""

    finishing = " the batch"

    def __init__(self, scheduler: BatchScheduler, lanes: BatchLanes) -> None:
        self.scheduler, self.lanes = scheduler, lanes
        self.wait = lanes.wait
        self.jobs: dict[int, BatchJob] = {}

    @property
    def who(self) -> str:
        return repr(self.scheduler)

    def open(self) -> bool:
        jobs = self.lanes.jobs()
        self.jobs = jobs or {}
        return jobs is not None

    def phases(self) -> Iterator[Phase[Any]]:
        jobs, lanes = self.jobs, self.lanes
        if not jobs:  # nothing to schedule until a job arrives or a unit reports
            return
        now = lanes.now()
        for job in jobs.values():  # each job's progress on its own clock, as its policy sees it
            observe(job.progress, now - job.arrival_s)
        if not lanes.computing:
            yield _Step(self, now)
        free = lanes.load_lanes - lanes.loads_in_flight()
        if free > 0:
            yield _Grant(self, now, free)

    def stuck(self) -> str | None:
        if not self.jobs or self.lanes.busy():
            return None
        left = {j: job.progress.pending() for j, job in self.jobs.items()}
        return f"{left} (job: chunks)"

    def fail(self, error: Exception) -> None:
        self.lanes.fail(list(self.jobs.values()), error)

    def apply(self, item: tuple[BatchJob, TraceEvent]) -> None:
        job, event = item
        apply_event(job.progress, event)
        self.lanes.record(job, event)


class _Step(Phase[ComputeStep]):
    """A batch's compute step: the units it runs and the loads they take over."""

    def __init__(self, batch: _BatchDecider, now: float) -> None:
        self.batch, self.now = batch, now

    def decide(self) -> ComputeStep:
        return self.batch.scheduler.compute_step(list(self.batch.jobs.values()), self.now)

    def stop(self, step: ComputeStep) -> None:
        if step.drops:
            self.batch.lanes.stop(step.drops)

    def begin(self, step: ComputeStep) -> None:
        note_step(self.batch.jobs, step)
        begin_step(self.batch.jobs, step)

    def start(self, step: ComputeStep) -> None:
        if step.units:
            self.batch.lanes.start_step(step)


class _Grant(Phase[LoadGrant]):
    """A batch's load grant for its free load lanes (it drops nothing)."""

    def __init__(self, batch: _BatchDecider, now: float, free: int) -> None:
        self.batch, self.now, self.free = batch, now, free

    def decide(self) -> LoadGrant:
        return self.batch.scheduler.load_grants(list(self.batch.jobs.values()), self.free, self.now)

    def stop(self, grant: LoadGrant) -> None:
        pass

    def begin(self, grant: LoadGrant) -> None:
        begin_loads(self.batch.jobs, grant)

    def start(self, grant: LoadGrant) -> None:
        if grant.loads:
            self.batch.lanes.start_loads(grant)
