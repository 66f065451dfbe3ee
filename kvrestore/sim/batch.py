"""Many requests on shared lanes, simulated: under a batch scheduler, or as independent restores.

Both run the runtime's one driver loop on a simulated clock, so they keep exactly the rules of the
engines they stand for: `simulate_batch` is `driver.drive_batch` (the loop under a batch scheduler, as
the `BatchEngine` runs it) over simulated batch lanes; `simulate_independent` is one `driver.drive` (the
loop under one policy, as the `Engine` runs it) per request,
over one simulated machine whose compute lane and load lanes serve units first come, first served, as a
plain `Engine`'s limiters do. Traces are kept on each request's own clock (0 at its arrival).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrestore.core.bandwidth import Link
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.estimates import Estimates
from kvrestore.policies.base import Decision, Policy, Progress
from kvrestore.policies.batch import BatchJob, BatchScheduler, ComputeStep, LoadGrant, Unit, global_wake
from kvrestore.runtime.bookkeeping import PolicyError
from kvrestore.runtime.driver import drive, drive_batch, run_sync
from kvrestore.sim.workload import Request


@dataclass
class SimRequest:
    """One request of a simulated batch: its chunks, which are stored, and what each costs.

    `compute_cost(a, b)` is the seconds to compute its chunks [a, b); `chunk_cost` ranks its chunks for
    the scheduler (usually each chunk's own compute seconds)."""

    arrival_s: float
    kind: str
    chunk_tokens: Sequence[int]
    stored: Sequence[bool]
    chunk_bytes: Sequence[int]
    policy: Policy
    compute_cost: Callable[[int, int], float]
    chunk_cost: Sequence[float]


@dataclass
class BatchSimResult:
    """Per request (in the order given): arrival-to-finish time (`ttft_s`) and finish time, its trace
    (on its own clock) and progress; per step: start time and units; the most steps in a row each job
    wanted compute and was passed over."""

    ttft_s: list[float]
    finish_s: list[float]
    traces: list[Trace]
    progress: list[Progress]
    steps: list[tuple[float, tuple[Unit, ...]]]
    max_skipped: list[int]

    @property
    def makespan(self) -> float:
        return max(self.finish_s, default=0.0)


class _Machine:
    """What both simulations share: requests arriving over time, a heap of future unit completions
    (global clock, events on their request's own clock) and a link."""

    def __init__(self, requests: Sequence[SimRequest], link: Link, load_lanes: int) -> None:
        n = len(requests)
        self.requests, self.link, self.load_lanes = requests, link, load_lanes
        self.progress = [Progress(list(r.chunk_tokens), list(r.stored)) for r in requests]
        self.traces = [Trace() for _ in range(n)]
        self.finish = [math.nan] * n
        self.arrivals = sorted(range(n), key=lambda i: (requests[i].arrival_s, i))
        self.queue: list[tuple[float, int, int, TraceEvent | None]] = []  # (time, seq, job, event)
        self.seq = 0
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def push(self, t: float, j: int, event: TraceEvent | None) -> int:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, j, event))
        return self.seq

    def local(
        self, j: int, kind: str, i: int, k: int, start: float, end: float, nbytes: int = 0
    ) -> TraceEvent:
        """An event on the global clock, moved to its request's own (0 at its arrival)."""
        t0 = self.requests[j].arrival_s
        return TraceEvent(kind, i, k, start - t0, end - t0, nbytes)

    def arrived(self) -> list[int]:
        """The requests that have arrived by now and were not handed out yet."""
        out = []
        while self.arrivals and self.requests[self.arrivals[0]].arrival_s <= self.t:
            out.append(self.arrivals.pop(0))
        return out

    def advance(self, *wakes: float) -> None:
        """Move the clock to the next completion, wake-up or arrival."""
        nxt = min(
            self.queue[0][0] if self.queue else math.inf,
            *wakes,
            self.requests[self.arrivals[0]].arrival_s if self.arrivals else math.inf,
        )
        if nxt == math.inf:
            raise PolicyError("the simulated restores stalled with nothing running")
        self.t = max(self.t, nxt)

    def result(self, steps: list[tuple[float, tuple[Unit, ...]]], max_skipped: list[int]) -> BatchSimResult:
        ttft = [f - r.arrival_s for f, r in zip(self.finish, self.requests, strict=True)]
        return BatchSimResult(ttft, self.finish, self.traces, self.progress, steps, max_skipped)


class _BatchLanes(_Machine):
    """`driver.BatchLanes` on a simulated clock: a step's units run one after another on the compute
    lane; loads cross the link."""

    def __init__(
        self, scheduler: BatchScheduler, requests: Sequence[SimRequest], link: Link, lanes: int
    ) -> None:
        super().__init__(requests, link, lanes)
        self.scheduler = scheduler
        self.active: dict[int, BatchJob] = {}
        self.all: dict[int, BatchJob] = {}
        self.steps: list[tuple[float, tuple[Unit, ...]]] = []
        self.live_loads: dict[tuple[int, int], int] = {}
        self.computing = False
        self.in_flight = 0

    def jobs(self) -> dict[int, BatchJob] | None:
        for j in self.arrived():
            r = self.requests[j]
            job = self.all[j] = BatchJob(
                j, r.kind, self.progress[j], r.policy, r.arrival_s, r.chunk_cost, estimate=Estimates
            )
            self.scheduler.check(job)
            if job.progress.finished:  # nothing to restore
                self.finish[j] = r.arrival_s
            else:
                self.active[j] = job
        return self.active if self.active or self.arrivals else None

    def loads_in_flight(self) -> int:
        return self.in_flight

    def busy(self) -> bool:
        return bool(self.queue) or bool(self.arrivals)

    def stop(self, drops: Sequence[tuple[int, int]]) -> None:
        for j, i in drops:
            self.live_loads.pop((j, i), None)
            start = self.requests[j].arrival_s + (self.progress[j].load_started[i] or 0.0)
            self.push(self.t, j, self.local(j, "load-dropped", i, i, start, self.t))

    def start_step(self, step: ComputeStep) -> None:
        self.steps.append((self.t, step.units))
        t = self.t
        for u in step.units:
            end = t + self.requests[u.job].compute_cost(u.a, u.b)
            self.push(end, u.job, self.local(u.job, "compute", u.a, u.b - 1, t, end))
            t = end
        self.push(t, -1, None)
        self.computing = True

    def start_loads(self, grant: LoadGrant) -> None:
        for j, i in grant.loads:
            nbytes = self.requests[j].chunk_bytes[i]
            end = self.link.reserve(self.t, nbytes)
            self.live_loads[(j, i)] = self.push(end, j, self.local(j, "load", i, i, self.t, end, nbytes))
            self.in_flight += 1

    def fail(self, jobs: Sequence[BatchJob], error: Exception) -> None:
        raise error

    async def wait(self, wake_at: float | None) -> list[tuple[BatchJob, TraceEvent]]:
        self.advance(math.inf if wake_at is None else wake_at)
        out = []
        while self.queue and self.queue[0][0] <= self.t:
            _, s, j, event = heapq.heappop(self.queue)
            if event is None:  # the step ended
                self.computing = False
                continue
            if event.kind != "compute":
                if event.kind == "load" and self.live_loads.get((j, event.first_chunk)) != s:
                    continue  # a load dropped earlier (its drop event was applied instead)
                self.live_loads.pop((j, event.first_chunk), None)
                self.in_flight -= 1
            out.append((self.all[j], event))
        return out

    def record(self, job: BatchJob, event: TraceEvent) -> None:
        self.traces[job.id].add(event)
        if job.progress.finished and job.id in self.active:
            del self.active[job.id]
            self.finish[job.id] = self.t


def simulate_batch(
    scheduler: BatchScheduler,
    requests: Sequence[SimRequest],
    link: Link,
    load_lanes: int = 4,
    max_steps: int = 10_000_000,
) -> BatchSimResult:
    """Run a batch of requests arriving over time on one compute lane and `load_lanes` lanes over `link`.

    The same scheduler and per-request policy objects as `BatchEngine`, with the same driver loop; a
    step's units run one after another on the compute lane, and the scheduler is asked again when the
    step ends, when a load lands and when a request arrives."""
    lanes = _BatchLanes(scheduler, requests, link, load_lanes)
    run_sync(drive_batch(scheduler, lanes, max_steps))
    return lanes.result(lanes.steps, [lanes.all[j].most_skipped for j in range(len(requests))])


class _Suspend:
    """Awaited by a restore's driver to hand control back to the simulated machine."""

    def __await__(self) -> Any:
        yield self


class _FifoMachine(_Machine):
    """A plain `Engine` on a simulated clock: every request's driver asks for units, and the compute
    lane and the load lanes serve them in the order asked for."""

    def __init__(self, requests: Sequence[SimRequest], link: Link, load_lanes: int) -> None:
        super().__init__(requests, link, load_lanes)
        self.compute_q: list[tuple[int, int, int]] = []  # (job, a, b) waiting for the compute lane
        self.load_q: list[tuple[int, int]] = []  # (job, chunk) waiting for a load lane
        self.serving: dict[tuple[int, int], tuple[float, int]] = {}  # load in service -> (start, seq)
        self.computing = False
        self.wakes: list[tuple[float, int]] = []
        self.inbox: dict[int, list[TraceEvent | BaseException]] = {}

    def dispatch(self) -> None:
        """Start what the free lanes can take, first come first served."""
        if not self.computing and self.compute_q:
            j, a, b = self.compute_q.pop(0)
            end = self.t + self.requests[j].compute_cost(a, b)
            self.push(end, j, self.local(j, "compute", a, b - 1, self.t, end))
            self.computing = True
        while self.load_q and len(self.serving) < self.load_lanes:
            j, i = self.load_q.pop(0)
            nbytes = self.requests[j].chunk_bytes[i]
            end = self.link.reserve(self.t, nbytes)
            self.serving[(j, i)] = (
                self.t,
                self.push(end, j, self.local(j, "load", i, i, self.t, end, nbytes)),
            )

    def deliver(self) -> set[int]:
        """Hand the units finished by now to their requests; returns the requests to resume."""
        out = set()
        while self.queue and self.queue[0][0] <= self.t:
            _, s, j, event = heapq.heappop(self.queue)
            assert event is not None
            if event.kind == "compute":
                self.computing = False
            elif event.kind == "load":
                if self.serving.get((j, event.first_chunk), (0, -1))[1] != s:
                    continue  # dropped while in service
                del self.serving[(j, event.first_chunk)]
            self.inbox.setdefault(j, []).append(event)
            out.add(j)
        while self.wakes and self.wakes[0][0] <= self.t:
            out.add(heapq.heappop(self.wakes)[1])
        return out


class _OneRestore:
    """One request's view of the FIFO machine: the driver's `Lanes` on the request's own clock."""

    def __init__(self, machine: _FifoMachine, j: int) -> None:
        self.m, self.j = machine, j
        self.t0 = machine.requests[j].arrival_s
        self.load_lanes = machine.load_lanes

    def now(self) -> float:
        return self.m.t - self.t0

    def stop(self, drops: Sequence[int]) -> None:
        m, j = self.m, self.j
        for i in drops:
            if (j, i) in m.load_q:
                m.load_q.remove((j, i))
                start = m.t
            else:
                start, _ = m.serving.pop((j, i))
            m.push(m.t, j, m.local(j, "load-dropped", i, i, start, m.t))

    def delivered(self) -> float | None:
        return None  # the lanes are shared: what the link delivers is not this restore's alone

    def start(self, decision: Decision) -> None:
        if decision.compute is not None:
            self.m.compute_q.append((self.j, *decision.compute))
        self.m.load_q.extend((self.j, i) for i in decision.loads)

    async def wait(self, wake_at: float | None) -> list[TraceEvent | BaseException]:
        if wake_at is not None:
            heapq.heappush(self.m.wakes, (global_wake(wake_at, self.t0, self.m.t), self.j))
        await _Suspend()
        return self.m.inbox.pop(self.j, [])


def simulate_independent(requests: Sequence[SimRequest], link: Link, load_lanes: int = 4) -> BatchSimResult:
    """The same requests as independent restores on one `Engine` (no batch scheduler): each runs its own
    policy as if alone, and the lanes serve units in the order they were asked for (the compute lane's
    and the load lanes' FIFO queues). This is what concurrent `Restorer.restore` calls do on a plain
    `Engine`, and the baseline the batch schedulers are measured against."""
    m = _FifoMachine(requests, link, load_lanes)
    restores: dict[int, Any] = {}
    resume: set[int] = set()
    while True:
        for j in m.arrived():
            restores[j] = drive(m.progress[j], requests[j].policy, _OneRestore(m, j))
            resume.add(j)
        for j in sorted(resume):
            if not math.isnan(m.finish[j]):
                continue
            try:
                restores[j].send(None)  # runs the request's driver until it waits for its lanes
            except StopIteration as done:
                m.traces[j], m.finish[j] = done.value, m.t
        m.dispatch()
        if all(not math.isnan(f) for f in m.finish):
            return m.result([], [0] * len(requests))
        m.advance(m.wakes[0][0] if m.wakes else math.inf)
        resume = m.deliver()


def sim_requests(
    workload: Sequence[Request],
    cost: ChunkCost,
    kv_bytes_per_token: int,
    chunk_size: int,
    policy: Callable[[], Policy],
) -> list[SimRequest]:
    """Simulated requests for a workload (`kvrestore.sim.workload`), as a `Restorer` would chunk them.

    A restore's prompt is its stored prefix plus its new tokens, cut into `chunk_size` chunks from the
    start; the chunks wholly inside the prefix are stored. A prefill stores nothing. A decode step is
    one token attending to its context. `cost` (a profile's `chunk`) prices every compute unit; each
    request gets its own `policy()`."""
    out = []
    for r in workload:
        if r.kind == "decode":
            tokens, stored, starts = [1], [False], [r.prefix_tokens]
        else:
            total = r.prefix_tokens + r.new_tokens
            starts = list(range(0, total, chunk_size))
            tokens = [min(chunk_size, total - s) for s in starts]
            stored = [
                r.kind == "restore" and s + n <= r.prefix_tokens for s, n in zip(starts, tokens, strict=True)
            ]

        def compute(a: int, b: int, starts: list[int] = starts, tokens: list[int] = tokens) -> float:
            return cost.seconds(sum(tokens[a:b]), starts[a])

        out.append(
            SimRequest(
                r.arrival_s,
                r.kind,
                tokens,
                stored,
                [n * kv_bytes_per_token for n in tokens],
                policy(),
                compute,
                [cost.seconds(n, s) for n, s in zip(tokens, starts, strict=True)],
            )
        )
    return out
