"""`Auto` re-learns a link that changed speed, whatever it learned of that store before: on the
simulated clock, a restorer's planner plans each restore, the chosen policy runs against the machine's
true costs (`sim.simulate`), and the planner learns from its trace, as `restore.run` does on the real
engine. Nothing here depends on this machine's speed: every time is the simulator's.

The machine is SmolLM2-135M on this repository's 2-core CPU (its profile); a link is a multiple of the
balance bandwidth of the prompt at hand (compute-only and load-only take equally long)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from kvrestore import Auto, ComputeOnly, LayerTwoPointer, LoadOnly, TokenTwoPointer
from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.keys import ChunkRef
from kvrestore.core.spec import ModelSpec
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.estimates import Priors
from kvrestore.costs.links import LinkCost
from kvrestore.costs.profile import Profile
from kvrestore.planning.auto import loads_every_layer_first
from kvrestore.planning.planner import Planner
from kvrestore.policies import Policy, Progress
from kvrestore.runtime.engine import Engine
from kvrestore.sim.simulate import simulate

from .conftest import ask

SPEC = ModelSpec("smollm2-shaped", 30, 3, 64, 49152, torch.float32, "5" * 32)
CHUNK = ChunkCost(5e-3, 1.9e-3, 8.3e-7, 4e-7)  # SmolLM2-135M fp32, as `kvrestore profile` measured it
LAYER = LayerCost(4e-4, 7e-5, 2.9e-8)
TRUTH = Profile("sim", SPEC.name, SPEC.fingerprint, "float32", "cpu", CHUNK, LAYER, LinkCost(1e8))
BYTES = SPEC.kv_bytes_per_token
CHUNK_TOKENS = 256
#: the target (issue 59): from the fourth restore after a change on, within this of the best strategy
WITHIN = 1.10


class Machine:
    """What a `Planner` asks of a backend: the model's shape, the device (no compute floor)."""

    spec = SPEC
    device = "cpu"


def planner(learned: Path | bool = False, profile: Profile | bool = False) -> Planner:
    """A restorer's planner over one store (named alike whatever its speed, as a throttled link is)."""
    return Planner(Machine(), Engine(4), CHUNK_TOKENS, "ThrottledStore(MemoryStore())", profile, learned)  # type: ignore[arg-type]


def balance(n: int) -> float:
    return n * BYTES / CHUNK.seconds(n)


def restore(p: Planner, policy: Policy | Auto, n: int, bytes_per_s: float) -> float:
    """One restore of a fully stored `n`-token prompt over a link of `bytes_per_s`, as `restore.run`
    runs it (plan, hand-off along tokens, learn, calibrate), on the simulated clock: its seconds."""
    refs = [
        ChunkRef(i, s, min(s + CHUNK_TOKENS, n), f"{i:016x}") for i, s in enumerate(range(0, n, CHUNK_TOKENS))
    ]
    stored = [True] * len(refs)
    plan = p.plan(refs, stored, policy) if isinstance(policy, Auto) else None
    chosen = plan.choice if plan is not None else policy
    assert isinstance(chosen, Policy)
    judged = p.judged(chosen, plan, stored)
    link = Link(BandwidthTrace.constant(bytes_per_s))
    runs = chosen
    if chosen.axis == "layers":
        compute_s, link_prior = p.layer_priors(n)
        if not loads_every_layer_first(chosen, n, SPEC.num_layers, 4, Priors(compute_s, link_prior)):
            layer_s = LAYER.seconds(n)
            result = simulate(
                chosen,
                [n] * SPEC.num_layers,
                [True] * SPEC.num_layers,
                lambda a, b, _t: (b - a) * layer_s,
                [n * BYTES // SPEC.num_layers] * SPEC.num_layers,
                link,
                priors=(compute_s, link_prior),
            )
            p.learn(result.trace, refs, layers_over=n)
            p.calibrate(chosen, judged, refs, stored, result.makespan, clean=True)
            return result.makespan
        runs = LoadOnly()  # whole chunks along tokens (`restore.layer_wise`)
    tokens = [r.n_tokens for r in refs]
    compute_s, link_prior = p.priors(refs)
    result = simulate(
        runs,
        tokens,
        stored,
        lambda a, b, _t: CHUNK.seconds(sum(tokens[a:b]), refs[a].start),
        [t * BYTES for t in tokens],
        link,
        min_unit_chunks=p.min_unit_chunks(),
        priors=(compute_s, link_prior),
        unit_fixed_s=p.unit_fixed_s(),
    )
    p.learn(result.trace, refs)
    p.calibrate(chosen, judged, refs, stored, result.makespan, clean=True)
    return result.makespan


def best(n: int, bytes_per_s: float) -> float:
    """The fastest fixed strategy, each run by a restorer that knows the true costs and link."""
    truth = TRUTH.with_link(LinkCost(bytes_per_s))
    policies = (ComputeOnly(), LoadOnly(), TokenTwoPointer(), LayerTwoPointer())
    return min(restore(planner(profile=truth), policy, n, bytes_per_s) for policy in policies)


def auto_vs_best(phases: list[tuple[int, float, int]], learned: Path, fresh: bool) -> list[list[float]]:
    """Auto's restores over each phase (tokens, link as a multiple of their balance, restores), over
    the best strategy's time; one planner throughout, or (`fresh`) a new one per phase that starts
    from what the last one kept."""
    out, p = [], planner(learned)
    for n, multiple, count in phases:
        if fresh and out:
            anyio.run(p.keep)
            p = planner(learned)
        bps = multiple * balance(n)
        fastest = best(n, bps)
        out.append([restore(p, Auto(), n, bps) / fastest for _ in range(count)])
    return out


#: issue 59's sequence: the same store learned at 256 tokens over 0.25x and 4x the balance bandwidth,
#: then 2,048 tokens over 0.25x
ISSUE = [(256, 0.25, 3), (256, 4.0, 3), (2048, 0.25, 6)]


@pytest.mark.parametrize("fresh", [False, True], ids=["one restorer", "a restorer per phase"])
def test_the_issue_sequence_is_back_within_ten_percent_of_the_best_from_the_fourth_restore(tmp_path, fresh):
    ratios = auto_vs_best(ISSUE, tmp_path / "learned.json", fresh)
    assert max(ratios[-1][3:]) <= WITHIN, ratios
    assert max(ratios[-1]) <= 1.5, ratios  # and no restore on the way pays for what was learned before


@pytest.mark.parametrize(
    "before, after",
    [(4.0, 0.25), (0.25, 4.0), (0.1, 10.0), (10.0, 0.1), (2.0, 0.5), (0.5, 2.0)],
    ids=lambda m: f"{m}x",
)
@pytest.mark.parametrize("fresh", [False, True], ids=["one restorer", "a restorer per phase"])
def test_a_link_that_changed_speed_is_relearned_within_three_restores(tmp_path, before, after, fresh):
    """Faster or slower, by 4x to 100x: from the fourth restore after the change on, `Auto` is within
    `WITHIN` of the best strategy, at 2,048 tokens."""
    ratios = auto_vs_best([(2048, before, 6), (2048, after, 6)], tmp_path / "learned.json", fresh)
    assert max(ratios[0][3:]) <= WITHIN and max(ratios[1][3:]) <= WITHIN, ratios


def test_a_restore_planned_on_a_stale_link_teaches_no_factor(tmp_path):
    """The first restore after a link got sixteen times slower was planned, and its policy told, for
    the old link: its loads replace the estimate (a change, not noise: `CHANGE_FACTOR`), and the
    factors learned over the old link are dropped. Its time is set against no prediction, so no
    strategy is held back by the old link's error once the estimate is right (issue 59: factors of 2
    from such restores kept `Auto` on compute-only at 1.2-1.6x the best)."""
    p = planner(tmp_path / "learned.json")
    fast, slow = 4 * balance(2048), 0.25 * balance(2048)
    for _ in range(3):
        restore(p, Auto(), 2048, fast)
    assert p.link.current is not None and p.link.current.bytes_per_s == pytest.approx(fast, rel=0.05)
    runs = sum(p.calibration.observations.values())
    restore(p, Auto(), 2048, slow)
    assert p.link.current.bytes_per_s == pytest.approx(slow, rel=0.05)  # replaced, not averaged
    assert p.link.changes == 1 and p.link.unconfirmed
    assert p.calibration.factors() == {}  # nothing learned over the old link is applied to this one
    assert sum(p.calibration.observations.values()) == runs + 1  # counted as a run, set against nothing
    restore(p, Auto(), 2048, slow)
    assert not p.link.unconfirmed and all(0.9 <= f <= 1.1 for f in p.calibration.factors().values())


def test_auto_computing_everything_still_watches_the_link(tmp_path):
    """Over a link that became too slow to help, `Auto` computes everything but fetches one stored
    chunk aside (`ComputeOnly(watch=True)`): when the link gets eighty times faster, the next restore
    knows it."""
    p = planner(tmp_path / "learned.json")
    slow, fast = 0.05 * balance(2048), 4 * balance(2048)
    for bps in [balance(2048)] * 3 + [slow] * 4:
        restore(p, Auto(), 2048, bps)
    plan = p.plan([ChunkRef(i, 256 * i, 256 * (i + 1), f"{i:016x}") for i in range(8)], [True] * 8, Auto())
    assert isinstance(plan.choice, ComputeOnly) and plan.choice.watch
    restore(p, Auto(), 2048, fast)  # computes everything once more; its fetch aside lands
    assert p.link.current is not None and p.link.current.bytes_per_s == pytest.approx(fast, rel=0.2)
    assert restore(p, Auto(), 2048, fast) <= WITHIN * best(2048, fast)


def test_compute_only_watching_fetches_the_last_stored_chunk_of_its_first_unit_aside():
    p = Progress([256] * 4, [True, True, True, False])
    p.lanes.can_overtake = True
    decision = ask(ComputeOnly(watch=True), p.as_if(free_load_lanes=4))
    assert decision.compute == (0, 4) and decision.overtake == (2,)
    assert ask(ComputeOnly(), p.as_if(free_load_lanes=4)).overtake == ()  # the user's: the store is not read
    assert ask(ComputeOnly(watch=True), p.as_if(free_load_lanes=0)).overtake == ()  # no lane free
    p.lanes.can_overtake = False  # a batch engine's lanes: nothing aside
    assert ask(ComputeOnly(watch=True), p.as_if(free_load_lanes=4)).overtake == ()


def test_auto_loads_everything_only_over_a_link_it_checked_itself(tmp_path):
    """A link read from what an earlier restorer learned is a hint: where `Auto` would load
    everything over it, a fresh restorer probes it with a two-pointer first (load-only cannot adapt
    to a link slower than it was; a two-pointer can), then loads everything once its own loads agree."""
    learned = tmp_path / "learned.json"
    fast = 100 * balance(2048)
    earlier = planner(learned)
    earlier.learn_compute(2048, 0, CHUNK.seconds(2048))  # the save computed the prompt in one unit
    for _ in range(4):
        restore(earlier, Auto(), 2048, fast)
    anyio.run(earlier.keep)
    refs = [ChunkRef(i, 256 * i, 256 * (i + 1), f"{i:016x}") for i in range(8)]
    assert earlier.plan(refs, [True] * 8).choice.name == "load-only"
    fresh = planner(learned)
    assert fresh.link.doubted
    probe = fresh.plan(refs, [True] * 8)
    assert isinstance(probe.choice, TokenTwoPointer) and "probing the store's link" in probe.reason
    restore(fresh, Auto(), 2048, fast)
    assert not fresh.link.doubted and fresh.plan(refs, [True] * 8).choice.name == "load-only"
