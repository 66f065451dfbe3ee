"""A discrete-event simulator of one restore: the real policy objects on a simulated clock, no model.

It applies decisions and finished units with the same bookkeeping as the engine (`bookkeeping.begin`,
`bookkeeping.apply_event`), so what it shows about a policy holds for the engine up to real timing
noise. Compute costs come from a function (a measured profile, or any model of one); loads cross a
`Link` (bandwidth trace, latency, first come first served), as `ThrottledStore` delivers them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.profile import ChunkCost
from kvrestore.policies.base import Decision, Policy, Progress
from kvrestore.policies.batch import (
    BatchAware,
    BatchJob,
    BatchScheduler,
    FifoLanes,
    Unit,
    global_wake,
    note_step,
)
from kvrestore.policies.compute_only import ComputeOnly
from kvrestore.policies.token_two_pointer import TokenTwoPointer
from kvrestore.runtime.bookkeeping import PolicyError, apply_event, begin, begin_loads, begin_step, stalled
from kvrestore.runtime.driver import drive, run_sync
from kvrestore.sim.workload import Request

#: compute_cost(a, b, start_s) -> seconds to compute chunks [a, b) starting at simulated time start_s
ComputeCost = Callable[[int, int, float], float]


@dataclass
class SimResult:
    makespan: float
    trace: Trace
    progress: Progress


def simulate(
    policy: Policy,
    chunk_tokens: Sequence[int],
    stored: Sequence[bool],
    compute_cost: ComputeCost,
    chunk_bytes: Sequence[int],
    link: Link,
    load_lanes: int = 4,
    failing: Collection[int] = (),
    max_steps: int = 1_000_000,
    min_unit_chunks: int = 1,
) -> SimResult:
    """Run `policy` to the end of one restore; loads of chunks in `failing` fail when they land.
    `min_unit_chunks` is the compute lane's floor on a unit (`Progress.min_unit_chunks`)."""
    progress = Progress(list(chunk_tokens), list(stored))
    progress.min_unit_chunks = min_unit_chunks
    progress.can_race = True
    lanes = SimLanes(compute_cost, chunk_bytes, link, load_lanes, failing)
    trace = run_sync(drive(progress, policy, lanes, max_steps=max_steps))
    return SimResult(lanes.now(), trace, progress)


class SimLanes:
    """One restore's lanes on a simulated clock (the driver's `Lanes`): compute units priced by
    `compute_cost`, loads across `link`; the finished units come off a heap in time order. A race ends as
    on the engine: the first of the two to finish wins and the other ends "load-dropped" or
    "compute-dropped" at that instant."""

    def __init__(
        self,
        compute_cost: ComputeCost,
        chunk_bytes: Sequence[int],
        link: Link,
        load_lanes: int,
        failing: Collection[int] = (),
    ) -> None:
        self.compute_cost = compute_cost
        self.chunk_bytes = chunk_bytes
        self.link = link
        self.load_lanes = load_lanes
        self.failing = failing
        self.t = 0.0
        self.queue: list[tuple[float, int, TraceEvent]] = []
        self.seq = 0
        self.live_loads: dict[int, tuple[int, float]] = {}  # chunk -> (its completion's seq, start)
        self.racing: tuple[int, int, float] | None = None  # (chunk, compute completion's seq, start)
        self.lost: set[int] = set()  # completions of racing compute units that lost to their fetch

    def now(self) -> float:
        return self.t

    def _push(self, event: TraceEvent) -> int:
        self.seq += 1
        heapq.heappush(self.queue, (event.end_s, self.seq, event))
        return self.seq

    def stop(self, drops: Sequence[int]) -> None:
        for i in drops:  # the dropped load stops now; its booked link time is spent anyway
            _, start = self.live_loads.pop(i)
            self._push(TraceEvent("load-dropped", i, i, start, self.t))

    def start(self, decision: Decision) -> None:
        now = self.t
        for i in decision.loads:
            end = self.link.reserve(now, self.chunk_bytes[i])
            if i in self.failing:
                event = TraceEvent("load-failed", i, i, now, end, 0, error="simulated fault")
            else:
                event = TraceEvent("load", i, i, now, end, self.chunk_bytes[i])
            self.live_loads[i] = (self._push(event), now)
        if decision.compute is not None:
            a, b = decision.compute
            n = self._push(TraceEvent("compute", a, b - 1, now, now + self.compute_cost(a, b, now)))
            if decision.race:
                self.racing = (a, n, now)

    async def wait(self, wake_at: float | None) -> list[TraceEvent | BaseException]:
        queue = self.queue
        wake = math.inf if wake_at is None else max(wake_at, self.t)
        now = self.t = min(queue[0][0] if queue else math.inf, wake)
        out: list[TraceEvent | BaseException] = []
        while queue and queue[0][0] <= now:
            _, n, event = heapq.heappop(queue)
            kind, i = event.kind, event.first_chunk
            if kind != "compute":
                if kind != "load-dropped":
                    if self.live_loads.get(i, (None,))[0] != n:
                        continue  # the completion of a load dropped earlier
                    del self.live_loads[i]
                out.append(event)
                if kind == "load" and self.racing is not None and self.racing[0] == i:
                    _, lost, start = self.racing  # the fetch won: the compute unit stops now
                    self.racing = None
                    self.lost.add(lost)
                    out.append(TraceEvent("compute-dropped", i, i, start, now))
                continue
            if n in self.lost:
                continue
            if self.racing is not None and self.racing[1] == n:
                self.racing = None
                if i in self.live_loads:  # the compute unit won its race: the fetch stops now
                    _, start = self.live_loads.pop(i)
                    out.append(TraceEvent("load-dropped", i, i, start, now))
            out.append(event)
        return out


# -- many requests on shared lanes -------------------------------------------------------------------


def _own_clock(request: SimRequest, event: TraceEvent) -> TraceEvent:
    """An event on the global clock, moved to its request's own (0 at its arrival), as traces are kept."""
    t0 = request.arrival_s
    return TraceEvent(
        event.kind, event.first_chunk, event.last_chunk, event.start_s - t0, event.end_s - t0, event.nbytes
    )


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


def simulate_batch(
    scheduler: BatchScheduler,
    requests: Sequence[SimRequest],
    link: Link,
    load_lanes: int = 4,
    max_steps: int = 10_000_000,
) -> BatchSimResult:
    """Run a batch of requests arriving over time on one compute lane and `load_lanes` lanes over `link`.

    The same scheduler and per-request policy objects as `BatchEngine`, with the same bookkeeping; a
    step's units run one after another on the compute lane, and the scheduler is asked again when the
    step ends, when a load lands and when a request arrives."""
    n = len(requests)
    jobs: dict[int, BatchJob] = {}
    finish = [math.nan] * n
    traces = [Trace() for _ in range(n)]
    progress = [Progress(list(r.chunk_tokens), list(r.stored)) for r in requests]
    steps: list[tuple[float, tuple[Unit, ...]]] = []
    max_skipped = [0] * n
    arrivals = sorted(range(n), key=lambda i: (requests[i].arrival_s, i))
    queue: list[tuple[float, int, int, TraceEvent | None]] = []  # (time, seq, job, event); None: step end
    seq = 0
    live_loads: dict[tuple[int, int], int] = {}
    compute_free = True
    in_flight = 0
    now = 0.0

    def push(t: float, j: int, event: TraceEvent | None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(queue, (t, seq, j, event))
        if event is not None and event.kind != "compute":
            live_loads[(j, event.first_chunk)] = seq

    def local(j: int, kind: str, i: int, k: int, start: float, end: float, nbytes: int = 0) -> TraceEvent:
        return _own_clock(requests[j], TraceEvent(kind, i, k, start, end, nbytes))

    for _ in range(max_steps):
        while arrivals and requests[arrivals[0]].arrival_s <= now:
            j = arrivals.pop(0)
            r = requests[j]
            jobs[j] = BatchJob(j, r.kind, progress[j], r.policy, r.arrival_s, r.chunk_cost)
            scheduler.check(jobs[j])
            if progress[j].finished:  # nothing to restore
                del jobs[j]
                finish[j] = r.arrival_s
        if not jobs and not arrivals:
            return BatchSimResult(
                [f - r.arrival_s for f, r in zip(finish, requests, strict=True)],
                finish,
                traces,
                progress,
                steps,
                max_skipped,
            )
        wake = math.inf
        if compute_free and jobs:
            step = scheduler.compute_step(list(jobs.values()), now)
            note_step(jobs, step)
            for j in jobs:
                max_skipped[j] = max(max_skipped[j], jobs[j].skipped)
            for j, i in step.drops:
                live_loads.pop((j, i), None)
                start = requests[j].arrival_s + (progress[j].load_started[i] or 0.0)
                push(now, j, local(j, "load-dropped", i, i, start, now))
            begin_step(jobs, step)
            if step.units:
                steps.append((now, step.units))
                t = now
                for u in step.units:
                    end = t + requests[u.job].compute_cost(u.a, u.b)
                    push(end, u.job, local(u.job, "compute", u.a, u.b - 1, t, end))
                    t = end
                push(t, -1, None)
                compute_free = False
            if step.wake_at is not None:
                wake = min(wake, step.wake_at)
        free = load_lanes - in_flight
        if free > 0 and jobs:
            grant = scheduler.load_grants(list(jobs.values()), free, now)
            begin_loads(jobs, grant)
            for j, i in grant.loads:
                end = link.reserve(now, requests[j].chunk_bytes[i])
                push(end, j, local(j, "load", i, i, now, end, requests[j].chunk_bytes[i]))
                in_flight += 1
            if grant.wake_at is not None:
                wake = min(wake, grant.wake_at)
        nxt = min(
            queue[0][0] if queue else math.inf,
            wake,
            requests[arrivals[0]].arrival_s if arrivals else math.inf,
        )
        if nxt == math.inf:
            left = {j: progress[j].pending() for j in jobs}
            raise PolicyError(f"{scheduler!r} left chunks {left} (job: chunks) with no unit running")
        now = max(now, nxt)
        while queue and queue[0][0] <= now:
            _, s, j, event = heapq.heappop(queue)
            if event is None:
                compute_free = True
                continue
            if event.kind != "compute":
                if event.kind == "load" and live_loads.get((j, event.first_chunk)) != s:
                    continue  # a load dropped earlier (its drop event was applied instead)
                live_loads.pop((j, event.first_chunk), None)
                in_flight -= 1
            apply_event(progress[j], event)
            traces[j].add(event)
            if progress[j].finished and j in jobs:
                del jobs[j]
                finish[j] = now
    raise PolicyError(f"{scheduler!r} did not finish the batch within {max_steps} steps")


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


def simulate_independent(requests: Sequence[SimRequest], link: Link, load_lanes: int = 4) -> BatchSimResult:
    """The same requests as independent restores on one `Engine` (no batch scheduler): each runs its own
    policy as if alone, and the lanes serve units in the order they were asked for (the compute lane's
    and the load lanes' FIFO queues). This is what concurrent `Restorer.restore` calls do on a plain
    `Engine`, and the baseline the batch schedulers are measured against."""
    n = len(requests)
    progress = [Progress(list(r.chunk_tokens), list(r.stored)) for r in requests]
    traces = [Trace() for _ in range(n)]
    finish = [math.nan] * n
    compute_q: list[tuple[int, int, int]] = []  # (job, a, b) waiting for the compute lane
    load_q: list[tuple[int, int]] = []  # (job, chunk) waiting for a load lane
    serving: dict[tuple[int, int], tuple[float, int]] = {}  # load in service -> (start, event seq)
    queue: list[tuple[float, int, int, TraceEvent | None]] = []
    seq = 0
    compute_busy_until: float | None = None
    to_decide = set()
    wakes: list[tuple[float, int]] = []
    arrivals = sorted(range(n), key=lambda i: (requests[i].arrival_s, i))
    now = 0.0

    def push(t: float, j: int, event: TraceEvent | None) -> int:
        nonlocal seq
        seq += 1
        heapq.heappush(queue, (t, seq, j, event))
        return seq

    def local(j: int, kind: str, i: int, k: int, start: float, end: float, nbytes: int = 0) -> TraceEvent:
        return _own_clock(requests[j], TraceEvent(kind, i, k, start, end, nbytes))

    while True:
        while arrivals and requests[arrivals[0]].arrival_s <= now:
            to_decide.add(arrivals.pop(0))
        while wakes and wakes[0][0] <= now:
            to_decide.add(heapq.heappop(wakes)[1])
        for j in sorted(to_decide):
            p, r = progress[j], requests[j]
            if p.finished:
                if math.isnan(finish[j]):
                    finish[j] = now
                continue
            p.now = now - r.arrival_s
            p.free_load_lanes = max(0, load_lanes - p.loads_in_flight)
            d = r.policy.decide(p)
            for i in d.drop:
                if (j, i) in load_q:
                    load_q.remove((j, i))
                    start = now
                else:
                    start, _ = serving.pop((j, i))
                push(now, j, local(j, "load-dropped", i, i, start, now))
            begin(p, d, r.policy)
            if d.compute is not None:
                compute_q.append((j, *d.compute))
            load_q.extend((j, i) for i in d.loads)
            if d.wake_at is not None:
                heapq.heappush(wakes, (global_wake(d.wake_at, r.arrival_s, now), j))
            if stalled(p, d):
                raise PolicyError(f"{r.policy!r} left chunks {p.pending()} with no unit running")
        to_decide.clear()
        if compute_busy_until is None and compute_q:
            j, a, b = compute_q.pop(0)
            end = now + requests[j].compute_cost(a, b)
            push(end, j, local(j, "compute", a, b - 1, now, end))
            compute_busy_until = end
        while load_q and len(serving) < load_lanes:
            j, i = load_q.pop(0)
            end = link.reserve(now, requests[j].chunk_bytes[i])
            serving[(j, i)] = (
                now,
                push(end, j, local(j, "load", i, i, now, end, requests[j].chunk_bytes[i])),
            )
        if all(not math.isnan(f) for f in finish):
            return BatchSimResult(
                [f - r.arrival_s for f, r in zip(finish, requests, strict=True)],
                finish,
                traces,
                progress,
                [],
                [0] * n,
            )
        nxt = min(
            queue[0][0] if queue else math.inf,
            wakes[0][0] if wakes else math.inf,
            requests[arrivals[0]].arrival_s if arrivals else math.inf,
        )
        if nxt == math.inf:
            raise PolicyError("independent restores stalled with nothing running")
        now = max(now, nxt)
        while queue and queue[0][0] <= now:
            _, s, j, event = heapq.heappop(queue)
            if event.kind == "compute":
                compute_busy_until = None
            elif event.kind == "load":
                if serving.get((j, event.first_chunk), (0, -1))[1] != s:
                    continue  # dropped while in service
                del serving[(j, event.first_chunk)]
            apply_event(progress[j], event)
            traces[j].add(event)
            to_decide.add(j)


def batch_lower_bound(
    workload: Sequence[Request], cost: ChunkCost, kv_bytes_per_token: int, chunk_size: int, bytes_per_s: float
) -> float:
    """Seconds before which no schedule can finish all of `workload` (taken as arriving at once) on one
    compute lane priced by `cost` and one link of `bytes_per_s`.

    Every stored chunk is either computed or loaded, every other chunk computed; the lane and the link
    each do one thing at a time, so the makespan is at least the smaller of max(compute, load) over all
    such splits. Relaxed to stay a bound whatever the units: no per-call cost, each chunk priced at what
    any unit containing it must spend on it at least (attention to the past at min(past, own-length)
    rate), no order between chunks, and a chunk may be split between lane and link. The best split loads
    the chunks that save the most compute per byte.
    """
    if bytes_per_s <= 0:
        raise InvalidInputError(f"bytes_per_s must be positive, got {bytes_per_s}")
    floor = ChunkCost(0.0, cost.per_token_s, min(cost.per_token_past_s, cost.per_token2_s), cost.per_token2_s)
    compute, loadable = 0.0, []
    for r in sim_requests(workload, floor, kv_bytes_per_token, chunk_size, ComputeOnly):
        for c, nbytes, stored in zip(r.chunk_cost, r.chunk_bytes, r.stored, strict=True):
            compute += c
            if stored:
                loadable.append((c, nbytes / bytes_per_s))
    load = 0.0
    for c, t in sorted(loadable, key=lambda x: -x[0] / x[1]):
        if compute - c <= load + t:  # the balance falls inside this chunk
            return load + (compute - load) / (c + t) * t
        compute -= c
        load += t
    return compute


#: the three ways `compare_schedulers` runs a workload
CASES = ("independent", "fifo", "batch-aware")


def compare_schedulers(
    workload: Sequence[Request],
    cost: ChunkCost,
    kv_bytes_per_token: int,
    bytes_per_s: float,
    *,
    chunk_size: int = 256,
    load_lanes: int = 4,
    token_budget: int = 512,
    latency_s: float = 0.001,
) -> dict[str, BatchSimResult]:
    """`workload` three ways on the same simulated machine: independent restores (a plain `Engine`),
    `FifoLanes` and `BatchAware`, each request with its own token-wise two-pointer."""
    out = {}
    for case in CASES:
        requests = sim_requests(workload, cost, kv_bytes_per_token, chunk_size, TokenTwoPointer)
        link = Link(BandwidthTrace.constant(bytes_per_s), latency_s)
        if case == "independent":
            out[case] = simulate_independent(requests, link, load_lanes)
        else:
            scheduler = FifoLanes(token_budget) if case == "fifo" else BatchAware(token_budget)
            out[case] = simulate_batch(scheduler, requests, link, load_lanes)
    return out


def balance_bytes_per_s(
    workload: Sequence[Request], cost: ChunkCost, kv_bytes_per_token: int, chunk_size: int = 256
) -> float:
    """The link speed at which loading the workload's stored chunks takes as long as computing its
    restores from scratch (its restores' stored bytes over their compute-only time)."""
    requests = [
        r
        for r in sim_requests(workload, cost, kv_bytes_per_token, chunk_size, ComputeOnly)
        if r.kind == "restore"
    ]
    compute = sum(r.compute_cost(0, len(r.chunk_tokens)) for r in requests)
    stored = sum(b for r in requests for b, s in zip(r.chunk_bytes, r.stored, strict=True) if s)
    if compute <= 0 or stored <= 0:
        raise InvalidInputError("the workload has no stored chunk to restore")
    return stored / compute
