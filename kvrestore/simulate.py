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

from .bandwidth import Link
from .bookkeeping import PolicyError, apply_event, begin, stalled
from .policies.base import Policy, Progress
from .trace import Trace, TraceEvent

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
) -> SimResult:
    """Run `policy` to the end of one restore; loads of chunks in `failing` fail when they land."""
    progress = Progress(list(chunk_tokens), list(stored))
    trace = Trace()
    queue: list[tuple[float, int, TraceEvent]] = []
    seq = 0
    live_loads: dict[int, int] = {}  # chunk -> sequence number of its load's completion
    now = 0.0

    def push(event: TraceEvent) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(queue, (event.end_s, seq, event))
        if event.kind != "compute":
            live_loads[event.first_chunk] = seq

    for _ in range(max_steps):
        if progress.finished:
            return SimResult(now, trace, progress)
        progress.now = now
        progress.free_load_lanes = max(0, load_lanes - progress.loads_in_flight)
        decision = policy.decide(progress)
        for i in decision.drop:  # the dropped load stops now; its booked link time is spent anyway
            live_loads.pop(i, None)
            start = progress.load_started[i] or now
            push(TraceEvent("load-dropped", i, i, start, now))
        begin(progress, decision, policy)
        if decision.compute is not None:
            a, b = decision.compute
            push(TraceEvent("compute", a, b - 1, now, now + compute_cost(a, b, now)))
        for i in decision.loads:
            end = link.reserve(now, chunk_bytes[i])
            kind = "load-failed" if i in failing else "load"
            nbytes = 0 if i in failing else chunk_bytes[i]
            push(TraceEvent(kind, i, i, now, end, nbytes, error="simulated fault" if i in failing else None))
        if stalled(progress, decision):
            raise PolicyError(f"{policy!r} left chunks {progress.pending()} with no unit running")
        wake = math.inf if decision.wake_at is None else max(decision.wake_at, now)
        now = min(queue[0][0] if queue else math.inf, wake)
        while queue and queue[0][0] <= now:
            _, n, event = heapq.heappop(queue)
            if event.kind in ("load", "load-failed") and live_loads.get(event.first_chunk) != n:
                continue  # the completion of a load dropped earlier
            if event.kind != "compute":
                live_loads.pop(event.first_chunk, None)
            apply_event(progress, event)
            trace.add(event)
    raise PolicyError(f"{policy!r} did not finish within {max_steps} steps")
