"""Auto, the planner: it never picks a strategy predicted slower than another, falls back to one
resource where both would be slower, and its predictions hold on a real (tiny) model and link."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import Auto, ComputeOnly, LayerTwoPointer, LoadOnly, Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import InvalidInputError
from kvrestore.costs.calibration import Calibration
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.links import LinkCost
from kvrestore.costs.measure import profile
from kvrestore.planning.auto import (
    ADAPTS,
    NO_COMPUTE,
    NO_LINK,
    PLANNED,
    TIE,
    Workload,
    crossover_length,
    predict,
)
from kvrestore.policies import Policy
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens, tiny_model
from .test_profile import make_profile

#: SmolLM2-135M fp32 on the 2-core CPU, as `kvrestore profile` measured it
SMOL_CHUNK = ChunkCost(5e-3, 1.9e-3, 8.3e-7, 4e-7)
SMOL_LAYER = LayerCost(4e-4, 7e-5, 2.9e-8)
SMOL_BYTES = 46_080  # KV bytes per token
SMOL_LAYERS = 30


def smol_work(n_tokens: int, stored=None, lanes: int = 4) -> Workload:
    chunks = tuple([256] * (n_tokens // 256) + ([n_tokens % 256] if n_tokens % 256 else []))
    return Workload(chunks, tuple(stored or [True] * len(chunks)), SMOL_LAYERS, SMOL_BYTES, lanes)


def smol_plan(n_tokens: int, speed: float, stored=None):
    """The plan for a prompt of `n_tokens` on a link `speed` x the balance (compute-only == load-only)."""
    p = make_profile(chunk=SMOL_CHUNK, layer=SMOL_LAYER)
    balance = n_tokens * SMOL_BYTES / SMOL_CHUNK.seconds(n_tokens)
    return Auto().plan(p, LinkCost(speed * balance, 0.0), smol_work(n_tokens, stored))


@st.composite
def plans(draw):
    chunk = ChunkCost(*(draw(st.floats(0, hi)) for hi in (1e-2, 1e-3, 1e-6, 1e-6)))
    layer = LayerCost(*(draw(st.floats(0, hi)) for hi in (1e-3, 1e-4, 1e-7)))
    if chunk.seconds(64) <= 0 or layer.seconds(64) <= 0:
        chunk, layer = ChunkCost(1e-3, 1e-4, 0, 0), LayerCost(1e-4, 1e-6, 0)
    n_chunks = draw(st.integers(1, 24))
    chunks = tuple(draw(st.sampled_from([64, 256])) for _ in range(n_chunks))
    stored = tuple(draw(st.lists(st.booleans(), min_size=n_chunks, max_size=n_chunks)))
    work = Workload(chunks, stored, draw(st.integers(1, 40)), 4096, draw(st.integers(1, 4)))
    link = LinkCost(draw(st.floats(1e5, 1e10)), draw(st.floats(0, 0.01)))
    return chunk, layer, link, work


@settings(max_examples=150, deadline=None)
@given(plans())
def test_never_picks_a_policy_predicted_slower_than_another(case):
    chunk, layer, link, work = case
    plan = Auto().plan(make_profile(chunk=chunk, layer=layer), link, work)
    if not any(work.stored):
        assert isinstance(plan.choice, ComputeOnly)
        return
    best = plan.predicted_s[plan.choice.name]
    assert all(best <= s * TIE for s in plan.predicted_s.values())  # a near tie goes to the simpler
    assert set(plan.predicted_s) == {"compute-only", "load-only", "two-pointer", "layer-wise"}
    # the harmonic-mean bound is below both single resources, and nothing beats it by much
    assert plan.bound_s <= min(plan.compute_s, plan.load_s) + 1e-12
    assert plan.choice.name in plan.explain()


def test_without_costs_or_link_it_explores_and_says_why():
    plan = Auto().plan(None, LinkCost(1e8), smol_work(512), costs="learned from nothing yet")
    assert isinstance(plan.choice, LayerTwoPointer) and "exploring" in plan.reason  # two chunks: layers
    assert "learned from nothing yet" in plan.explain()
    # the link alone predicts load-only of a fully stored prompt; the rest need the compute's speed
    assert plan.predicted_s == {"load-only": predict(LoadOnly(), make_profile(), LinkCost(1e8), smol_work(512))}
    assert set(plan.unknown) == {"compute-only", "two-pointer", "layer-wise"}
    assert all(NO_COMPUTE in why and NO_LINK not in why for why in plan.unknown.values())


def test_a_fresh_store_s_plan_shows_what_it_predicted_and_what_it_does_not_know_yet():
    """Costs known (a save computed the prompt), no load seen: compute-only is predicted, and the
    balance bandwidth from it; each other strategy says what is missing; `explain` has a line for
    every strategy, the chosen one marked."""
    p, work = make_profile(chunk=SMOL_CHUNK, layer=SMOL_LAYER), smol_work(2048)
    plan = Auto().plan(p, None, work)
    tc = SMOL_CHUNK.seconds(2048)
    assert isinstance(plan.choice, TokenTwoPointer) and "exploring" in plan.reason
    assert plan.predicted_s == {"compute-only": pytest.approx(tc)} and plan.compute_s == pytest.approx(tc)
    assert plan.balance_bytes_per_s == pytest.approx(2048 * SMOL_BYTES / tc)
    assert plan.unknown["load-only"] == NO_LINK
    assert plan.unknown["two-pointer"] == plan.unknown["layer-wise"] == f"{NO_LINK}; {ADAPTS}"
    assert plan.bound_s is None and plan.l_delta is None  # neither without a link
    lines = plan.explain().splitlines()
    for name in PLANNED:
        (line,) = [x for x in lines if x.split()[:1] == [name]]
        assert line.endswith("<- chosen") == (name == "two-pointer")
        assert ("not predicted" in line) == (name != "compute-only")
    # once a link is known every strategy is predicted, and nothing is unknown
    known = Auto().plan(p, LinkCost(2048 * SMOL_BYTES / tc), work)
    assert set(known.predicted_s) == set(PLANNED) and not known.unknown
    assert known.bound_s is not None and known.balance_bytes_per_s == plan.balance_bytes_per_s
    plan = Auto().plan(None, LinkCost(1e8), smol_work(1024))  # four chunks: along tokens
    assert isinstance(plan.choice, TokenTwoPointer) and "exploring" in plan.reason
    plan = Auto().plan(make_profile(), None, smol_work(8192))  # a long prefix: along tokens
    assert isinstance(plan.choice, TokenTwoPointer) and "no load seen" in plan.reason
    # stored chunks after a hole: layers would restore only the prefix, tokens take them all
    plan = Auto().plan(None, None, smol_work(1024, [True, False, True, True]))
    assert isinstance(plan.choice, TokenTwoPointer)
    plan = Auto().plan(make_profile(), LinkCost(1e8), smol_work(1024, [False] * 4))
    assert isinstance(plan.choice, ComputeOnly)


def test_falls_back_to_one_resource_when_the_other_is_hopeless():
    assert isinstance(smol_plan(4096, 1000.0).choice, LoadOnly)
    assert isinstance(smol_plan(4096, 0.001).choice, ComputeOnly)


def test_layer_wise_below_the_crossover_token_wise_above():
    short, long = smol_plan(256, 1.0), smol_plan(8192, 1.0)
    assert isinstance(short.choice, LayerTwoPointer) and isinstance(long.choice, TokenTwoPointer)
    assert short.l_delta is not None and 256 < short.l_delta <= 8192
    p = make_profile(chunk=SMOL_CHUNK, layer=SMOL_LAYER)
    link = LinkCost(1024 * SMOL_BYTES / SMOL_CHUNK.seconds(1024))
    l_delta = crossover_length(p, link, SMOL_LAYERS, SMOL_BYTES)
    assert l_delta is not None
    below, above = smol_work(l_delta // 2), smol_work(l_delta)
    assert predict(LayerTwoPointer(), p, link, below) < predict(TokenTwoPointer(), p, link, below)
    assert predict(TokenTwoPointer(), p, link, above) <= predict(LayerTwoPointer(), p, link, above)


def test_restore_defaults_to_auto_and_returns_its_plan(llama_backend):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)

    async def main():
        store = MemoryStore()
        r = Restorer(llama_backend, store, chunk_size=32, profile=make_profile(llama_backend))
        await r.save(tokens)
        return await r.restore(tokens)

    res = anyio.run(main)
    assert res.plan is not None and res.plan.choice.name == res.stats.policy
    assert res.plan.predicted_s[res.stats.policy] == min(res.plan.predicted_s.values())
    r = Restorer(llama_backend, MemoryStore(), chunk_size=32, profile=make_profile(llama_backend))
    with pytest.raises(InvalidInputError, match="2 flags for 7 chunks"):
        r.plan(tokens, [True, True])
    # Auto plans a whole restore: it is no Policy, so nothing can ask it for a decision that raises
    assert not isinstance(Auto(), Policy) and not hasattr(Auto(), "decide")
    res = anyio.run(r.restore, tokens, Auto())  # and restore takes it, replaced by its plan's choice
    assert res.plan is not None and res.stats.policy == res.plan.choice.name == "compute-only"


def test_calibration_learns_how_each_strategy_compares_with_its_prediction():
    cal = Calibration(weight=0.5, limit=2.0)
    assert cal.factor("layer-wise") == 1.0  # never observed: the model as it is
    cal.observe("layer-wise", predicted_s=1.0, measured_s=1.5)
    assert cal.factor("layer-wise") == pytest.approx(1.5)
    cal.observe("layer-wise", predicted_s=1.0, measured_s=1.5)
    assert cal.factor("layer-wise") == pytest.approx(1.5)
    cal.observe("layer-wise", predicted_s=1.0, measured_s=100.0)  # an outlier moves it, within the limit
    assert 1.5 < cal.factor("layer-wise") <= 2.0
    cal.observe("two-pointer", predicted_s=0.0, measured_s=1.0)  # nothing to learn from
    assert cal.factors().keys() == {"layer-wise"}
    # a strategy that ran slower than predicted stops being picked where it only just won
    plain = smol_plan(4096, 1.0)
    close = sorted(plain.predicted_s.items(), key=lambda kv: kv[1])
    best, runner_up = close[0][0], close[1][0]
    cal = Calibration()
    cal.observe(best, 1.0, 1.0 * plain.predicted_s[runner_up] / plain.predicted_s[best] * 1.2)
    p = make_profile(chunk=SMOL_CHUNK, layer=SMOL_LAYER)
    balance = 4096 * SMOL_BYTES / SMOL_CHUNK.seconds(4096)
    again = Auto().plan(p, LinkCost(balance, 0.0), smol_work(4096), cal)
    assert again.choice.name != best and best in again.calibration and "learned" in again.explain()


def test_a_restorer_calibrates_from_its_own_restores(llama_backend):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)

    async def main():
        r = Restorer(llama_backend, MemoryStore(), chunk_size=32, profile=make_profile(llama_backend))
        await r.save(tokens)
        await r.restore(tokens, TokenTwoPointer())
        first = dict(r.planner.calibration.observations)
        res = await r.restore(tokens)  # Auto: plans with what it learned
        return first, r.planner.calibration.observations, res

    first, later, res = anyio.run(main)
    assert first.get("two-pointer") == 1
    assert sum(later.values()) == 2 and res.plan is not None


@pytest.mark.slow
def test_predictions_from_a_real_profile_keep_the_promise_on_the_simulated_clock():
    """The profile of a real model, then every prediction on the simulated clock: loading slows in
    proportion to the link, and a two-pointer is never predicted slower than the better single
    resource (the promise, within 5%). How close predictions come to real time is a benchmark's
    question (`benchmarks/planner.py` records both), not a test's."""
    backend = HFBackend(tiny_model("llama", layers=12), name="tiny-llama-12")
    tokens = random_tokens(768, backend.spec.vocab_size)

    async def main():
        prof = await profile(backend, None, max_tokens=768, chunk_size=128, repeats=3)
        balance = len(tokens) * backend.spec.kv_bytes_per_token / prof.chunk.seconds(len(tokens))
        plans = {}
        for speed in (0.5, 2.0):
            link = LinkCost(speed * balance, 0.0)
            r = Restorer(backend, MemoryStore(), chunk_size=128, profile=prof.with_link(link), learn=False)
            plans[speed] = r.plan(tokens, [True] * 6).predicted_s
        return plans

    plans = anyio.run(main)
    slow, fast = plans[0.5], plans[2.0]
    assert slow["load-only"] == pytest.approx(4 * fast["load-only"], rel=0.01)
    for predicted in (slow, fast):
        best_single = min(predicted["compute-only"], predicted["load-only"])
        for name in ("two-pointer", "layer-wise"):
            assert predicted[name] <= 1.05 * best_single, (name, predicted)


def test_with_learned_costs_an_untried_strategy_predicted_close_is_tried():
    plain = smol_plan(1024, 1.0)
    ranked = sorted(plain.predicted_s, key=plain.predicted_s.get)
    best, runner_up = ranked[0], ranked[1]
    ratio = plain.predicted_s[runner_up] / plain.predicted_s[best]
    assert ratio < 1.15, "the runner-up must be within the margin for this test to say anything"
    p = make_profile(chunk=SMOL_CHUNK, layer=SMOL_LAYER)
    balance = 1024 * SMOL_BYTES / SMOL_CHUNK.seconds(1024)
    only_best = Calibration()
    only_best.observe(best, 1.0, 1.0)  # only the best was ever run, and it ran as predicted
    tried = Auto().plan(p, LinkCost(balance, 0.0), smol_work(1024), only_best, untried_margin=1.15)
    assert tried.choice.name == runner_up  # close enough to be worth one restore
    both = Calibration()
    both.observe(best, 1.0, 1.0)
    both.observe(runner_up, 1.0, 1.0)
    kept = Auto().plan(p, LinkCost(balance, 0.0), smol_work(1024), both, untried_margin=1.15)
    assert kept.choice.name == best  # every plausible strategy was tried: the fastest
    measured = Auto().plan(p, LinkCost(balance, 0.0), smol_work(1024), only_best, untried_margin=1.0)
    assert measured.choice.name == best  # a measured profile: no strategy is tried for its own sake


@pytest.mark.parametrize("kv_encoding", ["native", "int8"])
def test_the_link_prior_is_per_token_as_stored(tiny_backend, kv_encoding):
    """The link is measured in the stored bytes its loads move; a restore is told it per token of what
    the store holds, so an int8 restorer's loads are expected to take about a quarter of the native
    time, not the native time."""
    restorer = Restorer(tiny_backend, MemoryStore(), chunk_size=16, kv_encoding=kv_encoding)
    planner = restorer.planner
    planner.link.current = LinkCost(1e6, 0.001)
    _, refs = restorer.chunks(random_tokens(64, tiny_backend.spec.vocab_size))
    _, link = planner.priors(refs)
    assert link == (pytest.approx(planner.stored_bytes_per_token / 1e6), 0.001)
    _, layer_link = planner.layer_priors(64)
    assert layer_link == (
        pytest.approx(planner.stored_bytes_per_token / tiny_backend.spec.num_layers / 1e6),
        0.001,
    )
    native = tiny_backend.spec.kv_bytes_per_token
    assert (planner.stored_bytes_per_token < 0.6 * native) == (kv_encoding == "int8")
