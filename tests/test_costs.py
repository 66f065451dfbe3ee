"""Costs learned from the work itself: a restorer without a profile explores, learns its compute and
link costs from its saves and restores, plans with them, keeps them for the next restorer of the same
machine, model and store, and sizes its compute units from them."""

from __future__ import annotations

import json
import logging

import anyio
import pytest

from kvrestore import Restorer, TokenTwoPointer
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.learned import CostLearner, learned_dir, store_name
from kvrestore.costs.links import LinkCost, LinkEstimate
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .test_profile import make_profile


def test_the_fit_recovers_the_costs_that_made_the_samples(llama_backend):
    truth = ChunkCost(4e-3, 2e-4, 6e-8, 3e-8)  # per pair alike over the past and the unit's own tokens
    learner = CostLearner(llama_backend.spec, "cpu", "s")
    for n, past in [(64, 0), (128, 0), (64, 64), (128, 256), (256, 512), (32, 1024)]:
        learner.observe_compute(n, past, truth.seconds(n, past))
    learner.observe_link(LinkCost(1e8, 1e-3), moved=True)
    got = learner.profile()
    assert got is not None and learner.ready
    for n, past in [(512, 0), (256, 2048), (1, 0)]:
        assert got.chunk.seconds(n, past) == pytest.approx(truth.seconds(n, past), rel=1e-6)
    # one layer is a prefill's share of the work when no layer-wise unit was seen
    layers = llama_backend.spec.num_layers
    assert got.layer.seconds(300) == pytest.approx(truth.seconds(300) / layers, rel=1e-6)


def test_few_samples_give_a_cautious_model_and_layers_alone_give_a_prefill(llama_backend):
    learner = CostLearner(llama_backend.spec, "cpu", "s")
    assert learner.profile() is None and not learner.ready
    learner.observe_compute(100, 0, 0.5)  # one shape: linear, no fixed cost it could not tell apart
    model = learner.profile()
    assert model is not None and not learner.ready  # no load seen yet
    assert model.chunk.fixed_s == 0 and model.chunk.seconds(200) == pytest.approx(1.0)
    layered = CostLearner(llama_backend.spec, "cpu", "s")
    layered.observe_layers(400, layers=4, seconds=0.04)  # 10 ms a layer
    model = layered.profile()
    assert model is not None
    assert model.chunk.seconds(400) == pytest.approx(0.01 * llama_backend.spec.num_layers)
    assert "1 layer-wise" in layered.describe() and "no load seen" in layered.describe()


def test_the_link_estimate_learns_the_latency_of_requests():
    rate, latency = 1e8, 0.004
    trace = Trace()
    t = 0.0
    for i in range(8):  # one request at a time: its time is a round trip plus its bytes
        nbytes = 1_000_000 * (1 + i % 3)
        end = t + latency + nbytes / rate
        trace.add(TraceEvent("load", i, i, t, end, nbytes))
        t = end
    est = LinkEstimate()
    assert est.observe(trace)
    assert est.current is not None
    assert est.current.latency_s == pytest.approx(latency, rel=0.35)
    assert est.current.bytes_per_s == pytest.approx(rate, rel=0.25)
    assert not LinkEstimate().observe(Trace())  # no loads: nothing learned
    kept = LinkEstimate(LinkCost(1e8, 0.5))  # a profile measured the latency: it stays
    kept.observe(trace)
    assert kept.current.latency_s == 0.5


def test_a_restorer_without_a_profile_explores_then_plans_with_what_it_learned(llama_backend):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)

    async def main():
        store = MemoryStore()
        r = Restorer(llama_backend, store, chunk_size=32)
        await r.save(tokens)  # computing the prompt: compute units learned, no load yet
        first = await r.restore(tokens)
        second = await r.restore(tokens)
        return r, first, second

    r, first, second = anyio.run(main)
    assert first.plan is not None and "exploring" in first.plan.reason
    # the save taught the compute costs, no load the link's: compute-only predicted, the rest not yet
    assert set(first.plan.predicted_s) == {"compute-only"} and first.plan.balance_bytes_per_s
    assert set(first.plan.unknown) == {"load-only", "two-pointer", "layer-wise"}
    assert isinstance(first.plan.choice, TokenTwoPointer)  # seven chunks: along tokens
    assert second.plan is not None and second.plan.predicted_s  # predicted every strategy
    predicted = second.plan.predicted_s
    assert predicted[second.plan.choice.name] <= min(predicted.values()) * 1.15  # untried: a margin
    text = second.plan.explain()
    assert "learned from the work itself" in text and "over 1 restores" in text
    assert r.planner.costs.state.chunk and r.planner.costs.state.loads >= 1
    assert r.planner.calibration.observations["two-pointer"] >= 1  # the exploring restore counts as run
    for res in (first, second):
        assert res.stats.failed_loads == 0


def test_what_was_learned_is_kept_for_the_next_restorer_of_the_same_store(llama_backend, tmp_path):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)
    store = MemoryStore()

    async def restore_twice(**kw):
        r = Restorer(llama_backend, store, chunk_size=32, **kw)
        await r.save(tokens)
        await r.restore(tokens)
        return r

    anyio.run(restore_twice)
    kept = list(learned_dir().glob("*.json"))
    assert len(kept) == 1
    state = json.loads(kept[0].read_bytes())
    assert state["store"] == store_name(store) == "MemoryStore()" and state["restores"] == 1

    async def fresh(**kw):
        return await Restorer(llama_backend, store, chunk_size=32, **kw).restore(tokens)

    warm = anyio.run(fresh)
    assert warm.plan is not None and warm.plan.predicted_s  # no exploring: it starts where the last stopped
    cold = anyio.run(lambda: fresh(learn=False))
    assert "exploring" in cold.plan.reason
    # an explicit path; a file of another store or a damaged one is not used (and says so)
    path = tmp_path / "costs.json"
    anyio.run(lambda: restore_twice(learn=path))
    assert json.loads(path.read_bytes())["restores"] == 1
    assert not CostLearner(llama_backend.spec, "cpu", "another store", path).state.restores
    path.write_bytes(b"{not json")
    assert not CostLearner(llama_backend.spec, "cpu", store_name(store), path).state.restores
    with pytest.raises(InvalidInputError, match="learn"):
        Restorer(llama_backend, store, learn=3)  # type: ignore[arg-type]


def test_a_profile_starts_the_planner_warm_and_is_not_overwritten(llama_backend):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)

    async def main():
        r = Restorer(llama_backend, MemoryStore(), chunk_size=32, profile=make_profile(llama_backend))
        await r.save(tokens)
        return await r.restore(tokens)

    res = anyio.run(main)
    assert res.plan.predicted_s and "profile" in res.plan.costs
    assert not list(learned_dir().glob("*.json"))


def test_compute_units_are_sized_from_the_measured_fixed_cost(llama_backend, caplog):
    # a unit whose fixed cost (launches, per-call work) is 20 ms and whose tokens cost 0.1 ms each is
    # launch-bound below 600 tokens (fixed cost more than a quarter of its time): units are merged
    heavy = make_profile(llama_backend, chunk=ChunkCost(0.02, 1e-4, 0.0, 0.0))
    r = Restorer(llama_backend, MemoryStore(), chunk_size=32, profile=heavy)
    assert r.planner.min_unit_tokens() == 600 and r.planner.min_unit_chunks() == 19
    light = make_profile(llama_backend, chunk=ChunkCost(0.0, 1e-4, 0.0, 0.0))
    assert Restorer(llama_backend, MemoryStore(), chunk_size=32, profile=light).planner.min_unit_chunks() == 1
    # the planner predicts the token-wise two-pointer with the same floor the restore runs with
    tokens = random_tokens(640, llama_backend.spec.vocab_size)
    work = r.planner.workload(r.chunks(tokens)[1], [True] * 20)
    assert work.min_unit_chunks == 19

    async def main():
        with caplog.at_level(logging.WARNING):
            await r.save(tokens)
            return await r.restore(tokens, TokenTwoPointer())

    res = anyio.run(main)
    units = [e.last_chunk - e.first_chunk + 1 for e in res.trace.of_kind("compute")]
    assert not units or max(units) >= min(19, 20 - res.stats.loaded_chunks)
