"""A link's bandwidth over time and the order it delivers requests in: one model, two clocks.

`ThrottledStore` runs it against the real clock to give a store a reproducible speed (how the Cake paper
controlled I/O, §5.1 and §5.7); the simulator runs the same model against a simulated clock. A request
waits `latency_s` (a round trip, overlapping other requests), then its bytes cross the link after every
byte already queued (first come, first served, so the link's total rate is the trace's whatever the
number of concurrent requests).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrestore.core.errors import InvalidInputError


@dataclass(frozen=True)
class BandwidthTrace:
    """Bytes per second as a step function of time: `steps[i] = (t_i, rate_i)` holds from t_i to t_{i+1}.

    Times are seconds from the link's start (the first at 0, increasing); the last rate holds forever and
    must be positive, earlier rates may be 0 (a link that stalls).
    """

    steps: tuple[tuple[float, float], ...]
    _times: list[float] = field(init=False, repr=False, compare=False)  # the step times, for bisect

    def __post_init__(self) -> None:
        steps = tuple((float(t), float(r)) for t, r in self.steps)
        if not steps or steps[0][0] != 0.0:
            raise InvalidInputError("a bandwidth trace starts with a step at time 0")
        if any(b[0] <= a[0] for a, b in zip(steps, steps[1:], strict=False)):
            raise InvalidInputError("bandwidth trace times must increase")
        if any(not math.isfinite(r) or r < 0 for _, r in steps) or steps[-1][1] <= 0:
            raise InvalidInputError("bandwidth rates must be finite and >= 0, and the last one > 0")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "_times", [t for t, _ in steps])

    @classmethod
    def constant(cls, bytes_per_s: float) -> BandwidthTrace:
        return cls(((0.0, bytes_per_s),))

    @classmethod
    def random(
        cls, low: float, high: float, step_s: float, duration_s: float, seed: int = 0
    ) -> BandwidthTrace:
        """Rates drawn uniformly from [low, high] every `step_s` for `duration_s` (Cake §5.7), then `high`."""
        if not 0 <= low <= high or high <= 0 or step_s <= 0:
            raise InvalidInputError("need 0 <= low <= high, high > 0 and step_s > 0")
        rng = random.Random(seed)
        n = max(1, math.ceil(duration_s / step_s))
        return cls(tuple((i * step_s, rng.uniform(low, high)) for i in range(n)) + ((n * step_s, high),))

    def scaled(self, factor: float) -> BandwidthTrace:
        return BandwidthTrace(tuple((t, r * factor) for t, r in self.steps))

    def rate_at(self, t: float) -> float:
        return self.steps[max(0, bisect.bisect_right(self._times, t) - 1)][1]

    def bytes_between(self, t0: float, t1: float) -> float:
        """Bytes the link can carry in [t0, t1]."""
        total = 0.0
        i = max(0, bisect.bisect_right(self._times, t0) - 1)
        t = t0
        while t < t1:
            end = self.steps[i + 1][0] if i + 1 < len(self.steps) else math.inf
            seg_end = min(end, t1)
            total += (seg_end - t) * self.steps[i][1]
            t, i = seg_end, i + 1
        return total

    def finish_time(self, start: float, nbytes: float) -> float:
        """When `nbytes` sent from `start` have all arrived."""
        if nbytes <= 0:
            return start
        i = max(0, bisect.bisect_right(self._times, start) - 1)
        t, left = start, float(nbytes)
        while True:
            rate = self.steps[i][1]
            end = self.steps[i + 1][0] if i + 1 < len(self.steps) else math.inf
            if rate > 0 and t + left / rate <= end:
                return t + left / rate
            left -= (end - t) * rate
            t, i = end, i + 1


class Link:
    """The delivery schedule of one shared link: first come, first served, after a per-request latency.

    `reserve(now, nbytes)` books a transfer and returns when it completes; times are seconds on the
    caller's clock, with 0 the moment the trace starts (see `ThrottledStore.reset`).
    """

    def __init__(self, trace: BandwidthTrace, latency_s: float = 0.0) -> None:
        if latency_s < 0:
            raise InvalidInputError(f"latency_s must be >= 0, got {latency_s}")
        self.trace = trace
        self.latency_s = latency_s
        self.free_at = 0.0
        self.bytes_sent = 0
        self._crossing: deque[tuple[float, float, int]] = deque()  # (start, end, bytes) not all across
        self._landed = 0  # bytes of the transfers that have crossed

    def reserve(self, now: float, nbytes: int) -> float:
        start = max(now + self.latency_s, self.free_at)
        self.free_at = self.trace.finish_time(start, nbytes)
        self.bytes_sent += nbytes
        if nbytes > 0:
            self._crossing.append((start, self.free_at, nbytes))
        return self.free_at

    def delivered(self, now: float) -> float:
        """Bytes that have crossed the link by `now`, of every transfer booked so far (part of the one
        crossing it now): what a reader watching its bytes arrive would have counted."""
        while self._crossing and self._crossing[0][1] <= now:  # transfers cross one after another
            self._landed += self._crossing.popleft()[2]
        if not self._crossing or self._crossing[0][0] >= now:
            return float(self._landed)
        start, _, nbytes = self._crossing[0]
        return self._landed + min(float(nbytes), self.trace.bytes_between(start, now))

    def reset(self) -> None:
        self.free_at = 0.0
        self.bytes_sent = 0
        self._crossing.clear()
        self._landed = 0


def trace_suffix_times(
    chunk_bytes: Sequence[int], trace: BandwidthTrace, latency_s: float = 0.0
) -> list[float]:
    """`out[k]` = when chunks k.. have all arrived over a link with this trace, sent back to back from 0."""
    total = 0
    out = [0.0] * (len(chunk_bytes) + 1)
    for k in range(len(chunk_bytes) - 1, -1, -1):
        total += chunk_bytes[k]
        out[k] = trace.finish_time(latency_s, total)
    return out


def oracle_split(compute_s: Sequence[float], load_suffix_s: Sequence[float]) -> tuple[float, int]:
    """The best two-pointer split for known costs: min over k of max(compute of chunks < k, time to load
    chunks >= k), and that k (chunks before it computed, the rest loaded).

    `load_suffix_s[k]` is the time to load chunks k.. (`suffix_times`, `trace_suffix_times`).
    """
    n = len(compute_s)
    if len(load_suffix_s) != n + 1:
        raise InvalidInputError("load_suffix_s needs one entry per split point (chunks + 1)")
    best, best_k = math.inf, 0
    computed = 0.0
    for k in range(n + 1):
        t = max(computed, load_suffix_s[k])
        if t < best:
            best, best_k = t, k
        if k < n:
            computed += compute_s[k]
    return best, best_k
