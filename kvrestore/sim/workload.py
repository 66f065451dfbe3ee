"""Seeded request workloads for a serving process: what a batch-aware restore scheduler is fed.

A serving process sees three kinds of work at once (Cake §5.8, CacheFlow §3.3):

* ``"restore"``: a request whose long prefix (earlier turns, a document) is in the store; its KV is
  restored (``prefix_tokens``), then a short new part (``new_tokens``, the new question) is computed.
* ``"prefill"``: a short prompt with nothing cached: ``prefix_tokens == 0``, ``new_tokens`` computed.
* ``"decode"``: one decode step of a request already running: ``new_tokens == 1`` on top of a context of
  ``prefix_tokens`` that is already in memory (it costs attention over that context, but no restore).

Cake's adaptive-scheduling experiment sends one long prefix-caching request and then a burst of 22
short uncached requests (32-448 tokens); CacheFlow schedules a batch of requests whose prefixes to
restore span short system prompts to long conversations. `poisson` gives steady traffic, `burst` many
requests at one moment, `mix` merges workloads into one arrival-ordered list:

    >>> w = mix([Request(0.0, "restore", 8192, 32)], burst(22, at_s=0.01, seed=1), poisson(5.0, 10.0, seed=2))

Lengths. Prefixes to restore follow a log-normal distribution truncated to [256, 8192] tokens
(`LogNormalLengths`, median 1024, sigma 0.9): most prefixes are a few turns long, and a long tail reaches
the bound (about 1 in 9 is above 3000 tokens; the mean is about 1500). Conversation and context lengths in chat traces are
long-tailed in this way; the parameters are a choice, not a fit to a data set, so pass your own. It is
sampled by inverting the truncated CDF, one uniform draw per length, so a sample never loops. Short
uncached prompts are uniform in Cake's 32-448 tokens, new questions of restore requests uniform in 16-64.

Reproducibility: every generator takes a `seed` (a non-negative int) and draws only from its own
``random.Random(seed)``; no global random state is read or changed. Negative seeds are refused because
``random.Random`` seeds with the absolute value of an int, so -1 and 1 would give the same workload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Literal, Protocol

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.settings import check_choice, check_int, check_number

Kind = Literal["restore", "prefill", "decode"]
KINDS: tuple[Kind, ...] = ("restore", "prefill", "decode")

#: a mixed serving load: mostly decode steps, some short uncached prompts, some long cached restores
DEFAULT_WEIGHTS: Mapping[Kind, float] = {"restore": 0.2, "prefill": 0.3, "decode": 0.5}
#: Cake §5.8's burst: short uncached requests and decode steps from other users
BURST_WEIGHTS: Mapping[Kind, float] = {"prefill": 0.5, "decode": 0.5}

#: refuse workloads whose expected size would not fit in memory comfortably
MAX_EXPECTED_REQUESTS = 10_000_000

_STANDARD_NORMAL = NormalDist()


@dataclass(frozen=True)
class Request:
    """One request of a workload; see the module docstring for what each kind's token counts mean."""

    arrival_s: float
    kind: Kind
    prefix_tokens: int
    new_tokens: int
    id: int = 0

    def __post_init__(self) -> None:
        check_number("arrival_s", self.arrival_s, 0, finite=True)
        check_choice("kind", self.kind, KINDS)
        check_int("prefix_tokens", self.prefix_tokens, 0)
        check_int("new_tokens", self.new_tokens, 1)
        check_int("id", self.id, 0)
        if self.kind == "restore" and self.prefix_tokens == 0:
            raise InvalidInputError("a restore request needs a cached prefix: prefix_tokens must be > 0")
        if self.kind == "prefill" and self.prefix_tokens != 0:
            raise InvalidInputError(
                f"a prefill request has nothing cached: prefix_tokens must be 0, got {self.prefix_tokens}"
            )
        if self.kind == "decode" and self.new_tokens != 1:
            raise InvalidInputError(
                f"a decode step computes one token: new_tokens must be 1, got {self.new_tokens}"
            )

    @property
    def restore_tokens(self) -> int:
        """Tokens whose KV must be restored from the store before this request runs."""
        return self.prefix_tokens if self.kind == "restore" else 0


class Lengths(Protocol):
    """A distribution of token counts."""

    @property
    def low(self) -> int: ...

    @property
    def high(self) -> int: ...

    def sample(self, rng: random.Random) -> int: ...


@dataclass(frozen=True)
class UniformLengths:
    """Token counts uniform over the integers in [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class LogNormalLengths:
    """A log-normal with the given median and sigma (of the log), truncated to [low, high].

    Sampled by inverting the truncated CDF: u uniform between the CDF at low and at high, length =
    exp(log(median) + sigma * Phi^-1(u)), rounded and clamped. One draw per sample, never a rejection loop.
    """

    median: float = 1024.0
    sigma: float = 0.9
    low: int = 256
    high: int = 8192

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high)
        check_number("median", self.median, positive=True, finite=True)
        check_number("sigma", self.sigma, positive=True, finite=True)

    def _cdf_bounds(self) -> tuple[float, float]:
        mu = math.log(self.median)
        return (
            _STANDARD_NORMAL.cdf((math.log(self.low) - mu) / self.sigma),
            _STANDARD_NORMAL.cdf((math.log(self.high) - mu) / self.sigma),
        )

    def quantile(self, q: float) -> float:
        """The q-quantile of the truncated distribution (before rounding)."""
        if not 0.0 <= q <= 1.0:
            raise InvalidInputError(f"q must be in [0, 1], got {q!r}")
        lo, hi = self._cdf_bounds()
        u = lo + q * (hi - lo)
        if u <= 0.0 or u >= 1.0:  # the bounds sit so far out in a tail that the CDF saturates
            return float(self.low if u <= 0.0 else self.high)
        x = math.exp(math.log(self.median) + self.sigma * _STANDARD_NORMAL.inv_cdf(u))
        return min(max(x, float(self.low)), float(self.high))

    def sample(self, rng: random.Random) -> int:
        return min(max(round(self.quantile(rng.random())), self.low), self.high)


@dataclass(frozen=True)
class Shapes:
    """The token-count distributions of each kind of request."""

    restore_prefix: Lengths = field(default_factory=LogNormalLengths)
    restore_new: Lengths = field(default_factory=lambda: UniformLengths(16, 64))
    prefill_new: Lengths = field(default_factory=lambda: UniformLengths(32, 448))
    decode_context: Lengths = field(default_factory=LogNormalLengths)

    def draw(self, kind: Kind, rng: random.Random) -> tuple[int, int]:
        """(prefix_tokens, new_tokens) of one request of this kind."""
        if kind == "restore":
            return self.restore_prefix.sample(rng), self.restore_new.sample(rng)
        if kind == "prefill":
            return 0, self.prefill_new.sample(rng)
        return self.decode_context.sample(rng), 1


def poisson(
    rate_per_s: float,
    duration_s: float,
    *,
    seed: int = 0,
    start_s: float = 0.0,
    weights: Mapping[Kind, float] = DEFAULT_WEIGHTS,
    shapes: Shapes | None = None,
) -> list[Request]:
    """Requests arriving as a Poisson process of `rate_per_s` over [start_s, start_s + duration_s).

    Inter-arrival times are exponential with mean 1 / rate; each request's kind is drawn with `weights`
    (relative, need not sum to 1) and its lengths from `shapes`. Ids are 0, 1, ... in arrival order.
    """
    check_number("rate_per_s", rate_per_s, positive=True, finite=True)
    check_number("duration_s", duration_s, 0, finite=True)
    check_number("start_s", start_s, 0, finite=True)
    if rate_per_s * duration_s > MAX_EXPECTED_REQUESTS:
        raise InvalidInputError(
            f"rate_per_s * duration_s = {rate_per_s * duration_s:.3g} expected requests, more than "
            f"{MAX_EXPECTED_REQUESTS}"
        )
    rng = _rng(seed)
    kinds, cum = _kind_table(weights)
    shapes = shapes or Shapes()
    end = start_s + duration_s
    requests: list[Request] = []
    t = start_s + rng.expovariate(rate_per_s)
    while t < end:
        requests.append(_request(t, kinds, cum, shapes, rng, len(requests)))
        t += rng.expovariate(rate_per_s)
    return requests


def burst(
    n: int,
    at_s: float = 0.0,
    *,
    seed: int = 0,
    spread_s: float = 0.0,
    weights: Mapping[Kind, float] = BURST_WEIGHTS,
    shapes: Shapes | None = None,
) -> list[Request]:
    """`n` requests arriving together at `at_s` (or uniformly within [at_s, at_s + spread_s]).

    By default a Cake-style burst: short uncached prompts and decode steps from other users; pass
    `weights` to put cached restores in it too. Ids are 0, 1, ... in arrival order.
    """
    check_int("n", n, 0)
    check_number("at_s", at_s, 0, finite=True)
    check_number("spread_s", spread_s, 0, finite=True)
    if n > MAX_EXPECTED_REQUESTS:
        raise InvalidInputError(f"n = {n} requests, more than {MAX_EXPECTED_REQUESTS}")
    rng = _rng(seed)
    kinds, cum = _kind_table(weights)
    shapes = shapes or Shapes()
    times = sorted(at_s + rng.uniform(0.0, spread_s) if spread_s else at_s for _ in range(n))
    return [_request(t, kinds, cum, shapes, rng, i) for i, t in enumerate(times)]


def mix(*workloads: Iterable[Request]) -> list[Request]:
    """Merge workloads into one list ordered by arrival, with fresh ids 0, 1, ...

    Ties keep the order of the arguments (then each workload's own order), so merging is deterministic.
    Ids are renumbered because each generator numbers its requests from 0.
    """
    tagged = []
    for w, workload in enumerate(workloads):
        if isinstance(workload, Request):
            raise InvalidInputError(
                "mix takes workloads (iterables of Request); wrap a single request in a list"
            )
        for i, request in enumerate(workload):
            if not isinstance(request, Request):
                raise InvalidInputError(f"workload {w} holds {type(request).__name__}, not Request")
            tagged.append((request.arrival_s, w, i, request))
    tagged.sort(key=lambda item: item[:3])
    return [replace(request, id=new_id) for new_id, (*_, request) in enumerate(tagged)]


# -- helpers ---------------------------------------------------------------------------------------


def _request(
    t: float, kinds: tuple[Kind, ...], cum: list[float], shapes: Shapes, rng: random.Random, i: int
) -> Request:
    kind = rng.choices(kinds, cum_weights=cum)[0]
    prefix, new = shapes.draw(kind, rng)
    return Request(t, kind, prefix, new, i)


def _rng(seed: int) -> random.Random:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidInputError(
            f"seed must be an int >= 0, got {seed!r} (random.Random treats -s and s as the same seed)"
        )
    return random.Random(seed)


def _kind_table(weights: Mapping[Kind, float]) -> tuple[tuple[Kind, ...], list[float]]:
    """Kinds with a positive weight and their cumulative weights, for `random.choices`."""
    if not isinstance(weights, Mapping) or not weights:
        raise InvalidInputError(f"weights must be a non-empty mapping of kind to weight, got {weights!r}")
    unknown = [k for k in weights if k not in KINDS]
    if unknown:
        raise InvalidInputError(f"unknown kinds in weights: {unknown}; kinds are {KINDS}")
    for kind, w in weights.items():
        check_number(f"weight of {kind!r}", w, 0, finite=True)
    kinds = tuple(k for k in KINDS if weights.get(k, 0) > 0)
    if not kinds:
        raise InvalidInputError("weights must give at least one kind a positive weight")
    cum, total = [], 0.0
    for k in kinds:
        total += float(weights[k])
        cum.append(total)
    return kinds, cum


def _check_bounds(low: int, high: int) -> None:
    check_int("low", low, 1)
    check_int("high", high, 1)
    if low > high:
        raise InvalidInputError(f"low must be <= high, got low={low}, high={high}")


__all__ = [
    "BURST_WEIGHTS",
    "DEFAULT_WEIGHTS",
    "KINDS",
    "Kind",
    "Lengths",
    "LogNormalLengths",
    "Request",
    "Shapes",
    "UniformLengths",
    "burst",
    "mix",
    "poisson",
]
