"""What an engine runs: one restore as a single request object.

A restore hands its engine a `RunRequest`: the restore's `Progress` and `Policy`, the two kinds of unit
work (compute chunks [a, b); load chunk i) and how the engine reports back. Every engine runs those.
`FastPaths` are the further ways a plain `Engine` may run the units (blocking loads on lane threads,
races, fetches aside); a `BatchEngine` schedules units as one batch step and cannot take them, so it
refuses a request that carries them rather than ignore them (`Engine.takes_fast_paths` says which).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvrestore.core.trace import TraceEvent
from kvrestore.costs.estimates import NO_PRIORS, Priors
from kvrestore.policies.base import Policy, Progress

#: computes chunks [a, b) and writes their KV
ComputeFn = Callable[[int, int], None]
#: computes chunks [a, b) without writing them; returns what writes them (called only if it won its race)
ComputeApartFn = Callable[[int, int], Callable[[], None]]
#: loads chunk i into the restore's KV; returns the stored bytes read, raising on any fault
LoadFn = Callable[[int], Awaitable[int]]


class Placing(Protocol):
    """A chunk read by a blocking load and not yet written (`chunkio.load.Fetched`): `place` writes it
    and returns the stored bytes read; `discard` drops it unwritten (the load was abandoned)."""

    def place(self) -> int: ...

    def discard(self) -> None: ...


#: the same load as blocking calls, for a store that reads without the event loop: reads chunk i (which
#: may stall; nothing is written yet) and returns what writes it
LoadNowFn = Callable[[int], Placing]
#: fetches chunk i into a buffer of its own; returns the stored bytes read and what writes it in place
LoadAsideFn = Callable[[int], Awaitable[tuple[int, Callable[[], None]]]]


@dataclass(frozen=True)
class FastPaths:
    """Ways a plain `Engine` may run a restore's units besides `compute` and `load` in turn.

    `load_now`: loads run on the engine's lane threads as blocking calls (on asyncio; elsewhere the
    request's `load` is used): the read, which a deadline or a cancel abandons, then the placing. `compute_apart`: a policy may race a compute unit against a fetch
    (`Decision.race`). `load_aside`: fetches may overtake a compute unit running in place
    (`Decision.overtake`). Each is optional.
    """

    load_now: LoadNowFn | None = None
    compute_apart: ComputeApartFn | None = None
    load_aside: LoadAsideFn | None = None


@dataclass(frozen=True)
class RunRequest:
    """One restore as an engine runs it.

    `progress` and `policy` are the restore's state and its decisions; `compute` and `load` do its
    units; `on_event` hears of each finished unit; `load_timeout_s` bounds each load (None: unbounded): a
    load past it is abandoned, its chunk a miss, and `timed_out` (if given) is told, on the loop, with
    the seconds; `fast_paths` only for an engine that `takes_fast_paths`.
    """

    progress: Progress
    policy: Policy
    compute: ComputeFn
    load: LoadFn
    on_event: Callable[[TraceEvent], None] | None = None
    load_timeout_s: float | None = None
    fast_paths: FastPaths | None = None
    #: tokens' worth of bytes the store has delivered so far, reads in flight included (None, or a
    #: meter that answers None: the store sees a read's bytes only once it has finished)
    delivered: Callable[[], float | None] | None = None
    #: told the seconds when a load of this restore ran past `load_timeout_s` (the store counts as down)
    timed_out: Callable[[float], None] | None = None
    #: what the cost model predicts before the restore observes anything (`costs.estimates.Priors`)
    priors: Priors = NO_PRIORS
