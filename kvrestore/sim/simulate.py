"""A discrete-event simulator of one restore: the real policy objects on a simulated clock, no model.

It is the engine's own driver loop (`runtime.driver.drive`) over simulated lanes (`SimLanes`), so what
it shows about a policy holds for the engine up to real timing noise. Compute costs come from a function (a measured profile, or any model of one); loads cross a
`Link` (bandwidth trace, latency, first come first served), as `ThrottledStore` delivers them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvrestore.core.bandwidth import Link
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.estimates import Priors
from kvrestore.policies.base import Decision, LaneTraits, Policy, Progress
from kvrestore.runtime.driver import drive, run_sync

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
    priors: tuple[Sequence[float | None], tuple[float, float] | None] | None = None,
    sees_arrivals: bool = True,
    unit_fixed_s: float = 0.0,
) -> SimResult:
    """Run `policy` to the end of one restore; loads of chunks in `failing` fail when they land.
    `min_unit_chunks` is the compute lane's floor on a unit (`LaneTraits.min_unit_chunks`); `priors` what
    the policy is told before it observes anything (`Priors.compute_s`, `Priors.link`), as a restorer
    tells it from its cost model, with `unit_fixed_s` the part of each chunk's prior that a unit pays
    once (`Priors.unit_fixed_s`). `sees_arrivals`: the policy sees the link's bytes arrive
    (`costs.estimates.Arrivals`), as from a `ThrottledStore`; else only whole fetches landing."""
    told = (
        Priors(list(priors[0]), priors[1], unit_fixed_s)
        if priors is not None
        else Priors(unit_fixed_s=unit_fixed_s)
    )
    progress = Progress(list(chunk_tokens), list(stored), lanes=LaneTraits(min_unit_chunks, True, True))
    lanes = SimLanes(compute_cost, chunk_bytes, link, load_lanes, failing)
    if sees_arrivals and sum(chunk_tokens) > 0:
        lanes.bytes_per_token = sum(chunk_bytes) / sum(chunk_tokens)
    trace = run_sync(drive(progress, policy, lanes, max_steps=max_steps, priors=told))
    return SimResult(lanes.now(), trace, progress)


@dataclass(eq=False)
class SimLanes:
    """One restore's lanes on a simulated clock (the driver's `Lanes`): compute units priced by
    `compute_cost`, loads across `link`; the finished units come off a heap in time order. A race ends as
    on the engine: the first of the two to finish wins and the other ends "load-dropped" or
    "compute-dropped" at that instant. So do fetches aside (`Decision.overtake`): once every chunk of the
    compute unit in flight has landed aside, the unit stops ("compute-overtaken"); a unit that ends
    first ends the fetches aside still in flight ("aside-dropped")."""

    compute_cost: ComputeCost
    chunk_bytes: Sequence[int]
    link: Link
    load_lanes: int
    failing: Collection[int] = ()
    t: float = 0.0
    queue: list[tuple[float, int, TraceEvent]] = field(default_factory=list)
    seq: int = 0
    #: loads in flight: chunk -> (its completion's seq, its start)
    live_loads: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: the race in progress: (chunk, the compute unit's completion seq, its start)
    racing: tuple[int, int, float] | None = None
    #: completions of racing compute units that lost to their fetch
    lost: set[int] = field(default_factory=set)
    #: the compute unit running in place: (a, b, its completion's seq, its start)
    unit: tuple[int, int, int, float] | None = None
    #: fetches aside in flight: chunk -> (its completion's seq, its start); and the bytes of those landed
    aside: dict[int, tuple[int, float]] = field(default_factory=dict)
    landed: dict[int, int] = field(default_factory=dict)
    #: the link's bytes per token, to say what it has delivered (`delivered`); None: it does not say
    bytes_per_token: float | None = None

    def now(self) -> float:
        return self.t

    def delivered(self) -> float | None:
        if self.bytes_per_token is None:
            return None
        return self.link.delivered(self.t) / self.bytes_per_token

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
            self.live_loads[i] = (self._fetch(i, "load"), now)
        if decision.compute is not None:
            a, b = decision.compute
            n = self._push(TraceEvent("compute", a, b - 1, now, now + self.compute_cost(a, b, now)))
            if decision.race:
                self.racing = (a, n, now)
            else:
                self.unit, self.landed = (a, b, n, now), {}
        for i in decision.overtake:
            self.aside[i] = (self._fetch(i, "aside"), now)

    def _fetch(self, i: int, kind: str) -> int:
        """Book chunk i's bytes on the link from now; its completion ("load" or "aside", or `kind`-failed
        for a chunk in `failing`) goes on the heap. Returns the completion's seq."""
        end = self.link.reserve(self.t, self.chunk_bytes[i])
        if i in self.failing:
            return self._push(TraceEvent(f"{kind}-failed", i, i, self.t, end, 0, error="simulated fault"))
        return self._push(TraceEvent(kind, i, i, self.t, end, self.chunk_bytes[i]))

    def _aside_landed(self, event: TraceEvent, n: int, out: list[TraceEvent | BaseException]) -> None:
        """A fetch aside completed: it counts unless its unit ended first; the last chunk of the unit
        to land stops the unit."""
        i = event.first_chunk
        if self.aside.get(i, (None,))[0] != n:
            return  # dropped when its unit ended
        del self.aside[i]
        out.append(event)
        if self.unit is None or event.kind != "aside":
            return
        a, b, lost, start = self.unit
        self.landed[i] = event.nbytes
        if len(self.landed) == b - a:
            self.unit = None
            self.lost.add(lost)
            out.append(TraceEvent("compute-overtaken", a, b - 1, start, self.t, sum(self.landed.values())))

    def _unit_ended(self, out: list[TraceEvent | BaseException]) -> None:
        """The compute unit in place finished first: its fetches aside still in flight stop now."""
        self.unit = None
        for i, (_, start) in sorted(self.aside.items()):
            out.append(TraceEvent("aside-dropped", i, i, start, self.t))
        self.aside.clear()

    async def wait(self, wake_at: float | None) -> list[TraceEvent | BaseException]:
        queue = self.queue
        wake = math.inf if wake_at is None else max(wake_at, self.t)
        now = self.t = min(queue[0][0] if queue else math.inf, wake)
        out: list[TraceEvent | BaseException] = []
        while queue and queue[0][0] <= now:
            _, n, event = heapq.heappop(queue)
            kind, i = event.kind, event.first_chunk
            if kind.startswith("aside"):
                self._aside_landed(event, n, out)
                continue
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
            if self.unit is not None and self.unit[2] == n:
                self._unit_ended(out)
        return out
