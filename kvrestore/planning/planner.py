"""The restorer's planner: the cost model it predicts with, what `Auto` chooses, and what it learns.

One object keeps everything a restorer knows about costs -- a measured `Profile` (or None), the costs
it learned from its own saves and restores (`CostLearner`), the live estimate of the store's link and
the calibration of predictions against measured restores -- so the facade only asks it to plan, feeds
it each restore's trace, and lets it persist what it learned.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Literal, NamedTuple

import anyio.to_thread
import torch

from kvrestore.backends.base import ComputeBackend
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.settings import check_path
from kvrestore.core.spec import dtype_name
from kvrestore.core.trace import Trace
from kvrestore.costs.calibration import Calibration
from kvrestore.costs.learned import CostLearner, check_learn, learned_path
from kvrestore.costs.links import LinkEstimate
from kvrestore.costs.profile import Profile, profile_problem
from kvrestore.planning.auto import PLANNED, Auto, Plan, Workload, explore, predict
from kvrestore.policies import ComputeOnly, Policy
from kvrestore.runtime.engine import Engine

log = logging.getLogger("kvrestore.planning")

#: On a GPU a compute unit smaller than this is launch-bound: measured on an H100 with Llama-3.1-8B's
#: shape, a 256-token unit costs about 1.1 ms of kernel launches per layer for 0.28 ms of work, while from
#: about 1,024-2,048 tokens the work hides the launches (`benchmarks/gpu_restore.py --compute-chunks`).
#: On a CPU the work always dominates, so units stay as small as the policy likes.
CUDA_MIN_UNIT_TOKENS = 2048

#: with learned costs, how much faster a strategy never run must be predicted than one that was run,
#: to be chosen over it (`Auto.plan`): learned from one strategy's restores, the others' predictions
#: are extrapolations
UNTRIED_MARGIN = 1.15

#: a link judged only from what was read from a file, or not checked by a load for this many restores,
#: is probed again by the next restore that `Auto` would compute whole although chunks are stored
#: (see `Planner.plan`)
PROBE_EVERY = 16

#: restores of one strategy kept unsettled (`Planner.calibration`): an older one would weigh 2 ** -64 of
#: the calibration (`Calibration.weight` 0.5), nothing a double holds, so it is only counted
UNSETTLED = 64

#: a compute unit's fixed cost (launches, per-call work) may be at most this share of its time
LAUNCH_SHARE = 0.25
#: the largest unit the cost model may ask for on its own
MAX_MIN_UNIT_TOKENS = 4096

ProfileArg = Profile | str | os.PathLike | Literal[False] | None


def find_profile(backend: ComputeBackend, profile: ProfileArg) -> Profile | None:
    """The measured profile to plan with: False for none, None for the one `kvrestore profile` saved
    for this machine and model (if any), else the given one (or a path to it), which must match."""
    spec = backend.spec
    if profile is False:  # none, even if one is saved: the costs are learned
        return None
    if profile is None:
        return Profile.find(spec, backend.device)
    if not isinstance(profile, Profile):
        if not isinstance(profile, (str, os.PathLike)):
            raise InvalidInputError(f"profile must be a Profile, a path, None or False, got {profile!r}")
        profile = Profile.load(check_path("profile", profile))
    problem = profile_problem(profile)
    if problem is not None:
        raise InvalidInputError(f"the profile holds a value no machine has: {problem}")
    if not profile.matches(spec, backend.device):
        raise InvalidInputError(
            f"the profile is of {profile.model} ({profile.dtype}, {profile.device}), not of "
            f"{spec.name} ({dtype_name(spec.dtype)}, {torch.device(backend.device).type})"
        )
    return profile


class Yardstick(NamedTuple):
    """How a restore is judged after it ran (`Planner.judged`, `Planner.calibrate`)."""

    counted: bool  # a run of its strategy (`Calibration.observations`: the strategy was tried)
    compared: bool  # also set against the cost model's prediction for it (`Calibration` factors)


class Planner:
    """Plans a restorer's restores and learns their costs (see the module docstring).

    `store_name` names the store in the learned costs; `learn` is True (keep them under the cache
    directory), a path, or False (in memory only), as `Restorer` takes it. `stored_bytes_per_token` is
    what a token's KV takes in the store (its chunks' encoding; default the model's KV bytes): the
    loads it plans and simulates move that much.
    """

    def __init__(
        self,
        backend: ComputeBackend,
        engine: Engine,
        chunk_size: int,
        store_name: str,
        profile: ProfileArg = None,
        learn: bool | str | os.PathLike = True,
        stored_bytes_per_token: int | None = None,
    ) -> None:
        self.backend, self.engine, self.chunk_size = backend, engine, chunk_size
        spec = backend.spec
        self.stored_bytes_per_token = stored_bytes_per_token or spec.kv_bytes_per_token
        self.profile = find_profile(backend, profile)
        learn = check_learn(learn)
        self.learned_at: Path | None = (
            learned_path(spec, backend.device, store_name) if learn is True else learn or None
        )
        self.costs = CostLearner(spec, backend.device, store_name, self.learned_at)
        start = self.profile.link if self.profile is not None else None
        self.link = LinkEstimate(start or self.costs.state.link)
        self.link.measured_latency = start is not None  # else it goes on estimating it from the loads
        if start is None and self.costs.state.link is not None:
            self.link.reprobe()  # a link read from a file is a hint: the first loads here replace it
        self._calibration = Calibration()  # how this restorer's restores compare with predictions
        self._calibration.resume(self.costs.state.calibration, self.costs.state.calibrated)
        #: per strategy, its last `UNSETTLED` restores not set against their predictions: (prediction, seconds)
        self._unsettled: dict[str, list[tuple[Callable[[], float], float]]] = {}
        self._unprobed = 0  # restores since the link was last measured by loads
        self._probe: Plan | None = None  # the last plan that probes the link
        self._probing = False  # the restore running now probes it: its loads replace the estimate
        #: the restore running now showed the link change speed: it ran on a link that was not there (its
        #: plan and its policy's link prior), so its time is set against no prediction (`calibrate`)
        self._misled = False
        #: seconds per token of compute, from the units fetches overtook (`_learn_overtaken`): a hint
        #: for the two-pointers' priors only, while the cost model has seen no unit run to its end
        self.overtaken_s_per_token: float | None = None
        #: seconds per token the link took at least, from a restore none of whose fetches landed
        #: (`_learn_silent`): the two-pointers' link prior while no load has measured the link
        self.silent_s_per_token: float | None = None
        floor = self._floor()
        if floor is not None:  # measured once per backend, here rather than inside a first restore
            floor(1)

    @property
    def calibration(self) -> Calibration:
        """How this restorer's restores compare with the cost model's predictions. A restore is set against
        its prediction (for a policy the caller named, a simulation the restore does not need) only here."""
        unsettled, self._unsettled = self._unsettled, {}
        for name, restores in unsettled.items():
            for predicted, seconds in restores:
                self._calibration.observe(name, predicted(), seconds)
        return self._calibration

    @property
    def cost_model(self) -> Profile | None:
        """What `Auto` predicts with: the measured profile, else the learned costs (None before any
        compute unit was seen)."""
        return self.profile if self.profile is not None else self.costs.profile()

    def costs_line(self) -> str:
        """Where the cost model comes from, for `Plan.explain`."""
        if self.profile is not None:
            return f"from the profile of this machine ({self.profile.created or 'kvrestore profile'})"
        return self.costs.describe()

    def plan(self, refs: list[ChunkRef], stored: Sequence[bool], auto: Auto | None = None) -> Plan:
        """What `auto` (default `Auto()`) chooses for `refs` given which are `stored`.

        What was learned ages: where `Auto` would compute everything although chunks are stored, and the
        link it judged by was never checked by this restorer's loads (it came from a file), not for
        `PROBE_EVERY` restores, or changed speed at the last restore that loaded and was not confirmed
        since (`LinkEstimate.unconfirmed`), the restore probes the link instead: it runs the strategy
        `Auto` explores with (a two-pointer, which adapts to the speeds it meets and is never much
        slower than computing), and its loads replace the link estimate. So does a restore `Auto` would
        load whole over a link it doubts (`LinkEstimate.doubted`: from a file, or a change not confirmed
        yet): load-only cannot adapt to a link slower than it was, a two-pointer can. Otherwise compute-only runs
        with one stored chunk fetched aside (`ComputeOnly(watch=True)`), whose landing (or time in
        flight without landing) keeps the link measured: a link that got faster is seen by the next
        plan, not sixteen restores later. So no link, however wrong, keeps `Auto` from loading for
        ever."""
        work = self.workload(refs, stored)
        plan = (auto or Auto()).plan(
            self.cost_model,
            self.link.current,
            work,
            self.calibration,
            costs=self.costs_line(),
            untried_margin=1.0 if self.profile is not None else UNTRIED_MARGIN,
        )
        alone = plan.choice.name in ("compute-only", "load-only")
        if not alone or not plan.predicted_s or (auto and auto.candidates):
            return plan
        if plan.choice.name == "compute-only":
            stale = self.link.observations == 0 or self._unprobed >= PROBE_EVERY or self.link.unconfirmed
        else:  # loading everything over a link that may be far slower than it is thought to be
            stale = self.link.doubted
        if stale:
            if self.link.doubted and self.link.observations == 0:
                why = "read from what an earlier restorer learned, not checked by a load here yet"
            elif self.link.observations == 0:
                why = "never checked by a load here"
            elif self.link.unconfirmed:
                why = "it changed speed at the last restore that loaded: checked once more"
            else:
                why = "not checked for a while"
            plan = replace(
                plan, choice=explore(work), reason=f"probing the store's link ({why}); else {plan.reason}"
            )
            self._probe = plan
            return plan
        if plan.choice.name != "compute-only":
            return plan
        # computing everything: one stored chunk fetched aside keeps the link measured (`watch`)
        watched = "; one stored chunk is fetched aside meanwhile, to keep measuring the store's link"
        return replace(plan, choice=ComputeOnly(watch=True), reason=plan.reason + watched)

    def workload(self, refs: list[ChunkRef], stored: Sequence[bool]) -> Workload:
        """One restore as the planner sees it."""
        spec = self.backend.spec
        return Workload(
            tuple(r.n_tokens for r in refs),
            tuple(bool(s) for s in stored),
            spec.num_layers,
            self.stored_bytes_per_token,
            self.engine.load_lanes,
            self.min_unit_chunks(),
        )

    def priors(self, refs: list[ChunkRef]) -> tuple[list[float | None], tuple[float, float] | None]:
        """What the cost model predicts before a restore has observed anything (`costs.estimates.Priors`):
        seconds to compute each chunk on top of the chunks before it (None where unknown), and the
        link as (seconds per token delivered, latency); none while the restore probes the link it
        doubts (`plan`), so its policy judges the link from its own fetches."""
        model, link = self.cost_model, self.link.current
        compute: list[float | None] = [None] * len(refs)
        if not self.engine.times_restores_alone:  # a batch engine shares the lanes: no such costs apply
            return compute, None
        if model is not None:
            compute = [model.chunk.seconds(r.n_tokens, r.start) for r in refs]
        elif self.overtaken_s_per_token is not None:
            compute = [self.overtaken_s_per_token * r.n_tokens for r in refs]
        if self._probing:
            return compute, None
        if link is None:
            silent = self.silent_s_per_token
            return compute, None if silent is None else (silent, 0.0)
        # the link is measured in the stored bytes its loads moved (an encoded chunk's, not the KV's)
        return compute, (self.stored_bytes_per_token / link.bytes_per_s, link.latency_s)

    def unit_fixed_s(self) -> float:
        """`Priors.unit_fixed_s`: the cost model's fixed cost of a token-wise unit (0 where the
        priors do not come from a cost model)."""
        model = self.cost_model
        return model.chunk.fixed_s if model is not None and self.engine.times_restores_alone else 0.0

    def layer_priors(self, n_tokens: int) -> tuple[list[float | None], tuple[float, float] | None]:
        """`priors` of a layer-axis restore over a prefix of `n_tokens`: seconds to compute each layer,
        and the link per token of one layer."""
        model, link, spec = self.cost_model, None if self._probing else self.link.current, self.backend.spec
        if not self.engine.times_restores_alone:  # a batch engine shares the lanes: no such costs apply
            model = link = None
        layer_s = model.layer.seconds(n_tokens) if model is not None else None
        if layer_s is None and self.overtaken_s_per_token is not None:
            layer_s = self.overtaken_s_per_token * n_tokens / spec.num_layers
        compute: list[float | None] = [layer_s] * spec.num_layers
        if link is None:
            return compute, None
        return compute, (self.stored_bytes_per_token / spec.num_layers / link.bytes_per_s, link.latency_s)

    def floors(self, refs: list[ChunkRef]) -> list[float | None]:
        """`Priors.floor_s` of a token-wise restore: the least each chunk's compute can take
        (the backend's `compute_floor_s`, where it has one), where the restore has the lanes to itself."""
        floor = self._floor()
        return [floor(r.n_tokens) if floor is not None else None for r in refs]

    def layer_floors(self, n_tokens: int) -> list[float | None]:
        """`floors` of a layer-axis restore over a prefix of `n_tokens`: one layer's share, per layer."""
        floor, n_layers = self._floor(), self.backend.spec.num_layers
        return [floor(n_tokens) / n_layers if floor is not None else None] * n_layers

    def _floor(self) -> Callable[[int], float] | None:
        floor = getattr(self.backend, "compute_floor_s", None)
        return floor if callable(floor) and self.engine.times_restores_alone else None

    def min_unit_chunks(self) -> int:
        """`LaneTraits.min_unit_chunks` of the token-wise restores (see `min_unit_tokens`)."""
        if not self.engine.times_restores_alone:  # a batch scheduler sizes units from its own token budget
            return 1
        return max(1, -(-self.min_unit_tokens() // self.chunk_size))

    def min_unit_tokens(self) -> int:
        """The fewest tokens a compute unit should cover: the backend's `min_unit_tokens` if it says;
        else, from the cost model, the fewest for which the fixed cost of a unit (on a GPU, mostly
        kernel launches) is at most `LAUNCH_SHARE` of its time, so launch-bound units are merged; before
        any cost is known, `CUDA_MIN_UNIT_TOKENS` on a GPU and none on a CPU."""
        own = getattr(self.backend, "min_unit_tokens", None)
        if own is not None:
            return int(own)
        model = self.cost_model
        if model is not None and model.chunk.per_token_s > 0:
            fixed, per_token = model.chunk.fixed_s, model.chunk.per_token_s
            return min(MAX_MIN_UNIT_TOKENS, math.ceil(fixed * (1 - LAUNCH_SHARE) / LAUNCH_SHARE / per_token))
        return CUDA_MIN_UNIT_TOKENS if torch.device(self.backend.device).type == "cuda" else 0

    def judged(self, policy: Policy, plan: Plan | None, stored: Sequence[bool]) -> Yardstick:
        """How the restore about to run `policy` will be judged (`calibrate`): counted as a run of its
        strategy where it is a strategy the planner knows, something is stored, and the engine times
        its restores alone (`Engine.times_restores_alone`; not a `BatchEngine`); set against a
        prediction only where it also runs as a planned restore of that strategy runs: with a cost
        model and a link to tell its policy (not an exploring restore, which runs without them and
        waits to see fetches land), and not probing the link (which runs without the link prior)."""
        if plan is not None and plan is self._probe:
            self._probing = True
        counted = self.engine.times_restores_alone and policy.name in PLANNED and any(stored)
        informed = self.cost_model is not None and self.link.current is not None and not self._probing
        return Yardstick(counted, counted and informed)

    def calibrate(
        self,
        policy: Policy,
        judged: Yardstick,
        refs: list[ChunkRef],
        stored: Sequence[bool],
        seconds: float,
        clean: bool,
    ) -> None:
        """After a restore (and after `learn`): count it as a run of its strategy, and set its time
        against what the cost model predicts for it with the costs and the link as this restore left
        them (where `judged` says so and it ran clean).

        Not against the prediction the plan made before it ran: where that prediction was off because
        the link was not what the planner thought (a link that changed speed, one read from a file), the
        restore's loads have corrected the link by now, and the error was the link's, not the
        strategy's. A factor learned from it would hold that strategy back (or push it) on every later
        restore, long after the link estimate was right again. What is left, measured against the
        corrected costs, is how the strategy itself compares with the model (lanes sharing the
        machine). A restore whose loads showed the link change speed is set against nothing: its policy
        decided by the old link, so it did not run as the strategy runs on this one. The prediction is
        simulated only once `calibration` is read."""
        model, link = self.cost_model, self.link.current
        if not (judged.counted and clean):
            pass
        elif model is None or link is None or not judged.compared or self._misled:
            self._calibration.count(policy.name)
        else:
            restores = self._unsettled.setdefault(policy.name, [])
            restores.append((partial(predict, policy, model, link, self.workload(refs, stored)), seconds))
            if len(restores) > UNSETTLED:  # the oldest would weigh nothing after the later ones: counted
                del restores[0]
                self._calibration.count(policy.name)
        self.costs.observe_restore()
        self._unprobed += 1
        self._probing = self._misled = False

    def learn(self, trace: Trace, refs: list[ChunkRef], layers_over: int | None = None) -> None:
        """Feed what a restore (or a save's restore) did to the cost model and the link estimate: its
        compute units (token-wise, or layer-wise over `layers_over` tokens) and its loads. Compute
        times are learned only where the restore had the compute lane to itself (not under a batch
        scheduler)."""
        if self.engine.times_restores_alone:
            for e in trace.of_kind("compute"):
                seconds = e.end_s - e.start_s
                if layers_over is None:
                    start = refs[e.first_chunk].start
                    self.costs.observe_compute(refs[e.last_chunk].end - start, start, seconds)
                else:
                    self.costs.observe_layers(layers_over, e.last_chunk - e.first_chunk + 1, seconds)
            if layers_over is None:
                self._learn_overtaken(trace, refs)
        if self._probing:
            self.link.reprobe()
        changes = self.link.changes
        moved = self.link.observe(trace)
        if moved:
            self._unprobed = 0
            self.silent_s_per_token = None
        elif layers_over is None:
            self._learn_silent(trace, refs)
            bound = self.silent_s_per_token  # no fetch landed: the link is at most this fast
            if bound is not None and self.link.at_most(self.stored_bytes_per_token / bound):
                self._unprobed = 0
        if self.link.changes > changes:  # the link changed speed: the factors measured over it go
            self._unsettled.clear()
            self._calibration.forget()
            self._misled = True
        self.costs.observe_link(self.link.current, moved)

    def _learn_silent(self, trace: Trace, refs: list[ChunkRef]) -> None:
        """A token-wise restore in which no fetch landed: a fetch dropped after t seconds in flight
        had not delivered its own n tokens nor the m tokens of the fetches issued before it, so the link
        takes at least t / (n + m) seconds a token (fetches are taken to be served in the order they
        were issued, as the two-pointers' landing estimates take them). The largest such bound is
        kept, over restores too (no restore can show the link faster without landing a fetch). Without
        it a link too slow for any fetch to land is never learned, and every restore over it
        starts in small units while it waits for fetches that will not land, each unit paying a unit's
        fixed cost. The first fetch that lands replaces it."""
        silent = [e for e in trace.events if e.kind in ("load-dropped", "aside-dropped") and e.seconds > 0]
        bounds = [
            e.seconds / sum(refs[f.first_chunk].n_tokens for f in silent if f.start_s <= e.start_s)
            for e in silent
        ]
        if bounds:
            self.silent_s_per_token = max(bounds + [self.silent_s_per_token or 0.0])

    def _learn_overtaken(self, trace: Trace, refs: list[ChunkRef]) -> None:
        """Token-wise units that fetches overtook, from the layers they ran: a unit that ran k of the
        model's L layers in t seconds would have taken about t * L / k. On a store faster than
        computing every unit is overtaken, so without this the two-pointers would know no compute cost
        and start a unit in every restore, paying a layer's compute and the CPU it takes from the loads.

        Kept apart from the cost model (`overtaken_s_per_token`, the lowest such rate seen): such a
        unit ran beside every load lane at once (on a 2-core CPU, measured about 3x its time alone),
        so it would bias the fitted per-unit cost, the unit sizes and `Auto`'s predictions. It serves
        only as the two-pointers' prior, where too high a compute cost errs towards loading, which is
        the lane that overtook it."""
        num_layers = self.backend.spec.num_layers
        for e in trace.of_kind("compute-overtaken"):
            if e.partial is None or not 0 < e.partial[0] <= num_layers:
                continue  # stopped before its first layer ended, or a backend whose checkpoints differ
            layers, seconds = e.partial
            n_tokens = refs[e.last_chunk].end - refs[e.first_chunk].start
            rate = seconds * num_layers / layers / n_tokens
            known = self.overtaken_s_per_token
            self.overtaken_s_per_token = rate if known is None else min(known, rate)

    def learn_compute(self, n_tokens: int, start: int, seconds: float) -> None:
        """One compute unit timed outside the engine (a layer-wise restore's token-wise tail)."""
        if self.engine.times_restores_alone:
            self.costs.observe_compute(n_tokens, start, seconds)

    async def keep(self, settle: bool = False) -> None:
        """Persist what was learned (a small JSON file; a failure to write it is logged, not raised),
        with the restores set against their predictions so far, or, `settle`, all of them."""
        if self.learned_at is None or self.profile is not None:
            return
        calibration = self.calibration if settle else self._calibration
        self.costs.state.calibration = calibration.logs()
        self.costs.state.calibrated = dict(calibration.observations)
        try:
            await anyio.to_thread.run_sync(self.costs.save)
        except OSError as exc:
            log.warning("could not keep the learned costs at %s: %s", self.learned_at, exc)
            self.learned_at = None
