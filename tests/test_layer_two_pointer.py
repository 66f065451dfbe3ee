"""LayerTwoPointer on the real engine: exact restores along layers, partial stores, faults."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import BatchEngine, LayerTwoPointer, Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.core.bandwidth import BandwidthTrace, Link, oracle_split, trace_suffix_times
from kvrestore.core.keys import chunk_keys
from kvrestore.core.trace import TraceEvent
from kvrestore.planning.auto import Auto
from kvrestore.policies import Decision, Progress
from kvrestore.policies.batch import BatchAware, FifoLanes
from kvrestore.runtime.bookkeeping import apply_event, begin
from kvrestore.sim.simulate import simulate
from kvrestore.stores import ThrottledStore
from kvrestore.stores.memory import MemoryStore

from .conftest import ask, random_tokens, tiny_model

ATOL = 1e-5


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def deep_backend(request) -> HFBackend:
    """A tiny model with enough layers for the two pointers to meet somewhere in between."""
    return HFBackend(tiny_model(request.param, layers=12), name=f"tiny-{request.param}-12")


def full_prefill(backend: HFBackend, tokens: torch.Tensor) -> torch.Tensor:
    return backend.prefill_chunk(tokens, None, 0).data


async def _saved(backend: HFBackend, tokens: torch.Tensor, chunk_size: int = 16) -> tuple[MemoryStore, int]:
    inner = MemoryStore()
    await Restorer(backend, inner, chunk_size=chunk_size).save(tokens)
    return inner, backend.spec.kv_bytes_per_token // backend.spec.num_layers * len(tokens)


def _layers(trace, kind: str) -> set[int]:
    return {j for e in trace.of_kind(kind) for j in range(e.first_chunk, e.last_chunk + 1)}


@pytest.mark.parametrize("scheduler", [BatchAware(), FifoLanes(token_budget=64)], ids=repr)
def test_layer_two_pointer_on_a_batch_engine_equals_full_prefill(deep_backend, scheduler):
    """The batch scheduler runs a layer-axis restore (its units are layers, each 1/L of the prefix's
    prefill) next to a token-wise one: both exact, each layer once, computed layers below loaded ones."""
    tokens = random_tokens(150, deep_backend.spec.vocab_size)
    other = random_tokens(90, deep_backend.spec.vocab_size, seed=7)

    async def main():
        inner, layer_bytes = await _saved(deep_backend, tokens)
        await Restorer(deep_backend, inner, chunk_size=16).save(other[:64])
        store = ThrottledStore(inner, layer_bytes / 0.003)
        async with BatchEngine(scheduler, load_lanes=3) as engine:
            restorer = Restorer(deep_backend, store, chunk_size=16, engine=engine)
            out = {}

            async def one(name, prompt, policy):
                out[name] = await restorer.restore(prompt, policy)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "layers", tokens, LayerTwoPointer())
                tg.start_soon(one, "tokens", other, TokenTwoPointer())
        return out

    out = anyio.run(main)
    res = out["layers"]
    assert res.stats.axis == "layers" and res.stats.failed_loads == 0
    computed, loaded = _layers(res.trace, "compute"), _layers(res.trace, "load")
    assert computed | loaded == set(range(12)) and not computed & loaded
    assert computed == set(range(len(computed)))
    torch.testing.assert_close(res.kv.data, full_prefill(deep_backend, tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(out["tokens"].kv.data, full_prefill(deep_backend, other), atol=ATOL, rtol=0)


def test_auto_may_pick_layer_wise_on_a_batch_engine(deep_backend):
    tokens = random_tokens(150, deep_backend.spec.vocab_size)

    async def main():
        async with BatchEngine() as engine:
            restorer = Restorer(deep_backend, MemoryStore(), chunk_size=16, engine=engine)
            await restorer.save(tokens)
            return await restorer.restore(tokens, Auto([LayerTwoPointer()]))

    res = anyio.run(main)
    assert res.stats.axis == "layers" and res.plan is not None and res.plan.choice.axis == "layers"
    torch.testing.assert_close(res.kv.data, full_prefill(deep_backend, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer_seconds", [0.0002, 0.003, 0.03])
def test_layer_two_pointer_equals_full_prefill(deep_backend, layer_seconds):
    """Loads faster than, near and slower than compute: exact, each layer once, computed layers below
    loaded ones."""
    tokens = random_tokens(150, deep_backend.spec.vocab_size)

    async def main():
        inner, layer_bytes = await _saved(deep_backend, tokens)
        store = ThrottledStore(inner, layer_bytes / layer_seconds)
        return await Restorer(deep_backend, store, chunk_size=16, load_lanes=3).restore(
            tokens, LayerTwoPointer()
        )

    res = anyio.run(main)
    s = res.stats
    assert s.axis == "layers" and s.failed_loads == 0
    computed, loaded = _layers(res.trace, "compute"), _layers(res.trace, "load")
    assert computed | loaded == set(range(12)) and not computed & loaded
    assert computed == set(range(len(computed)))  # a bottom run: the pointers met without crossing
    assert s.computed_layers == len(computed) and s.loaded_layers == len(loaded)
    torch.testing.assert_close(res.kv.data, full_prefill(deep_backend, tokens), atol=ATOL, rtol=0)


def test_speed_moves_the_cutover():
    """A faster link moves the meeting down: the layer pointers load more layers (on the simulated
    clock, so the lanes' speeds are the link's and the cost function's, never the machine's)."""
    layers, layer_s, layer_bytes = 12, 0.01, 1000

    def loaded(load_s: float) -> int:
        result = simulate(
            LayerTwoPointer(),
            [300] * layers,
            [True] * layers,
            lambda a, b, t: (b - a) * layer_s,
            [layer_bytes] * layers,
            Link(BandwidthTrace.constant(layer_bytes / load_s)),
        )
        return len(result.trace.loaded())

    counts = [loaded(s) for s in (0.05, 0.01, 0.002, 0.0001)]  # a layer's load: 5x .. 1/100 of computing it
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_partly_stored_prompt_restores_prefix_by_layers_then_computes_the_rest(deep_backend):
    tokens = random_tokens(150, deep_backend.spec.vocab_size)

    async def main():
        inner, _ = await _saved(deep_backend, tokens[:100])  # chunks 0..5 stored (96 tokens)
        return await Restorer(deep_backend, inner, chunk_size=16).restore(tokens, LayerTwoPointer())

    res = anyio.run(main)
    assert res.stats.hit_chunks == 6 and res.stats.loaded_chunks == 6
    assert res.stats.computed_chunks >= 4 and res.stats.loaded_layers > 0
    torch.testing.assert_close(res.kv.data, full_prefill(deep_backend, tokens), atol=ATOL, rtol=0)


def test_nothing_stored_computes_everything(llama_backend):
    tokens = random_tokens(70, llama_backend.spec.vocab_size)
    res = anyio.run(
        lambda: Restorer(llama_backend, MemoryStore(), chunk_size=16).restore(tokens, LayerTwoPointer())
    )
    assert res.stats.loaded_chunks == 0 and res.stats.computed_chunks == res.stats.n_chunks
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "foreign"])
@pytest.mark.parametrize("which", [0, 3])
def test_damaged_chunk_turns_layers_into_compute(damage, which):
    """A chunk that cannot be used fails its layer reads: those layers are computed, never used."""
    backend = HFBackend(tiny_model("llama", layers=12), name="tiny-llama-12")
    tokens = random_tokens(150, backend.spec.vocab_size)
    key = chunk_keys(tokens, backend.spec.fingerprint, 16)[which].key

    async def main():
        inner, layer_bytes = await _saved(backend, tokens)
        blob = await inner.get(key)
        if damage == "corrupt":
            await inner.put(key, blob[:-10] + bytes(10))
        elif damage == "truncate":
            await inner.put(key, blob[: len(blob) // 2])
        elif damage == "delete":
            await inner.delete(key)
        else:
            await inner.put(
                key, await inner.get(chunk_keys(tokens, backend.spec.fingerprint, 16)[which + 1].key)
            )
        # everything listed as stored; the damage is found only when the layers are read
        store = ThrottledStore(inner, layer_bytes / 0.0005)
        store.contains = _all_present  # type: ignore[method-assign]
        return await Restorer(backend, store, chunk_size=16).restore(tokens, LayerTwoPointer()), inner

    res, inner = anyio.run(main)
    assert res.stats.failed_loads > 0 and res.stats.errors
    assert res.stats.loaded_layers < 12
    torch.testing.assert_close(res.kv.data, full_prefill(backend, tokens), atol=ATOL, rtol=0)
    if damage in ("corrupt", "truncate", "foreign"):
        assert not anyio.run(inner.contains, [key])[0]  # a damaged object is never served again


async def _all_present(keys):
    return [True] * len(keys)


# -- the layer pointers on a simulated clock (no model) ----------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    layers=st.integers(1, 64),
    layer_s=st.floats(0.001, 1.0),
    overhead_frac=st.floats(0.0, 1.0),
    speed=st.floats(0.1, 10.0),
    latency_frac=st.floats(0.0, 0.5),
    lanes=st.integers(1, 4),
    unit=st.integers(1, 4),
)
def test_layer_pointers_meet_once_near_the_best_cutover(
    layers, layer_s, overhead_frac, speed, latency_frac, lanes, unit
):
    """Every layer once; computed layers are a bottom run and loaded ones the top run above it; the
    makespan is at most the best cutover (known costs) plus one unit's time.

    The per-call overhead (up to one layer's time, as in a real model) counts in full per layer in the
    bound: the pointer measures the lane with a single layer and shortens units near the meeting, so it
    cannot always spread the overhead over `unit` layers."""
    layer_bytes = 1000
    overhead = overhead_frac * layer_s
    rate = (
        speed * layer_bytes / layer_s
    )  # `speed` x the rate at which loading a layer takes as long as computing it
    latency = latency_frac * layer_s
    result = simulate(
        LayerTwoPointer(compute_layers=unit),
        [128] * layers,
        [True] * layers,
        lambda a, b, t: overhead + (b - a) * layer_s,
        [layer_bytes] * layers,
        Link(BandwidthTrace.constant(rate), latency_s=latency),
        load_lanes=lanes,
    )
    computed = result.trace.computed()
    loaded = result.trace.loaded()
    assert sorted(computed + loaded) == list(range(layers))
    assert set(computed) == set(range(len(computed))) and set(loaded) == set(range(len(computed), layers))
    compute_s = [layer_s + overhead] * layers
    # with few lanes the round trips no longer overlap: each lane waits latency + transfer per layer
    per_layer = max(layer_bytes / rate, (latency + layer_bytes / rate) / lanes)
    load_suffix = trace_suffix_times(
        [layer_bytes] * layers, BandwidthTrace.constant(layer_bytes / per_layer), latency
    )
    unlimited = trace_suffix_times([layer_bytes] * layers, BandwidthTrace.constant(rate), latency)
    best, _ = oracle_split([layer_s] * layers, unlimited)
    one_layer = max(unit * layer_s + overhead, per_layer + latency)
    assert result.makespan >= best - 1e-9
    assert result.makespan <= oracle_split(compute_s, load_suffix)[0] + one_layer + 1e-9


def test_a_layer_above_loaded_layers_is_never_computed_while_its_fetch_runs():
    """On a batch engine the compute lane may get no turn while the loads take every layer down to
    it: layers 0-2 computed, 3-7 and 9-11 loaded, 8 still in flight and late. Computing layer 8
    would run layers 3-8 (only computing gives the hidden states layer 8 reads), so the layer pointer
    waits for the fetch, where the token pointer, whose chunks need no such thing, computes chunk 8.
    The computed layers stay a bottom run (this restore once computed {0, 1, 2, 8} by luck of timing).
    A layer whose fetch failed is computed whatever lies below it."""
    p = Progress([150] * 12, [True] * 12)
    begin(p, Decision(compute=(0, 3), loads=(11, 10, 9, 8, 7, 6, 5, 4, 3)))
    apply_event(p, TraceEvent("compute", 0, 2, 0.0, 0.3))
    for j in (11, 10, 9, 7, 6, 5, 4, 3):
        apply_event(p, TraceEvent("load", j, j, 0.0, 0.01 * (12 - j), 1000))
    late = p.as_if(now=5.0, free_load_lanes=3)  # layer 8's fetch: five seconds without landing
    assert ask(TokenTwoPointer(), late).compute == (8, 9)
    assert ask(LayerTwoPointer(), late).compute is None
    apply_event(p, TraceEvent("load-failed", 8, 8, 0.0, 5.0, error="damaged"))
    assert ask(LayerTwoPointer(), p.as_if(now=5.0, free_load_lanes=3)).compute == (8, 9)
