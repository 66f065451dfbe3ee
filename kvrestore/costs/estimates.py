"""What one restore's observations say of its link and its compute lane, worked out once per observation.

A policy decides from two things: what the driver knows (`Progress`: each unit's state, when its loads
began, how long its units took, the clock) and what those facts imply about the lanes: how fast the
link delivers, when a fetch in flight should land, how long computing the next unit should take. The
second part is here, so that every policy and the simulator share one estimate and none copies it.
The driver builds an `Estimates` after each observation (`runtime.driver`) and hands it to the policy
with the progress; a question put to a policy on other observations (`Progress.as_if`) gets its own.

Before a restore has observed anything, the estimates fall back on `Priors`: what the restorer's cost
model predicts (per-unit compute seconds, the link, a unit's fixed cost) and the compute floor (the
least computing a unit can take, `backends.floor`).

The rules, each next to the method that applies it:

* the link's rate comes from the gaps between the latest landings (`RECENT_LOADS` of them), not from
  one fetch's own time, which ignores the fetches beside it (`link`);
* a fetch in flight that has delivered nothing for a while bounds the link from below (`overdue`);
* before any fetch lands, bytes seen arriving give a rate (`arrival_rate`);
* fetches are served in the order they were issued, so a fetch lands once those before it and its own
  bytes have crossed (`landing`);
* computing costs grow with position: the nearest computed unit's time per token is the best guess for
  the next (`compute_rate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrestore.policies.base import ChunkStatus, Progress

#: how many of the most recent fetches estimate the link's delivery rate
RECENT_LOADS = 4


@dataclass(frozen=True)
class Priors:
    """What a restore is told before it observes anything (all optional).

    `compute_s`: seconds to compute each unit on top of the units before it (the cost model's);
    `link`: the store's link as (seconds per token delivered, seconds of latency per request);
    `unit_fixed_s`: the part of each unit's `compute_s` that a compute unit pays once however many units
    it covers (k units in one cost the sum of their priors less k - 1 times this);
    `floor_s`: seconds below which computing each unit cannot end (its matmul FLOPs at the device's
    measured rate, `backends.floor`)."""

    compute_s: Sequence[float | None] = ()
    link: tuple[float, float] | None = None
    unit_fixed_s: float = 0.0
    floor_s: Sequence[float | None] = ()


NO_PRIORS = Priors()


@dataclass
class Arrivals:
    """What the store had delivered at the first look, at the first look after it to see bytes arriving,
    and at the latest, as (seconds, tokens' worth of bytes the store's count then showed), counting the
    bytes of fetches still in flight: all `Estimates.arrival_rate` needs. Empty where the store sees a
    read's bytes only once it has finished (`ChunkStore.delivered_bytes`). The driver keeps one per
    restore and shows it each look before a decision."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    def see(self, now: float, delivered: float | None) -> None:
        """A look at `now` that showed `delivered` (None: the store cannot say)."""
        samples = self.samples
        if delivered is None or (samples and now <= samples[-1][0]):
            return
        if len(samples) == 3 or (len(samples) == 2 and samples[1][1] <= samples[0][1]):
            samples[-1] = (now, delivered)
        else:
            samples.append((now, delivered))


@dataclass
class Estimates:
    """The link and the compute lane as one restore's `progress` shows them now, on top of `priors`."""

    progress: Progress
    priors: Priors = NO_PRIORS
    #: the store's deliveries seen so far (`Arrivals.samples`)
    arrivals: Sequence[tuple[float, float]] = ()
    #: (end time, tokens) of the fetches that landed, oldest first
    landed: list[tuple[float, int]] = field(init=False)
    _link: tuple[float, float] | None = field(init=False)
    _overdue: float | None = field(init=False)

    def __post_init__(self) -> None:
        p = self.progress
        self.landed = sorted(
            (p.load_started[j] + p.load_seconds[j], p.chunk_tokens[j])  # type: ignore[operator]
            for j in range(p.n_chunks)
            if p.status[j] is ChunkStatus.LOADED
            and p.load_started[j] is not None
            and p.load_seconds[j] is not None
        )
        self._overdue = self._overdue_now()
        self._link = self._link_now()

    # -- priors ------------------------------------------------------------------------------------

    def prior_compute_s(self, j: int) -> float | None:
        """The cost model's seconds for unit j (None: not known)."""
        prior = self.priors.compute_s
        return prior[j] if j < len(prior) else None

    def floor_s(self, j: int) -> float | None:
        """The least computing unit j can take (None: not known)."""
        floor = self.priors.floor_s
        return floor[j] if j < len(floor) else None

    @property
    def prior_link(self) -> tuple[float, float] | None:
        return self.priors.link

    @property
    def unit_fixed_s(self) -> float:
        return self.priors.unit_fixed_s

    # -- the compute lane --------------------------------------------------------------------------

    def compute_rate(self, a: int) -> float | None:
        """Seconds per token of the latest unit computed before unit a (None: none yet)."""
        p = self.progress
        for j in range(a - 1, -1, -1):
            s = p.compute_seconds[j]
            if s is not None and p.status[j] is ChunkStatus.COMPUTED:
                return s / p.chunk_tokens[j]
        return None

    def compute_at(self, j: int, rate: float | None) -> float | None:
        """Seconds to compute unit j at `rate` (a `compute_rate`), else the cost model's prediction."""
        return rate * self.progress.chunk_tokens[j] if rate is not None else self.prior_compute_s(j)

    def compute_s(self, a: int) -> float | None:
        """Seconds to compute unit a: the latest computed unit's time per token (compute cost grows with
        position, so the nearest unit is the best guess; it also tracks the lane's current speed);
        before any, the cost model's prediction."""
        return self.compute_at(a, self.compute_rate(a))

    # -- the link ----------------------------------------------------------------------------------

    def link(self) -> tuple[float, float] | None:
        """(seconds per token delivered, latency): what this restore's loads show, else the cost
        model's, else, before any fetch has landed, the rate its bytes arrive at (`arrival_rate`); at
        least as slow as the wait for the fetch due next says (a link that has delivered nothing for a
        while is not the link it was)."""
        return self._link

    def _link_now(self) -> tuple[float, float] | None:
        prior = self.priors.link
        if prior is not None and len(self.landed) < 2:  # one fetch's own time ignores the other lanes
            link = prior
        elif self.landed:
            link = (self.load_s_per_token(), 0.0)  # type: ignore[assignment]
        else:
            arriving = self.arrival_rate()
            if arriving is None:
                return None
            link = (arriving, 0.0)
        overdue = self._overdue
        return link if overdue is None else (max(link[0], overdue), link[1])

    def landed_count(self) -> int:
        """How many of this restore's fetches have landed."""
        return len(self.landed)

    def guessed_s_per_token(self) -> float | None:
        """The link's seconds per token for a guess: `link`'s, else (nothing known of the link) twice
        what the fetch in flight issued first has taken so far without landing (the rate at which it
        would land right now is only a bound, which says nothing of a fetch that has not landed yet)."""
        link = self._link
        if link is not None:
            return link[0]
        return None if self._overdue is None else 2 * self._overdue

    def overdue(self) -> float | None:
        """Seconds per token the link takes at least: the fetch in flight issued first has delivered
        nothing since it began or since the latest landing (None: nothing in flight)."""
        return self._overdue

    def _overdue_now(self) -> float | None:
        p = self.progress
        flying = [
            j
            for j in range(p.n_chunks)
            if p.status[j] is ChunkStatus.LOADING and p.load_started[j] is not None
        ]
        if not flying:
            return None
        due = min(flying, key=lambda j: p.load_started[j])  # type: ignore[arg-type,return-value]
        started: float = p.load_started[due]  # type: ignore[assignment]
        since = max(self.landed[-1][0], started) if self.landed else started
        return (p.now - since) / p.chunk_tokens[due]

    def arrival_rate(self) -> float | None:
        """Seconds per token at which the store's bytes arrive (`Arrivals`), before any fetch
        has landed: from the first decision that saw bytes arriving to the latest (not from the
        restore's start, so that a request's latency is no part of the rate). None: fewer than two such
        looks."""
        samples = self.arrivals
        if len(samples) < 2:
            return None
        base = samples[0][1]
        first = next((k for k, (_, d) in enumerate(samples) if d > base), len(samples))
        if first >= len(samples) - 1:
            return None
        (t0, d0), (t1, d1) = samples[first], samples[-1]
        return (t1 - t0) / (d1 - d0) if d1 > d0 and t1 > t0 else None

    def sees_arrivals(self) -> bool:
        """Whether the store shows its bytes arriving (a look has counted them)."""
        return bool(self.arrivals)

    def load_s_per_token(self) -> float | None:
        """The link's recent delivery time per token: the gaps between the latest landings (or, with one
        landing so far, that fetch's own time)."""
        p = self.progress
        landed = self.landed[-RECENT_LOADS - 1 :]
        if not landed:
            return None
        if len(landed) >= 2 and landed[-1][0] > landed[0][0]:
            return (landed[-1][0] - landed[0][0]) / sum(tokens for _, tokens in landed[1:])
        j = max(
            (
                j
                for j in range(p.n_chunks)
                if p.status[j] is ChunkStatus.LOADED and p.load_seconds[j] is not None
            ),
            key=lambda j: p.load_started[j] + p.load_seconds[j],  # type: ignore[operator]
        )
        return p.load_seconds[j] / p.chunk_tokens[j]  # type: ignore[operator]

    def landing(self, a: int, guess: bool = False) -> float | None:
        """When the fetch of unit a should land, from the link's recent delivery rate.

        Fetches in flight are taken to be served in the order they were issued (a link's queue), so unit
        a lands once the fetches issued before it and its own bytes have crossed at the rate at which
        the latest fetches landed. Durations alone mislead: fetches issued together wait behind each
        other. With `guess`, the rate is `guessed_s_per_token`."""
        started = self.progress.load_started[a]
        per_token = self.guessed_s_per_token() if guess else self.load_s_per_token()
        if per_token is None or started is None:
            return None
        ahead = self.ahead_tokens(a) * per_token
        if not self.landed:
            return started + ahead
        return max(self.landed[-1][0], min(started, self.progress.now)) + ahead

    def ahead_tokens(self, a: int) -> int:
        """Tokens of the fetches in flight issued no later than unit a's, its own included."""
        p = self.progress
        started = p.load_started[a]
        return sum(
            p.chunk_tokens[j]
            for j in range(p.n_chunks)
            if p.status[j] is ChunkStatus.LOADING
            and p.load_started[j] is not None
            and (p.load_started[j], -j) <= (started, -a)
        )


__all__ = ["NO_PRIORS", "RECENT_LOADS", "Arrivals", "Estimates", "Priors"]
