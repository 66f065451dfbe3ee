"""Auto: the planner that picks how to restore a prompt (CacheFlow §3.1; Cake §5.4's fallback).

Before a restore, `Auto.plan` predicts how long each strategy would take on this machine, model and
store -- compute-only, load-only, the token-wise two-pointer and the layer-wise one -- by running the
very policy objects in the discrete-event simulator (`simulate`) against the measured cost model
(`profile.Profile`) and the live estimate of the store's link. It picks the fastest prediction, so:

* token-wise above the crossover length L_delta and layer-wise below it (CacheFlow: a short prompt has
  too few chunks to split, a long one has cheap early chunks that only the token axis exploits);
* one resource alone where using both would be slower (a store far faster than compute: load-only; a
  hopeless store: compute-only), which Cake leaves as future work.

The `Plan` keeps every prediction, the harmonic-mean bound T* = Tc * Tio / (Tc + Tio), the crossover
length and a sentence saying why, and comes back with the restore's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple

from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.errors import InvalidInputError
from kvrestore.costs.calibration import Calibration
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.estimates import Estimates, Priors
from kvrestore.costs.links import LinkCost
from kvrestore.costs.profile import Profile
from kvrestore.policies.base import Policy, Progress
from kvrestore.policies.compute_only import ComputeOnly
from kvrestore.policies.load_only import LoadOnly
from kvrestore.policies.meeting import LayerTwoPointer, TokenTwoPointer
from kvrestore.sim.simulate import simulate

#: the prompt lengths (tokens) searched for the crossover L_delta
L_DELTA_GRID = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


#: the strategies `Auto` predicts and chooses from, by name
PLANNED = ("compute-only", "load-only", "two-pointer", "layer-wise")


@dataclass(frozen=True)
class Workload:
    """What the planner needs to know about one restore."""

    chunk_tokens: tuple[int, ...]
    stored: tuple[bool, ...]
    num_layers: int
    kv_bytes_per_token: int
    load_lanes: int = 4
    #: the compute lane's floor on a token-wise unit (`LaneTraits.min_unit_chunks`)
    min_unit_chunks: int = 1

    @property
    def n_tokens(self) -> int:
        return sum(self.chunk_tokens)


#: `Plan.unknown`'s words for what a planner without a link estimate cannot predict
NO_LINK = "the store's speed is unknown: no load seen yet"
#: ... and without a cost model
NO_COMPUTE = "this machine's compute speed is unknown: no compute unit seen yet"
#: what the two-pointers assume while they are not predicted (the promise every strategy keeps)
ADAPTS = "it adapts to the speeds it meets, so about the better of computing and loading everything"


@dataclass(frozen=True)
class Plan:
    """The planner's choice for one restore, with what it predicted for every strategy, and what it
    could not predict and why (`unknown`). The words `explain` prints are defined in the glossary of
    docs/architecture.md."""

    choice: Policy
    predicted_s: dict[str, float] = field(default_factory=dict)  # by policy name
    compute_s: float | None = None  # Tc: compute-only
    load_s: float | None = None  # Tio: load-only
    bound_s: float | None = None  # T* = Tc Tio / (Tc + Tio)
    reason: str = ""
    crossover: Callable[[], int | None] | None = field(default=None, repr=False, compare=False)
    #: the factors (measured / predicted, learned from earlier restores) applied to `predicted_s`
    calibration: dict[str, float] = field(default_factory=dict)
    #: where the cost model came from: a measured profile, or what was learned and from how much
    costs: str = ""
    #: the strategies not predicted, by name: what the planner does not know yet to predict them
    unknown: dict[str, str] = field(default_factory=dict)
    #: bytes/s: the link speed at which loading the whole prompt takes as long as computing it (Tc)
    balance_bytes_per_s: float | None = None

    @cached_property
    def l_delta(self) -> int | None:
        """Tokens: the shortest fully stored prompt on which the token-wise two-pointer is predicted no
        slower than the layer-wise one, at this link (worked out when first asked: it takes a few
        dozen simulations, more than the plan itself)."""
        return self.crossover() if self.crossover is not None else None

    def explain(self) -> str:
        """A few lines a user can read: the choice and why, where the costs come from, each strategy's
        predicted time (or what is missing to predict it), the T* bound, the balance bandwidth and
        L_delta, where known."""
        lines = [f"chose {self.choice.name}: {self.reason}"]
        if self.costs:
            lines.append(f"  costs: {self.costs}")
        if self.predicted_s or self.unknown:
            lines.append("  predicted restore time of each strategy:")
        for name, s in sorted(self.predicted_s.items(), key=lambda kv: kv[1]):
            scaled = (
                f"  (x{self.calibration[name]:.2f} learned: its restores ran that much slower than the model)"
                if name in self.calibration
                else ""
            )
            lines.append(f"    {name:<14} {s:8.3f} s{scaled}{self._chosen(name)}")
        for name, why in self.unknown.items():
            lines.append(f"    {name:<14} {'?':>8}    not predicted: {why}{self._chosen(name)}")
        if self.bound_s is not None:
            lines.append(
                f"  T* bound {self.bound_s:.3f} s: no split of the work between computing (Tc {self.compute_s:.3f} s) "
                f"and loading (Tio {self.load_s:.3f} s) can be faster"
            )
        if self.balance_bytes_per_s is not None:
            lines.append(
                f"  balance bandwidth {self.balance_bytes_per_s / 1e6:.1f} MB/s: over a faster store, loading "
                "the whole prompt takes less time than computing it"
            )
        if self.l_delta is not None:
            lines.append(
                f"  L_delta {self.l_delta} tokens: from this prompt length on the token-wise two-pointer is "
                "predicted no slower than the layer-wise one, over this link"
            )
        return "\n".join(lines)

    def _chosen(self, name: str) -> str:
        return "  <- chosen" if name == self.choice.name else ""


class Auto:
    """Pick the restore strategy predicted fastest (see the module docstring).

    Pass it to `Restorer.restore` (it is the default there); the restorer plans with its cost model
    (a measured profile, or what it learned from its own saves and restores) and its link estimate,
    and runs the chosen policy. Until it has a cost model and a link estimate, it explores (`explore`).

    It is a planner, not a `Policy`: it plans a whole restore once, before it starts, and never decides
    a unit, so no engine or simulator can be handed something whose decisions raise.
    """

    name = "auto"
    axis = "plan"

    def __init__(self, candidates: Sequence[Policy] | None = None) -> None:
        if candidates is not None:
            if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
                raise InvalidInputError(
                    f"Auto's candidates must be a list of restore policies (or None), got {candidates!r}"
                )
            candidates = tuple(candidates)
            if not candidates:
                raise InvalidInputError(
                    "Auto's candidates is empty: give it policies to choose from, or None"
                )
            bad = [p for p in candidates if not isinstance(p, Policy) or isinstance(p, Auto)]
            if bad:
                raise InvalidInputError(f"Auto's candidates must be restore policies (not Auto), got {bad!r}")
        self.candidates = candidates

    def __repr__(self) -> str:
        return "Auto()"

    def plan(
        self,
        profile: Profile | None,
        link: LinkCost | None,
        work: Workload,
        calibration: Calibration | None = None,
        costs: str = "",
        untried_margin: float = 1.0,
    ) -> Plan:
        """Predict every candidate for `work` and pick the fastest. With a `calibration` (the restorer's
        record of how its restores compared with predictions) each prediction is scaled by its
        strategy's factor. `profile` is the cost model, measured (`kvrestore profile`) or learned
        (`costs.CostLearner`), `costs` a line saying which. Without a cost model or a link estimate it
        explores (`explore`). With `untried_margin` > 1 (a learned cost model, which has seen only the
        strategies it ran), a strategy never run is chosen over one that was only if it is predicted
        faster by that factor: its prediction has not been checked against a restore yet."""
        if not any(work.stored):
            return Plan(ComputeOnly(), reason="nothing of this prompt is stored", costs=costs)
        candidates = self.candidates or (ComputeOnly(), LoadOnly(), TokenTwoPointer(), LayerTwoPointer())
        if profile is None or link is None:
            return _exploring(candidates, profile, link, work, self.candidates, costs)
        factors = {p.name: calibration.factor(p.name) if calibration else 1.0 for p in candidates}
        predicted = {p.name: predict(p, profile, link, work) * factors[p.name] for p in candidates}
        choice = _choose(candidates, predicted, calibration, untried_margin)
        tc = predict(ComputeOnly(), profile, link, work)
        tio = predict(LoadOnly(), profile, link, _all_stored(work))

        def l_delta() -> int | None:
            return crossover_length(
                profile,
                link,
                work.num_layers,
                work.kv_bytes_per_token,
                work.load_lanes,
                max(work.chunk_tokens),
            )

        return Plan(
            choice=choice,
            predicted_s=predicted,
            compute_s=tc,
            load_s=tio,
            bound_s=tc * tio / (tc + tio),
            reason=_reason(choice, predicted),
            crossover=l_delta,
            calibration={k: v for k, v in factors.items() if v != 1.0},
            costs=costs,
            balance_bytes_per_s=work.n_tokens * work.kv_bytes_per_token / tc if tc > 0 else None,
        )


def _exploring(
    candidates: Sequence[Policy],
    profile: Profile | None,
    link: LinkCost | None,
    work: Workload,
    named: Sequence[Policy] | None,
    costs: str,
) -> Plan:
    """The plan of a planner that lacks a cost model or a link estimate: it explores (`explore`), and
    says what it could predict (compute-only with a cost model, which never reads the store; load-only
    of a fully stored prompt with a link, which computes nothing) and what it does not know yet to
    predict the rest (`Plan.unknown`)."""
    predicted: dict[str, float] = {}
    unknown: dict[str, str] = {}
    no_compute = NO_COMPUTE if profile is None else None
    no_link = NO_LINK if link is None else None
    tc = None if profile is None else predict(ComputeOnly(), profile, LinkCost(1.0), work)  # (no read)
    for p in candidates:
        if p.name == "compute-only":
            needs = [no_compute]
        elif p.name == "load-only":
            needs = [no_link, None if all(work.stored) else no_compute]
        else:
            needs = [no_compute, no_link]
        gaps = [m for m in needs if m]
        if not gaps and p.name == "compute-only" and tc is not None:
            predicted[p.name] = tc
        elif not gaps and p.name == "load-only" and link is not None:
            predicted[p.name] = predict(p, _NO_COMPUTE, link, work)
        else:
            adapts = p.name in ("two-pointer", "layer-wise")
            unknown[p.name] = "; ".join(gaps or ["not a strategy it predicts"]) + (
                f"; {ADAPTS}" if adapts else ""
            )
    missing = "compute unit" if profile is None else "load"
    choice = explore(work, named)
    adapts = choice.name in ("two-pointer", "layer-wise")
    runs = "a two-pointer, which adapts to the speeds it meets," if adapts else choice.name
    return Plan(
        choice,
        predicted_s=predicted,
        compute_s=tc,
        reason=f"exploring: no {missing} seen yet to predict with; it runs {runs} and learns the speeds "
        "from this restore",
        costs=costs,
        unknown=unknown,
        balance_bytes_per_s=work.n_tokens * work.kv_bytes_per_token / tc if tc else None,
    )


#: predictions this close to the fastest are ties (a simulated clock's difference of a fraction of a
#: percent is no reason to run a strategy that uses both lanes over one that uses one)
TIE = 1.01


def _choose(
    candidates: Sequence[Policy],
    predicted: dict[str, float],
    calibration: Calibration | None,
    untried_margin: float,
) -> Policy:
    """The fastest prediction; but while a strategy never run is predicted within `untried_margin` of it
    (a learned cost model has checked only the strategies it ran), that one, so each plausible strategy
    is tried once instead of the first explored being kept. Predictions within `TIE` of the fastest
    are ties, which go to the simpler strategy, listed first."""
    fastest = min(predicted[p.name] for p in candidates)
    tied = [p for p in candidates if predicted[p.name] <= fastest * TIE]
    ranked = tied + sorted((p for p in candidates if p not in tied), key=lambda p: predicted[p.name])
    best = predicted[ranked[0].name]
    tried = {name for name, n in (calibration.observations if calibration else {}).items() if n}
    if not tried:
        return ranked[0]
    plausible = [p for p in ranked if predicted[p.name] <= best * untried_margin]
    return next((p for p in plausible if p.name not in tried), ranked[0])


#: the longest stored prefix (tokens) that `explore` restores layer-wise: below CacheFlow's crossover
#: L_delta the layer-wise two-pointer is the faster one, and on this repository's CPU measurements it
#: stays within 1.12x of the best strategy up to 4,096 tokens (`benchmarks/planner.py`), where the
#: token-wise two-pointer is up to 5x slower on a one- or two-chunk prompt
EXPLORE_LAYERS_MAX_TOKENS = 4096


#: the fewest stored chunks that `explore` restores along tokens: with as many, fetches that overtake
#: the compute unit in flight keep the token-wise two-pointer near the better single strategy on a
#: fast store, and near compute-only on a slow one, and the chunks still let it split the prompt
EXPLORE_TOKENS_MIN_CHUNKS = 4


def explore(work: Workload, candidates: Sequence[Policy] | None = None) -> Policy:
    """The strategy to run while costs are unknown: a two-pointer (it adapts to the speeds it meets,
    and its trace teaches the cost model), along tokens when at least `EXPLORE_TOKENS_MIN_CHUNKS`
    chunks are stored, else along layers when the stored chunks are one prefix of at most
    `EXPLORE_LAYERS_MAX_TOKENS` tokens (too few chunks to split). Where the caller named the
    `candidates`, one of them: that strategy if listed, else the first."""
    k = work.stored.index(False) if False in work.stored else len(work.stored)
    prefix_only = not any(work.stored[k:])
    few = sum(work.stored) < EXPLORE_TOKENS_MIN_CHUNKS
    if few and prefix_only and sum(work.chunk_tokens[:k]) <= EXPLORE_LAYERS_MAX_TOKENS:
        choice: Policy = LayerTwoPointer()
    else:
        choice = TokenTwoPointer()
    if not candidates or any(p.name == choice.name for p in candidates):
        return next((p for p in candidates or () if p.name == choice.name), choice)
    return candidates[0]  # the caller's own strategies only


def predict(policy: Policy, profile: Profile | _Costs, link: LinkCost, work: Workload) -> float:
    """Seconds `policy` is predicted to take on `work`: the simulator, driven by the cost model."""
    if policy.axis == "layers":
        return _predict_layers(policy, profile, link, work)
    channel = Link(BandwidthTrace.constant(link.bytes_per_s), latency_s=link.latency_s)
    starts = [sum(work.chunk_tokens[:i]) for i in range(len(work.chunk_tokens))]

    def cost(a: int, b: int, _t: float) -> float:
        return profile.chunk.seconds(sum(work.chunk_tokens[a:b]), starts[a])

    chunk_bytes = [n * work.kv_bytes_per_token for n in work.chunk_tokens]
    result = simulate(
        policy,
        work.chunk_tokens,
        work.stored,
        cost,
        chunk_bytes,
        channel,
        work.load_lanes,
        min_unit_chunks=work.min_unit_chunks,
        priors=(
            [cost(i, i + 1, 0.0) if profile is not None else None for i in range(len(work.chunk_tokens))],
            (work.kv_bytes_per_token / link.bytes_per_s, link.latency_s),
        ),
        unit_fixed_s=profile.chunk.fixed_s if profile is not None else 0.0,
    )
    return result.makespan


def _predict_layers(policy: Policy, profile: Profile | _Costs, link: LinkCost, work: Workload) -> float:
    """The stored prefix by layers (one range read per chunk per layer), then the rest computed; or,
    where the policy would load every layer before computing one, whole chunks along tokens, as the
    restore then runs (`restore.layer_wise`)."""
    k = work.stored.index(False) if False in work.stored else len(work.stored)
    if k == 0:  # what the restorer does then: nothing to load along layers
        return predict(ComputeOnly(), profile, link, work)
    prefix, n, layers = sum(work.chunk_tokens[:k]), work.n_tokens, work.num_layers
    layer_s = profile.layer.seconds(prefix)
    layer_bytes = prefix * work.kv_bytes_per_token // layers
    # what the restore tells the policy before it starts (`Planner.layer_priors`)
    priors = Priors([layer_s] * layers, (work.kv_bytes_per_token / layers / link.bytes_per_s, link.latency_s))
    if k == len(work.stored) and loads_every_layer_first(policy, prefix, layers, work.load_lanes, priors):
        return predict(LoadOnly(), profile, link, work)
    result = simulate(
        policy,
        [prefix] * layers,
        [True] * layers,
        lambda a, b, _t: (b - a) * layer_s,
        [layer_bytes] * layers,
        Link(BandwidthTrace.constant(link.bytes_per_s), latency_s=link.latency_s),
        work.load_lanes,
        priors=(priors.compute_s, priors.link),
    )
    tail = profile.chunk.seconds(n - prefix, prefix) if n > prefix else 0.0
    # reading the chunks' headers first costs one round trip before the first layer arrives
    return result.makespan + tail + link.latency_s


def loads_every_layer_first(
    policy: Policy, prefix: int, num_layers: int, load_lanes: int, priors: Priors
) -> bool:
    """Whether a layer-axis `policy` over a stored prefix of `prefix` tokens, told `priors` (its
    layers' compute and the link per token of one layer), would start no layer's compute: its loads
    are predicted to land every layer first. A restore of a whole stored prompt then loads whole
    chunks along tokens instead (`restore.layer_wise`), and `predict` predicts it so."""
    if priors.link is None:  # nothing known of the link: a policy that starts no unit waits to see fetches
        return False
    asked = Progress([prefix] * num_layers, [True] * num_layers).as_if(free_load_lanes=load_lanes)
    return policy.decide(asked, Estimates(asked, priors)).compute is None


def crossover_length(
    profile: Profile,
    link: LinkCost,
    num_layers: int,
    kv_bytes_per_token: int,
    load_lanes: int = 4,
    chunk_size: int = 256,
) -> int | None:
    """L_delta: the shortest fully stored prompt on which the token-wise two-pointer is predicted no
    slower than the layer-wise one (CacheFlow's min{N | T_token(N) <= T_layer(N)}), None if none is."""
    costs = _Costs(profile.chunk, profile.layer)
    return _crossover(costs, link, num_layers, kv_bytes_per_token, load_lanes, chunk_size)


class _Costs(NamedTuple):
    """The part of a profile predictions use (hashable, for the cache below)."""

    chunk: ChunkCost
    layer: LayerCost


#: the compute costs of a prediction that computes nothing (load-only of a fully stored prompt)
_NO_COMPUTE = _Costs(ChunkCost(0.0, 0.0, 0.0), LayerCost(0.0, 0.0, 0.0))


@lru_cache(maxsize=256)
def _crossover(
    profile: _Costs,
    link: LinkCost,
    num_layers: int,
    kv_bytes_per_token: int,
    load_lanes: int,
    chunk_size: int,
) -> int | None:
    for n in L_DELTA_GRID:
        chunks = tuple([chunk_size] * (n // chunk_size) + ([n % chunk_size] if n % chunk_size else []))
        work = Workload(chunks, (True,) * len(chunks), num_layers, kv_bytes_per_token, load_lanes)
        if predict(TokenTwoPointer(), profile, link, work) <= predict(LayerTwoPointer(), profile, link, work):
            return n
    return None


def _all_stored(work: Workload) -> Workload:
    return dataclasses.replace(work, stored=(True,) * len(work.stored))


def _reason(choice: Policy, predicted: dict[str, float]) -> str:
    chosen = predicted[choice.name]
    fastest = min(predicted, key=lambda name: predicted[name])
    others = ", ".join(f"{name} {s:.3f} s" for name, s in predicted.items() if name != choice.name)
    why = {
        "two-pointer": "both resources, along tokens",
        "layer-wise": "both resources, along layers",
        "compute-only": "the store is too slow to help",
        "load-only": "the store alone is faster than sharing with compute",
    }.get(choice.name, "fastest prediction")
    if chosen > predicted[fastest] * TIE:
        why = f"tried once: never run here, and predicted close to the fastest, {fastest}"
    elif fastest != choice.name:
        why += f" (a tie with {fastest}, within {TIE - 1:.0%}: the simpler strategy)"
    return f"{why}: predicted {chosen:.3f} s against {others}"
