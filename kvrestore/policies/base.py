"""The policy interface: a pure per-step decision, like vLLM's scheduler.

A restore's `Progress` says what each chunk is doing and what was observed; the driver asks the policy,
whenever a lane frees up or a unit finishes, what to start next. The policy answers with a `Decision`; it owns no
thread, tensor or clock, so it can be driven by a simulated clock in property tests and simulators.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kvrestore.core.errors import InvalidInputError


class ChunkStatus(str, Enum):
    PENDING = "pending"
    COMPUTING = "computing"
    LOADING = "loading"
    COMPUTED = "computed"
    LOADED = "loaded"

    @property
    def done(self) -> bool:
        return self in (ChunkStatus.COMPUTED, ChunkStatus.LOADED)


@dataclass
class LaneTraits:
    """What the driver's lanes are and can do, fixed before a restore's first decision."""

    #: the fewest chunks a compute unit should cover on this compute lane (a GPU's units below that
    #: are launch-bound: their time is kernel launches, not work; see `HFBackend.min_unit_tokens`)
    min_unit_chunks: int = 1
    #: whether the driver can race a compute unit against a chunk's fetch (`Decision.race`)
    can_race: bool = False
    #: whether the driver can fetch the chunks of a running compute unit aside (`Decision.overtake`)
    can_overtake: bool = False


@dataclass
class RunningUnit:
    """The compute unit running now, beyond its chunks' `COMPUTING` status."""

    #: when it began (on the progress clock)
    started: float | None = None
    #: the chunk that it and a fetch are racing for, while they do
    racing: int | None = None
    #: its chunks fetched aside: True once landed, False while in flight
    aside: dict[int, bool] = field(default_factory=dict)


@dataclass
class Progress:
    """What the driver knows of one restore: each chunk's state and timings, its lanes and its clock.

    What is known before the restore starts is given to the constructor: the chunks, which are stored,
    and the lanes' traits (`LaneTraits`: an `Engine` sets the two capabilities from its request with
    `runtime.bookkeeping.set_capabilities`). Every later change is made by `runtime.bookkeeping` alone:
    `observe` (the clock and the free load lanes, before each decision), `begin` (a decision's units
    started) and `apply_event` (a unit finished). Policies only read it, with what it implies about the
    lanes worked out apart (`costs.estimates.Estimates`); to ask what a policy would do under other
    observations, `as_if` gives a copy.
    """

    chunk_tokens: list[int]
    stored: list[bool]  # believed loadable; a failed load turns it False
    status: list[ChunkStatus] = field(default_factory=list)
    compute_busy: bool = False
    loads_in_flight: int = 0
    free_load_lanes: int = 0
    compute_seconds: list[float | None] = field(default_factory=list)
    load_seconds: list[float | None] = field(default_factory=list)
    #: when each load began (in flight or landed)
    load_started: list[float | None] = field(default_factory=list)
    now: float = 0.0  # seconds since the restore began, on the driver's clock (real or simulated)
    lanes: LaneTraits = field(default_factory=LaneTraits)
    running: RunningUnit = field(default_factory=RunningUnit)

    def __post_init__(self) -> None:
        n = len(self.chunk_tokens)
        if len(self.stored) != n:
            raise InvalidInputError("stored flags and chunks differ in length")
        self.status = self.status or [ChunkStatus.PENDING] * n
        self.compute_seconds = self.compute_seconds or [None] * n
        self.load_seconds = self.load_seconds or [None] * n
        self.load_started = self.load_started or [None] * n

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_tokens)

    def as_if(
        self, now: float | None = None, free_load_lanes: int | None = None, compute_busy: bool | None = None
    ) -> Progress:
        """A copy that shows the given observations instead of this progress's, for a question put to a
        policy (this progress does not change). Shallow: it shares the per-chunk lists, which a policy
        only reads."""
        view = object.__new__(Progress)  # a shallow copy without `__post_init__` (copy.copy is slower)
        view.__dict__.update(self.__dict__)
        if now is not None:
            view.now = now
        if free_load_lanes is not None:
            view.free_load_lanes = free_load_lanes
        if compute_busy is not None:
            view.compute_busy = compute_busy
        return view

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.status)

    def done_prefix(self) -> int:
        """Number of leading chunks already computed or loaded."""
        for i, s in enumerate(self.status):
            if not s.done:
                return i
        return self.n_chunks

    def pending(self) -> list[int]:
        return [i for i, s in enumerate(self.status) if s is ChunkStatus.PENDING]

    def computing(self) -> tuple[int, int] | None:
        """The chunks [a, b) of the compute unit running in place (None: none, or a race)."""
        if not self.compute_busy or self.running.racing is not None:
            return None
        ids = [i for i, s in enumerate(self.status) if s is ChunkStatus.COMPUTING]
        return (ids[0], ids[-1] + 1) if ids else None

    def compute_frontier(self) -> int:
        """The first chunk the compute lane has not reached: past the done prefix and any unit running."""
        i = self.done_prefix()
        while i < self.n_chunks and self.status[i] in (ChunkStatus.COMPUTING, ChunkStatus.COMPUTED):
            i += 1
        return i


@dataclass(frozen=True)
class Decision:
    """What to start now: one compute unit (a chunk range [a, b)) and loads of single chunks.

    `drop` names loads in flight to abandon, so that the compute unit can take their chunks (the
    engine waits for a dropped load to stop before the compute unit starts). `wake_at` asks to be
    asked again at that time (on the progress clock) even if no unit finishes before it.

    `race` (only where `LaneTraits.can_race`): the compute unit is one chunk that is also being fetched
    (already, or by this decision's `loads`); both run and the first to finish wins: a fetch that lands
    first stops the compute unit, whose KV is never written; a compute unit that ends first stops the
    fetch and writes its KV once the fetch can write no more. The chunk is applied once either way.

    `overtake` (only where `LaneTraits.can_overtake`): chunks of the compute unit running in place to
    fetch aside, into buffers of their own. Once every chunk of the unit has landed aside, the unit
    stops at its next layer boundary and the fetched chunks are written instead; a unit that finishes
    first keeps its KV and the fetched bytes are discarded. Each chunk is applied once either way.
    """

    compute: tuple[int, int] | None = None
    loads: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()
    wake_at: float | None = None
    race: bool = False
    overtake: tuple[int, ...] = ()


IDLE = Decision()


class Estimates(Protocol):
    """What a restore's observations imply about its lanes, as a policy reads it (made by
    `costs.estimates.Estimates` from a `Progress` and the cost model's priors, once per observation;
    see there for each rule). Units are the policy's own: chunks along tokens, layers along layers."""

    @property
    def prior_link(self) -> tuple[float, float] | None: ...

    @property
    def unit_fixed_s(self) -> float: ...

    def prior_compute_s(self, j: int) -> float | None: ...

    def floor_s(self, j: int) -> float | None: ...

    def compute_rate(self, a: int) -> float | None: ...

    def compute_at(self, j: int, rate: float | None) -> float | None: ...

    def compute_s(self, a: int) -> float | None: ...

    def link(self) -> tuple[float, float] | None: ...

    def guessed_s_per_token(self) -> float | None: ...

    def overdue(self) -> float | None: ...

    def arrival_rate(self) -> float | None: ...

    def sees_arrivals(self) -> bool: ...

    def landed_count(self) -> int: ...

    def landing(self, a: int, guess: bool = False) -> float | None: ...


class Policy(ABC):
    """Decides the next units of a restore from its progress."""

    name: str = "policy"
    #: what a unit is: a chunk of tokens ("tokens": `Progress.chunk_tokens` are the chunks' lengths) or
    #: a layer over the whole stored prefix ("layers": one entry per layer, each the prefix's length)
    axis: str = "tokens"

    @abstractmethod
    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        """Units to start now, from what the driver knows (`progress`) and what that implies about the
        lanes (`estimates`). Called whenever a lane is free and after every finished unit."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def next_compute_run(
    progress: Progress, max_chunks: int | None = None, stop_at_stored: bool = False
) -> tuple[int, int] | None:
    """The compute unit that can start now: pending chunks right after the done prefix.

    Computing chunk i needs the KV of every chunk before it, so a compute unit always starts at the end
    of the done prefix. The run extends over pending chunks, up to `max_chunks`, and (with
    `stop_at_stored`) stops before the first chunk that could be loaded instead.
    """
    if progress.compute_busy:
        return None
    a = progress.done_prefix()
    if a >= progress.n_chunks or progress.status[a] is not ChunkStatus.PENDING:
        return None
    b = a
    limit = progress.n_chunks if max_chunks is None else min(progress.n_chunks, a + max_chunks)
    while b < limit and progress.status[b] is ChunkStatus.PENDING:
        if stop_at_stored and b > a and progress.stored[b]:
            break
        b += 1
    return (a, b)
