"""Batch-aware scheduling: many restores sharing one compute lane and one set of load lanes.

A serving process restores many prompts at once. Each request keeps its own pointers (its per-request
`Policy`, usually `TokenTwoPointer`), and a `BatchScheduler` decides, like vLLM's scheduler, which of
them get the shared lanes:

* **Compute** runs in *steps*. Each step spends a token budget (`token_budget`) on one unit of each of
  several requests, in priority order. `BatchAware` follows Cake (§4 Part 3): decode steps first, then
  prefills of prompts with nothing cached, and only what is left to the compute side of cached restores,
  which can fall back on loading. Among restores the one with the least recomputation left goes first,
  so short restores finish instead of all restores finishing late together.
* **Load lanes** go where a transfer avoids the most compute (CacheFlow §3.3, Algorithm 1: the requests
  with the largest remaining recomputation cost). With attention's cost growing along the prompt that
  is the long prefixes' far chunks; the rule ranks each request by the chunk its load pointer would
  fetch next, so lanes move on to shorter requests once the long ones are down to cheaper chunks.

The same rule on a link that serves whole loads (the vLLM connector's, where each request loads its
prefix in one go): `QueuedLoad` is a load waiting for the link, and `link_order` serves the waiting
loads by the compute they save per byte. A split counts every queued load's bytes as
ahead of its own (`planning.split.choose_split`).

`FifoLanes` is the baseline: the same per-request pointers with both lanes served in arrival order (a
first-come first-served scheduler, as vLLM's default).

A scheduler is a pure decision: it reads the jobs' progress and answers with a `ComputeStep` or a
`LoadGrant`; the driver (the `BatchEngine` on a real clock, `simulate_batch` on a simulated one) applies
it with `begin_step` / `begin_loads` and updates the jobs from finished units and passed-over steps
(`note_step`): asking a job's policy (`BatchJob.ask`) changes nothing. Each job's own policy is
asked as if it ran alone (its `Progress`, with the lanes the scheduler grants it), so every request keeps
its two-pointer invariants.

Starvation bound. Strict priority would let a stream of decode steps starve a restore's compute forever.
A job that wanted compute and was passed over `max_skipped_steps` steps in a row goes first in the next
step (oldest first among such jobs). Every step serves at least one unit, so a job that wants compute
is served within `max_skipped_steps + n` steps, n the number of jobs waiting with it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.settings import check_int
from kvrestore.policies.base import ChunkStatus, Decision, Estimates, Policy, Progress

#: Cake's compute budget per step (tokens): two 256-token chunks
DEFAULT_TOKEN_BUDGET = 512
#: steps a job that wants compute may be passed over before it goes first
DEFAULT_MAX_SKIPPED_STEPS = 4

#: Cake's priority classes: decode steps, then uncached prefills, then cached restores
CLASS_ORDER = {"decode": 0, "prefill": 1, "restore": 2}


@dataclass(eq=False)
class BatchJob:
    """One request as a scheduler sees it.

    `progress` is the job's own restore progress on its own clock (seconds since `arrival_s`);
    `chunk_cost` estimates each unit's compute cost (seconds from a profile, or any consistent unit),
    which ranks jobs by remaining recomputation. `unit_tokens` is what each unit spends of a step's
    token budget: by default its chunk's tokens; a layer-axis job's units are layers over the whole
    prefix, each about the work of prefix/layers tokens. `skipped` (steps passed over in a row) and
    `most_skipped` (the most ever) are kept by the driver (`bookkeeping.note_step`). `estimate` works
    out the `Estimates` of a progress, which the job's policy decides from (the driver's: the
    scheduler itself computes nothing of the lanes).
    """

    id: int
    kind: str
    progress: Progress
    policy: Policy
    arrival_s: float
    chunk_cost: Sequence[float]
    unit_tokens: Sequence[int] = ()
    estimate: Callable[[Progress], Estimates] | None = None
    skipped: int = 0
    most_skipped: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CLASS_ORDER:
            raise InvalidInputError(f"job kind must be one of {sorted(CLASS_ORDER)}, got {self.kind!r}")
        if len(self.chunk_cost) != self.progress.n_chunks:
            raise InvalidInputError("chunk_cost and the job's chunks differ in length")
        self.unit_tokens = list(self.unit_tokens) or list(self.progress.chunk_tokens)
        if len(self.unit_tokens) != self.progress.n_chunks:
            raise InvalidInputError("unit_tokens and the job's chunks differ in length")

    def tokens(self, a: int, b: int) -> int:
        """What units [a, b) spend of a step's token budget."""
        return sum(self.unit_tokens[a:b])

    def remaining_compute(self) -> float:
        """Cost of the chunks nobody is working on yet: what computing the rest would take."""
        st = self.progress.status
        return sum(c for c, s in zip(self.chunk_cost, st, strict=True) if s is ChunkStatus.PENDING)

    def next_load_value(self) -> float:
        """Compute cost per token of the chunk this job's load pointer would fetch next (its last
        stored chunk still pending): what one more load saves."""
        p = self.progress
        for j in range(p.n_chunks - 1, -1, -1):
            if p.stored[j] and p.status[j] is ChunkStatus.PENDING:
                return self.chunk_cost[j] / max(1, self.unit_tokens[j])
        return 0.0

    def loadable(self) -> bool:
        p = self.progress
        return any(p.stored[j] and p.status[j] is ChunkStatus.PENDING for j in range(p.n_chunks))

    def ask(self, now: float, free_load_lanes: int, compute_free: bool = True) -> Decision:
        """The job's own policy's decision at global time `now`, with the lanes the scheduler grants
        (`wake_at` comes back on the global clock).

        A pure question: the policy decides on a copy of the progress that shows the job's clock, the
        granted lanes and (with `compute_free` False: the compute lane is not on offer, so the policy
        plans loads only) a busy compute lane; the job's own progress changes only in bookkeeping."""
        busy = None if compute_free else True
        view = self.progress.as_if(now - self.arrival_s, free_load_lanes, busy)
        if self.estimate is None:
            raise InvalidInputError("a BatchJob needs `estimate` to ask its policy")
        d = self.policy.decide(view, self.estimate(view))
        if d.wake_at is None:
            return d
        return Decision(d.compute, d.loads, d.drop, global_wake(d.wake_at, self.arrival_s, now))


def global_wake(wake_at: float, arrival_s: float, now: float) -> float:
    """A job's wake-up time on the global clock, strictly after `now` (a policy asks for a time after
    its own clock's now; rounding in the change of clock must not turn that into now, or a driver
    would ask again at the same instant forever)."""
    return max(wake_at + arrival_s, math.nextafter(now, math.inf))


@dataclass(frozen=True)
class Unit:
    """Compute chunks [a, b) of job `job`."""

    job: int
    a: int
    b: int


@dataclass(frozen=True)
class ComputeStep:
    """The units one compute step runs, in order, and the loads they take over (job, chunk).

    `passed_over` are the jobs that wanted compute and got none this step; `wake_at` (global clock) is
    when a job asked to be asked again (a fetch it waits for is due)."""

    units: tuple[Unit, ...] = ()
    drops: tuple[tuple[int, int], ...] = ()
    passed_over: tuple[int, ...] = ()
    wake_at: float | None = None


@dataclass(frozen=True)
class LoadGrant:
    """Loads (job, chunk) to start on free lanes; `wake_at` as in `ComputeStep`."""

    loads: tuple[tuple[int, int], ...] = ()
    wake_at: float | None = None


class BatchScheduler(ABC):
    """Spends the shared lanes on the jobs of a batch; subclasses say in which order."""

    name = "batch"

    def __init__(
        self, token_budget: int = DEFAULT_TOKEN_BUDGET, max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS
    ) -> None:
        self.token_budget = check_int("token_budget", token_budget)
        self.max_skipped_steps = check_int("max_skipped_steps", max_skipped_steps, minimum=0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(token_budget={self.token_budget})"

    def check(self, job: BatchJob) -> None:
        """Refuse a job the budget cannot serve: each chunk must fit in one step."""
        biggest = max(job.unit_tokens, default=0)
        if biggest > self.token_budget:
            raise InvalidInputError(
                f"job {job.id} has a {biggest}-token unit, more than the scheduler's token budget of "
                f"{self.token_budget}: raise token_budget or use a smaller chunk_size"
            )

    @abstractmethod
    def compute_order(self, job: BatchJob) -> tuple:
        """Sort key: jobs that sort first get the compute budget first."""

    @abstractmethod
    def load_order(self, job: BatchJob) -> tuple:
        """Sort key: jobs that sort first get free load lanes first."""

    def compute_step(self, jobs: Sequence[BatchJob], now: float) -> ComputeStep:
        """The next compute step: one unit per job, in priority order, while the budget lasts."""
        budget = self.token_budget
        units: list[Unit] = []
        drops: list[tuple[int, int]] = []
        passed: list[int] = []
        wake = math.inf
        starved = [j for j in jobs if j.skipped >= self.max_skipped_steps]
        rest = [j for j in jobs if j.skipped < self.max_skipped_steps]
        ordered = sorted(starved, key=lambda j: (-j.skipped, j.arrival_s, j.id)) + sorted(
            rest, key=self.compute_order
        )
        for job in ordered:
            p = job.progress
            if p.finished or p.compute_busy:
                continue
            d = job.ask(now, 0)
            if d.compute is None:
                if d.wake_at is not None:
                    wake = min(wake, d.wake_at)
                continue
            a, b = d.compute
            while b > a and job.tokens(a, b) > budget:
                b -= 1  # a unit is cut to what the budget has left (whole chunks)
            if b == a:
                passed.append(job.id)
                continue
            units.append(Unit(job.id, a, b))
            drops.extend((job.id, i) for i in d.drop if a <= i < b)
            budget -= job.tokens(a, b)
        return ComputeStep(tuple(units), tuple(drops), tuple(passed), None if wake == math.inf else wake)

    def load_grants(self, jobs: Sequence[BatchJob], free_lanes: int, now: float) -> LoadGrant:
        """Loads for `free_lanes` lanes, job by job in load order; each job's pointer picks its chunks."""
        loads: list[tuple[int, int]] = []
        wake = math.inf
        for job in sorted((j for j in jobs if j.loadable()), key=self.load_order):
            if free_lanes <= 0:
                break
            d = job.ask(now, free_lanes, compute_free=False)
            for i in d.loads[:free_lanes]:
                loads.append((job.id, i))
            free_lanes -= min(free_lanes, len(d.loads))
            if d.wake_at is not None:
                wake = min(wake, d.wake_at)
        return LoadGrant(tuple(loads), None if wake == math.inf else wake)


class FifoLanes(BatchScheduler):
    """The baseline: per-request pointers, both lanes served in arrival order (first come, first served)."""

    name = "fifo"

    def compute_order(self, job: BatchJob) -> tuple:
        return (job.arrival_s, job.id)

    def load_order(self, job: BatchJob) -> tuple:
        return (job.arrival_s, job.id)


class BatchAware(BatchScheduler):
    """Cake's compute priority and CacheFlow's load rule.

    Compute: decode steps, then uncached prefills (and restores with only their new, never-stored
    tokens left, which are a prefill by then), then restores with the least recomputation left
    (shortest remaining first: short restores finish instead of all finishing late together).

    Loads: the restore whose next load saves the most compute per token, i.e. whose last stored chunk
    still pending is the most expensive to recompute (CacheFlow's "highest marginal reduction in
    recomputation cost"; with attention's cost growing along the prompt, that is the long prefixes'
    far chunks). Ranking by chunk rather than by whole request lets the lanes move to a shorter
    request once the long ones are down to chunks as cheap as its own."""

    name = "batch-aware"

    def compute_order(self, job: BatchJob) -> tuple:
        cls = CLASS_ORDER[job.kind]
        if cls == CLASS_ORDER["restore"] and not job.loadable():
            cls = CLASS_ORDER["prefill"]  # nothing left to load: what remains is computing new tokens
        tie = job.remaining_compute() if cls == CLASS_ORDER["restore"] else job.arrival_s
        return (cls, tie, job.arrival_s, job.id)

    def load_order(self, job: BatchJob) -> tuple:
        return (-job.next_load_value(), job.arrival_s, job.id)


@dataclass(frozen=True)
class QueuedLoad:
    """A load waiting for a shared link: `nbytes` read, `saved_s` of compute it saves (what computing
    its tokens would take more than loading them)."""

    key: str
    nbytes: float
    saved_s: float

    @property
    def value(self) -> float:
        """Compute saved per byte read: what the link's next byte is worth spent on this load."""
        return self.saved_s / self.nbytes if self.nbytes > 0 else 0.0


def link_order(loads: Iterable[QueuedLoad]) -> list[QueuedLoad]:
    """The order a link serves waiting `loads` in, CacheFlow's rule (§3.3): the load that saves the
    most compute per byte first, ties in arrival order."""
    return sorted(loads, key=lambda q: -q.value)  # stable: ties keep their arrival order
