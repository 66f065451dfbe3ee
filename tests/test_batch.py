"""Batch scheduling: the schedulers' rules (simulated clock) and the BatchEngine on real tiny models."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.keys import chunk_keys
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.estimates import Estimates
from kvrestore.policies import ComputeOnly, Progress
from kvrestore.policies.base import ChunkStatus
from kvrestore.policies.batch import BatchAware, BatchJob, FifoLanes
from kvrestore.runtime.batch_engine import BatchEngine, EngineNotRunningError
from kvrestore.runtime.request import FastPaths, RunRequest
from kvrestore.sim.batch import sim_requests, simulate_batch, simulate_independent
from kvrestore.sim.compare import batch_lower_bound
from kvrestore.sim.workload import Request
from kvrestore.stores import ThrottledStore
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens, tiny_model

COST = ChunkCost(fixed_s=0.002, per_token_s=1e-4, per_token_past_s=2e-7, per_token2_s=1e-8)
KV_PER_TOKEN = 1000


# -- the schedulers' rules, one decision at a time ---------------------------------------------------


def _job(i, kind, tokens, stored, arrival=0.0):
    p = Progress(list(tokens), list(stored))
    past, cost = 0, []
    for n in tokens:
        cost.append(COST.seconds(n, past))
        past += n
    policy = TokenTwoPointer() if kind == "restore" else ComputeOnly()
    return BatchJob(i, kind, p, policy, arrival, cost, estimate=Estimates)


def test_scheduling_is_a_pure_decision():
    """Asking for a step or for loads changes no job's progress (bookkeeping does, when it begins them)."""
    jobs = [_job(0, "restore", [256] * 6, [True] * 6, arrival=0.5), _job(1, "prefill", [256], [False])]
    before = [dataclasses.replace(j.progress) for j in jobs]
    for scheduler in (BatchAware(), FifoLanes()):
        scheduler.compute_step(jobs, now=2.0)
        scheduler.load_grants(jobs, 3, now=2.0)
    assert [j.progress for j in jobs] == before


def test_batch_aware_computes_decode_then_prefill_then_the_shortest_restore():
    jobs = [
        _job(0, "restore", [256] * 8, [True] * 8),
        _job(1, "restore", [256] * 2, [True] * 2, arrival=1.0),
        _job(2, "prefill", [256], [False], arrival=2.0),
        _job(3, "decode", [1], [False], arrival=3.0),
    ]
    step = BatchAware(token_budget=512).compute_step(jobs, now=3.0)
    order = [u.job for u in step.units]
    assert order[:2] == [3, 2]  # Cake's order: decode, then the uncached prefill
    assert sum(jobs[u.job].progress.chunk_tokens[u.a] * (u.b - u.a) for u in step.units) <= 512
    fifo = FifoLanes(token_budget=512).compute_step(jobs, now=3.0)
    assert [u.job for u in fifo.units][0] == 0  # first come, first served
    # among restores alone: the one with the least recomputation left goes first
    step = BatchAware(token_budget=256).compute_step(jobs[:2], now=3.0)
    assert [u.job for u in step.units] == [1] and step.passed_over == (0,)


def test_batch_aware_gives_load_lanes_where_a_load_saves_the_most_compute():
    jobs = [
        _job(0, "restore", [256] * 2, [True] * 2),
        _job(1, "restore", [256] * 12, [True] * 12, arrival=1.0),
    ]
    grant = BatchAware().load_grants(jobs, free_lanes=3, now=1.0)
    assert [j for j, _ in grant.loads] == [1, 1, 1]  # the long prompt's far chunks first
    assert [i for _, i in grant.loads] == [11, 10, 9]  # its own pointer picks them: from the back
    assert [j for j, _ in FifoLanes().load_grants(jobs, free_lanes=3, now=1.0).loads][0] == 0


def test_a_chunk_larger_than_the_budget_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="token budget"):
        BatchAware(token_budget=128).check(_job(0, "restore", [256], [True]))
    with pytest.raises(ValueError, match="token_budget"):
        BatchAware(token_budget=0)
    with pytest.raises(ValueError, match="kind"):
        _job(0, "nonsense", [1], [False])


# -- the simulator: properties over random batches ------------------------------------------------------

requests = st.lists(
    st.tuples(
        st.floats(0.0, 2.0),  # arrival
        st.sampled_from(["restore", "restore", "prefill", "decode"]),
        st.integers(1, 2000),  # prefix (restore: stored; decode: context)
        st.integers(1, 200),  # new tokens
    ),
    min_size=1,
    max_size=12,
)


def _workload(raw):
    out = []
    for arrival, kind, prefix, new in raw:
        if kind == "prefill":
            prefix = 0
        if kind == "decode":
            new = 1
        out.append(Request(arrival, kind, prefix, new))
    return out


@settings(max_examples=120, deadline=None)
@given(
    raw=requests,
    speed=st.floats(0.05, 20.0),
    lanes=st.integers(1, 4),
    budget=st.sampled_from([256, 512, 1024]),
    aware=st.booleans(),
    max_skipped=st.integers(0, 6),
)
def test_batch_schedules_keep_every_rule(raw, speed, lanes, budget, aware, max_skipped):
    """The budget is never exceeded; every chunk of every request is computed or loaded exactly once,
    loads only of stored chunks, and the pointers never cross; a job that wants compute is passed over at most `max_skipped_steps`
    plus the number of jobs steps in a row; every request finishes."""
    workload = _workload(raw)
    reqs = sim_requests(workload, COST, KV_PER_TOKEN, 256, TokenTwoPointer)
    cls = BatchAware if aware else FifoLanes
    scheduler = cls(token_budget=budget, max_skipped_steps=max_skipped)
    link = Link(BandwidthTrace.constant(speed * KV_PER_TOKEN / COST.per_token_s), latency_s=0.0005)
    res = simulate_batch(scheduler, reqs, link, load_lanes=lanes)
    for _, units in res.steps:
        assert sum(sum(reqs[u.job].chunk_tokens[u.a : u.b]) for u in units) <= budget
        assert len({u.job for u in units}) == len(units)  # one unit per job per step
    for r, trace, progress in zip(reqs, res.traces, res.progress, strict=True):
        computed = [j for e in trace.of_kind("compute") for j in range(e.first_chunk, e.last_chunk + 1)]
        loaded = [e.first_chunk for e in trace.of_kind("load")]
        assert sorted(computed + loaded) == list(range(len(r.chunk_tokens)))
        assert all(r.stored[i] for i in loaded)
        # the two pointers never cross: stored chunks computed from the front, loaded from the back
        assert max((j for j in computed if r.stored[j]), default=-1) < min(loaded, default=len(r.stored))
        assert all(s is ChunkStatus.COMPUTED or s is ChunkStatus.LOADED for s in progress.status)
    assert all(t >= 0 for t in res.ttft_s)
    assert max(res.max_skipped) <= max_skipped + len(reqs)


@settings(max_examples=60, deadline=None)
@given(raw=requests, speed=st.floats(0.05, 20.0), lanes=st.integers(1, 4))
def test_independent_restores_finish_every_chunk_once(raw, speed, lanes):
    workload = _workload(raw)
    reqs = sim_requests(workload, COST, KV_PER_TOKEN, 256, TokenTwoPointer)
    link = Link(BandwidthTrace.constant(speed * KV_PER_TOKEN / COST.per_token_s), latency_s=0.0005)
    res = simulate_independent(reqs, link, load_lanes=lanes)
    for r, trace in zip(reqs, res.traces, strict=True):
        computed = [j for e in trace.of_kind("compute") for j in range(e.first_chunk, e.last_chunk + 1)]
        loaded = [e.first_chunk for e in trace.of_kind("load")]
        assert sorted(computed + loaded) == list(range(len(r.chunk_tokens)))


def test_a_long_restore_gives_way_to_a_burst_of_short_prompts():
    """Cake §5.8: FIFO finishes the long restore first while the short prompts wait; the batch-aware
    scheduler computes the short prompts and loads the long one meanwhile."""
    workload = [Request(0.0, "restore", 4096, 32)] + [Request(0.01, "prefill", 0, 200) for _ in range(10)]
    out = {}
    for scheduler in (FifoLanes(), BatchAware()):
        reqs = sim_requests(workload, COST, KV_PER_TOKEN, 256, TokenTwoPointer)
        restore_s = reqs[0].compute_cost(0, len(reqs[0].chunk_tokens))
        link = Link(BandwidthTrace.constant(4096 * KV_PER_TOKEN / restore_s), latency_s=0.0005)
        out[scheduler.name] = simulate_batch(scheduler, reqs, link)
    fifo, aware = out["fifo"], out["batch-aware"]
    assert max(aware.ttft_s[1:]) < min(fifo.ttft_s[1:])  # every short prompt is served sooner
    assert aware.makespan < fifo.makespan


# -- the BatchEngine on real (tiny) models ------------------------------------------------------------


@pytest.fixture
def deep_backend() -> HFBackend:
    return HFBackend(tiny_model("llama", layers=4), name="tiny-llama-4")


def _prompts(backend, lengths):
    return [random_tokens(n, backend.spec.vocab_size, seed=10 + i) for i, n in enumerate(lengths)]


async def _saved_store(backend, prompts, fraction=0.75):
    inner = MemoryStore()
    saver = Restorer(backend, inner, chunk_size=16)
    for p in prompts:
        n = int(len(p) * fraction)
        if n:
            await saver.save(p[:n])
    return inner


@pytest.mark.parametrize("scheduler", [BatchAware(token_budget=32), FifoLanes(token_budget=48)], ids=repr)
def test_concurrent_restores_on_a_batch_engine_equal_full_prefills(deep_backend, scheduler):
    lengths = [40, 200, 90, 300, 17, 150]
    prompts = _prompts(deep_backend, lengths)

    async def main():
        inner = await _saved_store(deep_backend, prompts[:-1])  # the last prompt is uncached: a prefill
        store = ThrottledStore(inner, 3e6, latency_s=0.0005)
        async with BatchEngine(scheduler) as engine:
            restorer = Restorer(deep_backend, store, chunk_size=16, engine=engine)
            out = [None] * len(prompts)

            async def one(i):
                await anyio.sleep(0.002 * i)
                out[i] = await restorer.restore(prompts[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            decoded = await engine.compute(lambda: "decode step ran")
        return out, decoded

    out, decoded = anyio.run(main)
    assert decoded == "decode step ran"
    for p, res in zip(prompts, out, strict=True):
        full = deep_backend.prefill_chunk(p, None, 0).data
        torch.testing.assert_close(res.kv.data, full, atol=1e-5, rtol=0)
        assert res.stats.policy == "two-pointer" and res.plan is None  # the engine's default policy
        assert res.stats.computed_chunks + res.stats.loaded_chunks == res.stats.n_chunks
    assert sum(r.stats.loaded_chunks for r in out) > 0


def test_batch_engine_recomputes_a_damaged_chunk_and_a_cancelled_restore_stops(deep_backend):
    prompts = _prompts(deep_backend, [160, 160])

    async def main():
        inner = await _saved_store(deep_backend, prompts, fraction=1.0)
        keys = [r.key for r in chunk_keys(prompts[0], deep_backend.spec.fingerprint, 16)]
        blob = bytearray(await inner.get(keys[-1]))
        blob[len(blob) // 2] ^= 0xFF
        await inner.put(keys[-1], bytes(blob))  # a corrupt chunk: a miss, recomputed
        store = ThrottledStore(inner, 2e5)  # slow: the second restore is still running when cancelled
        async with BatchEngine(BatchAware(token_budget=32)) as engine:
            # the damaged chunk straight from memory: through the slow link the compute lane would reach
            # it first and drop its load (a chunk is verified once its bytes have arrived)
            fast = Restorer(deep_backend, inner, chunk_size=16, engine=engine)
            damaged = await fast.restore(prompts[0], TokenTwoPointer())
            restorer = Restorer(deep_backend, store, chunk_size=16, engine=engine)
            with anyio.CancelScope() as scope:  # cancelled as soon as its first unit lands
                await restorer.restore(prompts[1], on_event=lambda event: scope.cancel())
            left = dict(engine._live)  # the cancelled restore returned only once none of its units ran
            after = await restorer.restore(prompts[0][:64])  # the engine goes on serving
        return damaged, scope.cancelled_caught, left, after

    damaged, cancelled, left, after = anyio.run(main)
    assert cancelled and not left
    assert damaged.stats.failed_loads >= 1 and damaged.stats.errors
    torch.testing.assert_close(
        damaged.kv.data, deep_backend.prefill_chunk(prompts[0], None, 0).data, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        after.kv.data, deep_backend.prefill_chunk(prompts[0][:64], None, 0).data, atol=1e-5, rtol=0
    )


def test_a_failing_compute_unit_fails_only_its_own_restore(deep_backend):
    prompts = _prompts(deep_backend, [64, 64])

    async def main():
        async with BatchEngine() as engine:
            restorer = Restorer(deep_backend, MemoryStore(), chunk_size=16, engine=engine)
            results = {}

            async def good():
                results["good"] = await restorer.restore(prompts[0])

            async def bad():
                def boom(a, b):
                    raise RuntimeError("device lost")

                async def no_load(i):
                    raise AssertionError("nothing is stored")

                try:
                    await engine.run(
                        RunRequest(Progress([16] * 4, [False] * 4), ComputeOnly(), boom, no_load)
                    )
                except RuntimeError as exc:
                    results["bad"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(good)
                tg.start_soon(bad)
        return results

    results = anyio.run(main)
    assert "device lost" in str(results["bad"])
    torch.testing.assert_close(
        results["good"].kv.data, deep_backend.prefill_chunk(prompts[0], None, 0).data, atol=1e-5, rtol=0
    )


def test_batch_engine_errors_name_the_problem(deep_backend):
    tokens = random_tokens(32, deep_backend.spec.vocab_size)

    async def not_entered():
        await Restorer(deep_backend, MemoryStore(), chunk_size=16, engine=BatchEngine()).restore(tokens)

    with pytest.raises(EngineNotRunningError, match="async with"):
        anyio.run(not_entered)

    async def too_big_chunks():
        async with BatchEngine(BatchAware(token_budget=8)) as engine:
            await Restorer(deep_backend, MemoryStore(), chunk_size=16, engine=engine).restore(tokens)

    with pytest.raises(ValueError, match="token budget"):
        anyio.run(too_big_chunks)

    async def fast_paths():
        async def load(i):
            return 0

        async with BatchEngine() as engine:
            request = RunRequest(Progress([16] * 2, [True] * 2), ComputeOnly(), lambda a, b: None, load)
            await engine.run(dataclasses.replace(request, fast_paths=FastPaths(load_now=lambda i: 0)))

    with pytest.raises(InvalidInputError, match="runs no fast paths"):  # never silently ignored
        anyio.run(fast_paths)


def test_a_broken_policy_fails_its_restore_and_the_engine_serves_on(deep_backend):
    tokens = random_tokens(64, deep_backend.spec.vocab_size)

    class Broken(ComputeOnly):
        def decide(self, progress, estimates):
            raise RuntimeError("policy bug")

    async def main():
        async with BatchEngine() as engine:
            restorer = Restorer(deep_backend, MemoryStore(), chunk_size=16, engine=engine)
            with pytest.raises(RuntimeError, match="policy bug"):
                await restorer.restore(tokens, Broken())
            return await restorer.restore(tokens)

    res = anyio.run(main)
    torch.testing.assert_close(
        res.kv.data, deep_backend.prefill_chunk(tokens, None, 0).data, atol=1e-5, rtol=0
    )


@settings(max_examples=80, deadline=None)
@given(raw=requests, speed=st.floats(0.05, 20.0), lanes=st.integers(1, 4), aware=st.booleans())
def test_no_schedule_beats_the_lower_bound(raw, speed, lanes, aware):
    """`batch_lower_bound` is a bound: neither scheduler nor independent restores finish a batch sooner."""
    workload = [Request(0.0, r.kind, r.prefix_tokens, r.new_tokens) for r in _workload(raw)]
    bps = speed * KV_PER_TOKEN / COST.per_token_s
    bound = batch_lower_bound(workload, COST, KV_PER_TOKEN, 256, bps)
    reqs = sim_requests(workload, COST, KV_PER_TOKEN, 256, TokenTwoPointer)
    link = Link(BandwidthTrace.constant(bps))
    scheduler = BatchAware() if aware else FifoLanes()
    assert simulate_batch(scheduler, reqs, link, lanes).makespan >= bound * (1 - 1e-9)
    reqs = sim_requests(workload, COST, KV_PER_TOKEN, 256, TokenTwoPointer)
    assert simulate_independent(reqs, Link(BandwidthTrace.constant(bps)), lanes).makespan >= bound * (
        1 - 1e-9
    )
    assert bound > 0
