"""Every model of a store's link, in one place.

* `LinkCost`: a read is a round trip of `latency_s`, then the bytes at `bytes_per_s` (what a profile
  measures, `fit_link` fits and the planner predicts with);
* `LinkEstimate`: a store's link as restores see it, starting from a profile's `LinkCost` and following
  the loads of each restore;
* `BandwidthTrace` and `Link` (defined in `kvrestore.core.bandwidth`, re-exported here): a link's rate
  over time and the first-come-first-served schedule it delivers requests in. They live in core/ because
  stores run them (`ThrottledStore` gives a store a reproducible speed) and stores sit below costs/.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.trace import Trace
from kvrestore.costs.fit import fit_nonnegative


class LinkCost(msgspec.Struct, frozen=True):
    """A store read: a round trip of `latency_s`, then the bytes at `bytes_per_s`."""

    bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def fit_link(samples: Sequence[Sequence[float]]) -> LinkCost:
    """Fit [bytes, seconds] samples to `LinkCost`."""
    latency, per_byte = fit_nonnegative([[1.0, b] for b, _ in samples], [s for _, s in samples])
    return LinkCost(1.0 / max(per_byte, 1e-15), latency)


def link_from_loads(samples: Sequence[Sequence[float]], latency_s: float = 0.0) -> LinkCost | None:
    """A link from [bytes, seconds] samples of whole loads (each a round trip per layer, so no
    latency term can be separated): their total rate, big loads weighing most. None without bytes."""
    nbytes = sum(b for b, _ in samples)
    secs = sum(s for _, s in samples)
    if nbytes <= 0 or secs <= 0:
        return None
    return LinkCost(nbytes / secs, latency_s)


#: a restore whose loads show the link more than this factor faster or slower than the estimate saw it
#: change speed (`LinkEstimate.observe`): a noisy link's restores stay well within it
CHANGE_FACTOR = 2.0


class LinkEstimate:
    """A store's link as restores see it: starts from a profile's, then follows the loads.

    After each restore, the bytes its loads brought over the time the load lanes were busy give the
    delivery rate. Loads that took within `CHANGE_FACTOR` of what the estimate predicts for them are
    noise: they move the estimate by `weight` (EWMA). Loads further off show a link that changed speed (another network path, a store
    under load, a throttle moved): the estimate is replaced by what the restore saw, not averaged with
    a speed the link no longer has (averaging halves a sixteen-fold error per restore, so the planner
    would judge by a wrong link for four restores), `changes` counts it, and the estimate stays
    `unconfirmed` until a later restore's loads agree with it (one restore whose loads were slowed by
    something else must not keep a planner from loading: `Planner.plan`). Without a starting link
    (no profile), the per-request latency is estimated from the loads too (`_fit_shared`).
    """

    def __init__(self, link: LinkCost | None = None, weight: float = 0.5) -> None:
        if not 0 < weight <= 1:
            raise InvalidInputError(f"weight must be in (0, 1], got {weight}")
        self.current = link
        self.weight = weight
        self.observations = 0  # restores whose fetches showed the link (loads that landed, or a bound)
        self.changes = 0  # restores whose loads showed the link change speed
        #: the latest restore that loaded showed a change, which no restore since has confirmed
        self.unconfirmed = False
        self.measured_latency = link is not None  # a profile measured it: keep it
        self._afresh = False

    @property
    def doubted(self) -> bool:
        """Whether the estimate is a hint no restore has confirmed yet: read from a file (`reprobe`),
        or a change one restore showed (`unconfirmed`)."""
        return self._afresh or self.unconfirmed

    def reprobe(self) -> None:
        """Judge the link again from the next restore's loads alone: they replace the estimate (both
        its rate and its latency) instead of moving it, so no starting value, however wrong, outlives
        one restore that loads (one off by more than `CHANGE_FACTOR` counts as a change)."""
        self._afresh = True

    def observe(self, trace: Trace) -> bool:
        """Move the estimate toward what `trace`'s loads show; whether there were loads to learn from."""
        loads = [e for e in trace.events if e.kind in ("load", "aside") and e.nbytes > 0]
        busy = _busy_seconds([(e.start_s, e.end_s) for e in loads])
        if not loads or busy <= 0:
            return False
        previous = self.current
        if self._afresh:
            self.current, self.measured_latency, self._afresh = None, False, False
        latency = self.current.latency_s if self.current is not None else 0.0
        fitted = None if self.measured_latency else _fit_shared(loads)
        if fitted is not None:  # loads of different sizes (or sharing the link differently): both terms
            rate, seen = fitted.bytes_per_s, fitted.latency_s
            latency = seen if self.current is None else (1 - self.weight) * latency + self.weight * seen
        else:
            # the busy time starts with one round trip before the first bytes move (more lanes overlap
            # the later ones): the rest is the link's delivery time
            rate = sum(e.nbytes for e in loads) / max(busy - latency, busy / 2)
        changed = previous is not None and not _agrees(previous, sum(e.nbytes for e in loads), busy)
        if self.current is None:
            self.current = LinkCost(rate, latency)
        elif changed:
            self.current = LinkCost(rate, fitted.latency_s if fitted is not None else latency)
        else:
            mixed = (1 - self.weight) * self.current.bytes_per_s + self.weight * rate
            self.current = LinkCost(mixed, latency)
        self.changes += changed
        self.unconfirmed = changed
        self.observations += 1
        return True

    def at_most(self, bytes_per_s: float) -> bool:
        """A restore none of whose fetches landed showed the link delivers at most `bytes_per_s` (its
        fetches were in flight that long without landing): an observation of the link, if there is an
        estimate to set it against (whether there was). Where the estimate is more than `CHANGE_FACTOR`
        faster, the link changed speed, and the bound replaces it: the fastest the link can be, so a
        plan made with it errs only towards loading, which a two-pointer corrects as it goes, and the
        link is measured again by the next restore's fetches (or their absence). A bound leaves no
        doubt to confirm (`unconfirmed`): that the link may be slower still never makes loading
        better."""
        if self.current is None:
            return False
        if self.current.bytes_per_s > CHANGE_FACTOR * bytes_per_s:
            self.current = LinkCost(bytes_per_s, self.current.latency_s)
            self.changes += 1
            self._afresh = False  # the hint read from a file is gone: replaced by what was seen here
        self.unconfirmed = False
        self.observations += 1
        return True


def _agrees(link: LinkCost, nbytes: int, busy_s: float) -> bool:
    """Whether loads of `nbytes` that kept the link busy `busy_s` took within `CHANGE_FACTOR` of what
    `link` predicts for them (a round trip, then the bytes at its rate). The time is compared, not the
    rate: a few loads split a link's time between its round trip and its rate unsteadily (the same
    loads fit 70 MB/s and no latency, or 215 MB/s and 14 ms), while what they took is what a plan
    predicts with."""
    return 1 / CHANGE_FACTOR <= busy_s / link.seconds(nbytes) <= CHANGE_FACTOR


def _fit_shared(loads: Sequence[Any]) -> LinkCost | None:
    """The link from loads that share it: a load's time is a round trip plus its bytes times the
    number of loads in flight at its midpoint, over the link's rate (`fit_link`). None when the loads
    do not differ enough (a fifth, in bytes times sharing) to tell the round trip from the rate."""
    spans = [(e.start_s, e.end_s) for e in loads]
    samples = []
    for e in loads:
        mid = (e.start_s + e.end_s) / 2
        sharing = sum(1 for a, b in spans if a <= mid < b)
        samples.append([e.nbytes * max(1, sharing), e.end_s - e.start_s])
    sizes = [x for x, _ in samples]
    if len(samples) < 3 or max(sizes) < 1.2 * min(sizes):
        return None
    link = fit_link(samples)
    return link if math.isfinite(link.bytes_per_s) and link.bytes_per_s < 1e14 else None


def _busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


__all__ = ["CHANGE_FACTOR", "BandwidthTrace", "Link", "LinkCost", "LinkEstimate", "fit_link"]
