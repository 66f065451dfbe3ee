"""Either lane overtakes the other: fetches aside take over a compute unit already running, which stops
at its next layer boundary and is never applied; a unit that ends first keeps its KV and the fetches
are dropped. Every chunk is applied once, and the KV equals a full prefill either way."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

from kvrestore import ComputeOnly, LayerTwoPointer, Restorer, TokenTwoPointer
from kvrestore.backends.floor import ComputeFloor, measure_floor
from kvrestore.core.cancel import checkpoint
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.estimates import Priors
from kvrestore.costs.links import LinkCost
from kvrestore.policies import ChunkStatus, Decision, Progress
from kvrestore.policies.meeting import GRACE, PROBE_SHARE
from kvrestore.restore.layer_wise import WHOLE_CHUNKS
from kvrestore.runtime.bookkeeping import PolicyError, apply_event, begin
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.memory import MemoryStore
from kvrestore.stores.throttled import ThrottledStore
from kvrestore.stores.wrapper import WrapperStore

from .conftest import ask, random_tokens
from .test_profile import make_profile
from .test_two_pointer import ATOL, full_prefill


class HeldCompute:
    """A backend whose compute units wait, layer boundary by layer boundary, until `release` is set:
    a compute lane far slower than any fetch, without a clock. Both ways of computing are held: in place
    (`prefill_into`, whose early stops are counted) and apart (`prefill_chunk`, a unit racing a fetch,
    which the policy may start whatever the timing), so nothing is computed to its end before `release`.
    Everything else is the inner backend's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.running = threading.Event()  # set once a unit in place has passed its first checkpoint
        self.stopped_early = 0  # units in place stopped before `release`

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _hold(self, running: threading.Event | None) -> None:
        while not self.release.wait(0.001):
            checkpoint()  # what the model does before each of its layers
            if running is not None:
                running.set()

    def prefill_into(self, tokens: torch.Tensor, cache: torch.Tensor, start: int) -> None:
        try:
            self._hold(self.running)
        except BaseException:
            self.stopped_early += 1
            raise
        self.inner.prefill_into(tokens, cache, start)

    def prefill_chunk(self, *args: Any, **kwargs: Any) -> Any:
        self._hold(None)
        return self.inner.prefill_chunk(*args, **kwargs)


def _chunks_applied(trace) -> list[int]:
    return sorted(trace.loaded() + trace.computed())


def test_fetches_overtake_a_compute_unit_that_would_never_end(llama_backend):
    """(The store's reads wait until the unit runs: fetches landing before its thread takes it up would
    stop it before it starts, which is another case.)"""
    tokens = random_tokens(200, llama_backend.spec.vocab_size)
    held = HeldCompute(llama_backend)

    async def main():
        store = MemoryStore()
        await Restorer(llama_backend, store, chunk_size=32, learn=False).save(tokens)
        r = Restorer(held, GatedStore(store, held.running), chunk_size=32, learn=False, profile=False)
        with anyio.fail_after(60):  # a unit that is not overtaken never ends: the test would hang
            return await r.restore(tokens, TokenTwoPointer())

    res = anyio.run(main)
    overtaken = res.trace.of_kind("compute-overtaken")
    assert len(overtaken) == 1 and held.stopped_early == 1
    assert overtaken[0].partial is not None and overtaken[0].partial[0] >= 1  # how far it got
    assert res.trace.of_kind("aside") and not res.trace.of_kind("compute")
    assert _chunks_applied(res.trace) == list(range(res.stats.n_chunks))
    assert res.stats.loaded_chunks == res.stats.n_chunks and res.stats.computed_chunks == 0
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_a_unit_that_ends_first_keeps_its_kv_and_drops_the_fetches(llama_backend):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)

    async def main():
        inner = MemoryStore()
        await Restorer(llama_backend, inner, chunk_size=32, learn=False).save(tokens)
        slow = ThrottledStore(inner, 20_000.0)  # seconds a chunk: computing wins every chunk
        r = Restorer(llama_backend, slow, chunk_size=32, learn=False, profile=False)
        with anyio.fail_after(60):  # a dropped fetch is not waited for
            return await r.restore(tokens, TokenTwoPointer())

    res = anyio.run(main)
    assert not res.trace.of_kind("compute-overtaken")
    assert _chunks_applied(res.trace) == list(range(res.stats.n_chunks))
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_only_a_driver_that_can_overtake_fetches_aside():
    p = Progress([256, 256], [True, True])
    begin(p, Decision(compute=(0, 2)))
    with pytest.raises(PolicyError, match="cannot"):
        begin(p, Decision(overtake=(1,)))
    p = Progress([256, 256, 256], [True, True, False])
    p.lanes.can_overtake = True
    with pytest.raises(PolicyError, match="not a stored chunk of the running unit"):
        begin(p, Decision(overtake=(0,)))  # no unit runs
    begin(p, Decision(compute=(0, 2)))
    with pytest.raises(PolicyError, match="not a stored chunk of the running unit"):
        begin(p, Decision(overtake=(2,)))  # outside the unit (and not stored)
    begin(p, Decision(overtake=(1, 0)))
    assert p.loads_in_flight == 2 and p.running.aside == {0: False, 1: False}
    with pytest.raises(PolicyError, match="not a stored chunk of the running unit"):
        begin(p, Decision(overtake=(1,)))  # already fetched aside


def test_an_overtaken_unit_applies_each_chunk_once():
    p = Progress([256, 256, 256], [True, True, False])
    p.lanes.can_overtake = True
    begin(p, Decision(compute=(0, 2)))
    begin(p, Decision(overtake=(0, 1)))
    trace = Trace()
    trace.add(TraceEvent("aside", 1, 1, 0.0, 0.1, 10))
    apply_event(p, trace.events[-1])
    with pytest.raises(PolicyError, match="before they landed"):
        apply_event(p, TraceEvent("compute-overtaken", 0, 1, 0.0, 0.2, 10))
    trace.add(TraceEvent("aside", 0, 0, 0.0, 0.15, 10))
    apply_event(p, trace.events[-1])
    assert p.status[:2] == [ChunkStatus.COMPUTING] * 2 and p.compute_busy  # the unit must stop first
    trace.add(TraceEvent("compute-overtaken", 0, 1, 0.0, 0.2, 20))
    apply_event(p, trace.events[-1])
    assert p.status[:2] == [ChunkStatus.LOADED] * 2 and not p.compute_busy and not p.running.aside
    assert p.loads_in_flight == 0 and trace.bytes_loaded() == 20 and p.done_prefix() == 2


def test_a_unit_that_ends_first_discards_what_landed_aside():
    p = Progress([256, 256], [True, True])
    p.lanes.can_overtake = True
    begin(p, Decision(compute=(0, 2)))
    begin(p, Decision(overtake=(1, 0)))
    trace = Trace(
        [
            TraceEvent("aside", 1, 1, 0.0, 0.1, 10),
            TraceEvent("compute", 0, 1, 0.0, 0.2),
            TraceEvent("aside-dropped", 0, 0, 0.0, 0.25),
        ]
    )
    apply_event(p, trace.events[0])
    apply_event(p, trace.events[1])
    assert p.status == [ChunkStatus.COMPUTED] * 2 and p.running.aside == {0: False}  # one still stopping
    apply_event(p, trace.events[2])
    assert p.finished and p.loads_in_flight == 0 and not p.running.aside and trace.bytes_loaded() == 0


def test_the_two_pointer_waits_for_loads_predicted_to_land_everything_first():
    p = Progress([256] * 4, [True] * 4)
    p.free_load_lanes = 4
    fast = Priors(compute_s=[1.0] * 4, link=(1e-4, 0.001))  # every chunk lands in about 0.1 s: long
    d = ask(TokenTwoPointer(), p, fast)  # before one is computed
    assert d.compute is None and sorted(d.loads) == [0, 1, 2, 3] and d.wake_at is not None
    slow = Priors(compute_s=[1.0] * 4, link=(1e-2, 0.001))  # ten seconds to fetch everything: compute
    d = ask(TokenTwoPointer(), p, slow)  # from the front
    assert d.compute is not None and d.compute[0] == 0


def test_knowing_only_the_compute_floor_it_waits_for_two_fetches_to_judge():
    """A fresh restorer knows no link and no compute cost, only the floor of computing (its FLOPs at
    the device's rate): the compute lane waits for two fetches to land (one fetch's own time ignores
    the lanes beside it), at most `PROBE_SHARE` of the floor of computing everything; then the hold
    rule judges with the floor."""
    n = 32
    p = Progress([256] * n, [True] * n)
    floors = Priors(floor_s=[1.0] * n)
    p.free_load_lanes = 4
    d = ask(TokenTwoPointer(), p, floors)
    assert d.compute is None and d.loads == (31, 30, 29, 28)
    assert d.wake_at == pytest.approx(PROBE_SHARE * n)
    begin(p, d)
    # chunk 31 took 0.1 s: alone, that says 3.2 s for everything, more than chunk 0's floor of 1 s
    p.now, p.free_load_lanes = 0.1, 1
    apply_event(p, TraceEvent("load", 31, 31, 0.0, 0.1, 100))
    d = ask(TokenTwoPointer(), p, floors)
    assert d.compute is None and d.wake_at == pytest.approx(PROBE_SHARE * (n - 1))  # still probing
    begin(p, d)
    # chunk 30 landed 10 ms later: the link delivers a chunk every 10 ms, all by 0.41 s
    p.now = 0.11
    apply_event(p, TraceEvent("load", 30, 30, 0.0, 0.11, 100))
    d = ask(TokenTwoPointer(), p, floors)
    assert d.compute is None and d.wake_at == pytest.approx(0.11 + 30 * 0.01 + GRACE * 1.0)


def test_a_probe_that_sees_no_fetch_land_in_time_computes():
    p = Progress([256] * 4, [True] * 4)
    floors = Priors(floor_s=[1.0] * 4)
    p.free_load_lanes = 4
    begin(p, ask(TokenTwoPointer(), p, floors))
    p.now = PROBE_SHARE * 4.0  # the probe's time is up and no fetch has landed: a slow link
    p.free_load_lanes = 0
    d = ask(TokenTwoPointer(), p, floors)
    assert d.compute is not None and d.compute[0] == 0


def test_stats_seconds_is_the_whole_call(llama_backend):
    """The lookup's round trip counts: a store whose every request waits 50 ms."""
    tokens = random_tokens(64, llama_backend.spec.vocab_size)

    async def main():
        inner = MemoryStore()
        await Restorer(llama_backend, inner, chunk_size=32, learn=False).save(tokens)
        r = Restorer(llama_backend, ThrottledStore(inner, 1e12, latency_s=0.05), chunk_size=32, learn=False)
        return await r.restore(tokens, ComputeOnly())

    res = anyio.run(main)
    assert res.stats.seconds >= 0.05 + max(e.end_s for e in res.trace.events)


def test_a_layer_wise_restore_whose_loads_win_before_any_layer_goes_along_tokens(llama_backend):
    """Predicted to land every layer before the first is computed, a layer-wise restore reads whole
    chunks instead (one read each, not one per layer): the token axis, loads only, exact, and the
    stats say so (the policy asked for, the axis it ran along, and why). A fixed profile decides it:
    a second of compute per layer against a link of a terabyte a second."""
    tokens = random_tokens(96, llama_backend.spec.vocab_size)
    slow_compute = make_profile(
        llama_backend,
        chunk=ChunkCost(1.0, 1e-2, 0.0),
        layer=LayerCost(1.0, 1e-2, 0.0),
        link=LinkCost(1e12, 0.0),
    )

    res = _saved_then_restored(llama_backend, llama_backend, tokens, LayerTwoPointer(), profile=slow_compute)
    assert res.stats.axis == "tokens" and res.stats.loaded_chunks == 3 and res.stats.computed_chunks == 0
    assert res.stats.policy == "layer-wise" and res.stats.handoff == WHOLE_CHUNKS
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


class SlowLayers:
    """A backend whose decoder layers each take `layer_s` (a checkpoint before each, as `HFBackend`
    has), then computes the real KV: a compute lane far slower than a memory store's fetches."""

    def __init__(self, inner: Any, layer_s: float) -> None:
        self.inner, self.layer_s = inner, layer_s
        self.units = 0
        self.running = threading.Event()  # set once a unit has begun its first layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prefill_into(self, tokens: torch.Tensor, cache: torch.Tensor, start: int) -> None:
        self.units += 1
        for _ in range(self.inner.spec.num_layers):
            checkpoint()
            self.running.set()
            threading.Event().wait(self.layer_s)
        self.inner.prefill_into(tokens, cache, start)


def _saved_then_restored(
    backend: Any, restoring: Any, tokens: torch.Tensor, policy: Any, **kwargs: Any
) -> Any:
    """`tokens` saved by `backend` into a fresh memory store, then restored through a fresh restorer
    of `restoring` (32-token chunks, nothing learned kept; `kwargs` go to that restorer)."""

    async def main():
        store = MemoryStore()
        await Restorer(backend, store, chunk_size=32, learn=False).save(tokens)
        return await Restorer(restoring, store, chunk_size=32, learn=False, **kwargs).restore(tokens, policy)

    return anyio.run(main)


class GatedStore(WrapperStore):
    """`inner`, whose reads wait until `gate` is set."""

    def __init__(self, inner: ChunkStore, gate: threading.Event) -> None:
        super().__init__(inner)
        self.gate = gate

    async def get(self, key: str) -> bytes | None:
        await anyio.to_thread.run_sync(self.gate.wait)
        return await self.inner.get(key)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        await anyio.to_thread.run_sync(self.gate.wait)
        return await self.inner.read_into(key, buffer)


@pytest.mark.parametrize("policy", [TokenTwoPointer, LayerTwoPointer])
def test_an_overtaken_unit_teaches_the_two_pointers_to_only_load(llama_backend, policy):
    """A fresh restorer (no profile) on a store far faster than computing: its first restore's unit is
    overtaken part-way, and the planner keeps the compute time the layers it ran imply, apart from
    the cost model (which learned nothing). The next restore, token-wise or layer-wise, knows before it
    starts that the loads land everything first: it starts no unit. (The store's reads wait until the
    first unit has begun a layer, so that it is overtaken part-way and not before its thread takes it
    up.)"""
    tokens = random_tokens(160, llama_backend.spec.vocab_size)
    slow = SlowLayers(llama_backend, layer_s=0.1)  # 0.1 s a layer; the fetches take microseconds

    async def main():
        store = MemoryStore()
        await Restorer(llama_backend, store, chunk_size=32, learn=False).save(tokens)
        r = Restorer(slow, GatedStore(store, slow.running), chunk_size=32, learn=False, profile=False)
        first = await r.restore(tokens, TokenTwoPointer())
        hint, samples = r.planner.overtaken_s_per_token, r.planner.costs.compute_samples
        second = await r.restore(tokens, policy())
        return first, hint, samples, second

    first, hint, samples, second = anyio.run(main)
    (overtaken,) = first.trace.of_kind("compute-overtaken")
    layers, seconds = overtaken.partial
    assert 1 <= layers < llama_backend.spec.num_layers
    unit_tokens = 32 * (overtaken.last_chunk - overtaken.first_chunk + 1)
    assert hint == pytest.approx(seconds * llama_backend.spec.num_layers / layers / unit_tokens)
    assert samples == 0 and slow.units == 1  # the cost model is untouched; the second started no unit
    assert second.stats.loaded_chunks == second.stats.n_chunks and second.stats.computed_chunks == 0
    torch.testing.assert_close(second.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


class SlowFloored(SlowLayers):
    """`SlowLayers` whose compute floor says so too (a layer of `layer_s` at the least)."""

    def compute_floor_s(self, n_tokens: int) -> float:
        return self.layer_s * self.inner.spec.num_layers


def test_a_fresh_restorer_that_knows_the_floor_starts_no_unit_on_a_fast_store(llama_backend):
    """No profile, nothing learned, but a compute floor far above what the store needs: the first
    restore waits for the first fetch, sees the loads will land everything first, and only loads.

    The floor is 30 s a chunk, so the restore waits up to `PROBE_SHARE` of the prompt's (7.5 s) for
    two fetches from memory to land: on a machine however busy (with a floor of 0.3 s a chunk, the
    75 ms wait ran out on a loaded 2-core machine and a unit started). No unit runs, so the test
    takes what the loads take."""
    tokens = random_tokens(160, llama_backend.spec.vocab_size)
    slow = SlowFloored(llama_backend, layer_s=10.0)

    res = _saved_then_restored(llama_backend, slow, tokens, TokenTwoPointer(), profile=False)
    assert slow.units == 0 and res.stats.loaded_chunks == res.stats.n_chunks
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_the_compute_floor_counts_two_flops_a_weight_at_the_measured_rate(llama_backend):
    layers = llama_backend._layers
    floor = measure_floor(layers, llama_backend.dtype, llama_backend.device)
    weights = sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() == 2)
    assert floor.flops_per_token == 2 * weights and floor.flops_per_s > 0
    assert floor.seconds(256) == pytest.approx(2 * floor.seconds(128))
    assert ComputeFloor(1e9, 1e12).seconds(1000) == pytest.approx(1.0)
    llama_backend.compute_floor_s(1)
    kept = llama_backend._floor_s_per_token
    assert llama_backend.compute_floor_s(64) == pytest.approx(64 * kept)
    assert llama_backend._floor_s_per_token == kept  # measured once per backend


class SilentLink(ThrottledStore):
    """A throttled store that shows a read's bytes only once it has finished (`delivered_bytes` None),
    as most stores do: what a restore knows of the link comes from fetches landing or not."""

    def delivered_bytes(self) -> float | None:
        return None


class FixedFloor(SlowLayers):
    """`SlowLayers` whose compute floor is `floor_s` a token, whatever the machine measures."""

    def __init__(self, inner: Any, layer_s: float, floor_s: float) -> None:
        super().__init__(inner, layer_s)
        self.floor_s = floor_s

    def compute_floor_s(self, n_tokens: int) -> float:
        return self.floor_s * n_tokens


def test_a_link_no_fetch_lands_on_is_learned_as_a_bound(llama_backend):
    """A store so slow that no fetch lands while the prompt computes (100 bytes/s): the first restore
    computes in several units while it waits for fetches; the planner keeps the bound their time in
    flight sets on the link (`silent_s_per_token`), and the next restore, knowing from the start that
    no fetch can land in time, computes every chunk in one unit, the last stored chunk fetched aside
    meanwhile to keep that bound current.

    Nothing here depends on the machine's speed: the floor is fixed (1 us a token), the store shows no
    bytes arriving, so the first restore knows nothing of its link and starts with a one-chunk unit;
    each unit sleeps at least 3 layers x 20 ms, so a fetch dropped after the first unit sets a bound of
    at least 60 ms / 256 tokens, and a 32-token fetch (>= 7.5 ms by that bound) cannot land before the
    whole prompt's floor (0.26 ms) has passed: a slower machine only makes both margins larger."""
    tokens = random_tokens(256, llama_backend.spec.vocab_size)
    slow = FixedFloor(llama_backend, layer_s=0.02, floor_s=1e-6)

    async def main():
        store = MemoryStore()
        await Restorer(llama_backend, store, chunk_size=32, learn=False).save(tokens)
        r = Restorer(slow, SilentLink(store, 100.0), chunk_size=32, learn=False, profile=False)
        first = await r.restore(tokens, TokenTwoPointer())
        bound = r.planner.silent_s_per_token
        second = await r.restore(tokens, TokenTwoPointer())
        return first, bound, second

    first, bound, second = anyio.run(main)
    assert first.stats.loaded_chunks == 0 and len(first.trace.of_kind("compute")) > 1
    dropped = first.trace.of_kind("load-dropped")
    assert bound is not None and bound >= max(e.seconds for e in dropped) / (32 * len(dropped))
    assert [(e.first_chunk, e.last_chunk) for e in second.trace.of_kind("compute")] == [(0, 7)]
    assert [e.first_chunk for e in second.trace.events if e.kind.startswith("aside")] == [7]
    torch.testing.assert_close(second.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)
