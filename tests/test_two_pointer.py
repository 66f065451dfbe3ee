"""TokenTwoPointer on the real engine: exact restores through a throttled store, drops, cancellation,
and ThrottledStore's delivery."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

from kvrestore import Restorer, TokenTwoPointer
from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.keys import chunk_keys
from kvrestore.policies import ChunkStatus, Decision, Policy, Progress
from kvrestore.policies.base import Estimates
from kvrestore.runtime.engine import Engine
from kvrestore.runtime.request import RunRequest
from kvrestore.sim.simulate import simulate
from kvrestore.stores import BoundedStore, ThrottledStore
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens

ATOL = 1e-5


def full_prefill(backend, tokens):
    return backend.prefill_chunk(tokens, None, 0).data


@pytest.mark.parametrize("seconds_per_chunk", [0.0005, 0.004, 0.03])
def test_two_pointer_restore_equals_full_prefill(tiny_backend, seconds_per_chunk):
    """At loads faster than, near, and slower than compute: exact, and every chunk exactly once."""
    tokens = random_tokens(200, tiny_backend.spec.vocab_size)

    async def main():
        inner = MemoryStore()
        await Restorer(tiny_backend, inner, chunk_size=16).save(tokens)
        chunk_bytes = len(await inner.get(chunk_keys(tokens, tiny_backend.spec.fingerprint, 16)[0].key))
        store = ThrottledStore(inner, chunk_bytes / seconds_per_chunk)
        r = Restorer(tiny_backend, store, chunk_size=16, load_lanes=3)
        return await r.restore(tokens, TokenTwoPointer(compute_chunks=2))

    res = anyio.run(main)
    s = res.stats
    assert s.computed_chunks + s.loaded_chunks == s.n_chunks == 13
    assert s.failed_loads == 0
    computed = {j for e in res.trace.of_kind("compute") for j in range(e.first_chunk, e.last_chunk + 1)}
    loaded = {e.first_chunk for e in res.trace.of_kind("load")}
    assert not computed & loaded
    assert computed == set(range(len(computed)))  # the pointers met without crossing
    torch.testing.assert_close(res.kv.data, full_prefill(tiny_backend, tokens), atol=ATOL, rtol=0)


def test_faster_link_loads_more():
    """The same prompt over a link ten times faster: the loads take more of it (on the simulated clock,
    where the engine's own driver loop runs the policy without timing noise)."""

    def loaded(bytes_per_s: float) -> int:
        link = Link(BandwidthTrace.constant(bytes_per_s))
        res = simulate(
            TokenTwoPointer(), [16] * 20, [True] * 20, lambda a, b, _t: 0.01 * (b - a), [1000] * 20, link
        )
        assert sorted(res.trace.loaded() + res.trace.computed()) == list(range(20))
        return len(res.trace.loaded())

    # at 2e5 B/s a chunk takes 5 ms to fetch (computing it 10 ms); at 2e6, 0.5 ms
    slow, fast = loaded(2e5), loaded(2e6)
    assert 0 < slow < fast


class Fake:
    """Compute and load functions for the engine without a model: each writes who produced a chunk."""

    def __init__(self, n: int, compute_s: float, load_s: float, blocking_loads: bool = False):
        self.cells: list[str | None] = [None] * n
        self.compute_s, self.load_s, self.blocking = compute_s, load_s, blocking_loads
        self.applied: list[int] = []

    def compute(self, a: int, b: int) -> None:
        time.sleep(self.compute_s * (b - a))
        for j in range(a, b):
            self.cells[j] = "compute"

    async def load(self, i: int) -> int:
        def write() -> None:
            time.sleep(self.load_s)
            self.cells[i] = "load"

        if self.blocking:  # like a read into the cache's rows: cannot be interrupted
            await anyio.to_thread.run_sync(write, abandon_on_cancel=False)
        else:
            await anyio.sleep(self.load_s)
            self.cells[i] = "load"
        return 1


@pytest.mark.parametrize("blocking", [False, True])
def test_a_dropped_load_never_lands_over_the_computed_chunk(blocking):
    """Loads much slower than compute: the compute lane catches up with fetches in flight and drops
    them; a dropped fetch that was already writing finishes before the compute unit writes."""
    n = 6
    fake = Fake(n, compute_s=0.01, load_s=0.25, blocking_loads=blocking)
    progress = Progress([16] * n, [True] * n)
    request = RunRequest(progress, TokenTwoPointer(1), fake.compute, fake.load)
    trace = anyio.run(lambda: Engine(load_lanes=n).run(request))
    dropped = {e.first_chunk for e in trace.of_kind("load-dropped")}
    computed = {j for e in trace.of_kind("compute") for j in range(e.first_chunk, e.last_chunk + 1)}
    assert dropped and dropped <= computed
    assert all(fake.cells[j] == "compute" for j in computed)
    assert all(fake.cells[e.first_chunk] == "load" for e in trace.of_kind("load"))
    assert progress.loads_in_flight == 0 and progress.finished


def test_waiting_policy_is_woken_without_an_event():
    """A decision with `wake_at` and nothing finishing before then is asked again at that time."""

    class WaitThenCompute(Policy):
        def __init__(self):
            self.calls = []

        def decide(self, p: Progress, estimates: Estimates) -> Decision:
            self.calls.append((p.now, p.status[1]))
            if p.status[1].value == "pending":
                return Decision(loads=(1,), wake_at=0.05)
            if p.now >= 0.05 and p.status[0].value == "pending":
                return Decision(compute=(0, 1))
            return Decision()

    policy = WaitThenCompute()

    async def slow_load(i):
        await anyio.sleep(0.3)
        return 1

    progress = Progress([1, 1], [True, True])
    anyio.run(lambda: Engine().run(RunRequest(progress, policy, lambda a, b: None, slow_load)))
    # woken by the clock, not by the load: asked again at wake_at while the load was still in flight
    assert any(t >= 0.05 and status == ChunkStatus.LOADING for t, status in policy.calls), policy.calls


def test_cancelled_two_pointer_restore_leaves_nothing_running(llama_backend):
    tokens = random_tokens(2048, llama_backend.spec.vocab_size)  # 128 chunks: far from done at 50 ms

    async def main():
        inner = MemoryStore()
        await Restorer(llama_backend, inner, chunk_size=16).save(tokens)
        store = ThrottledStore(inner, 2e5)
        r = Restorer(llama_backend, store, chunk_size=16)
        threads = threading.active_count()
        with anyio.move_on_after(0.05) as scope:
            await r.restore(tokens, TokenTwoPointer())
        assert scope.cancelled_caught
        store.reset()
        res = await r.restore(tokens, TokenTwoPointer())  # the same engine and lanes still work
        assert threading.active_count() <= threads + 1
        return res.kv.data

    torch.testing.assert_close(anyio.run(main), full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


# -- ThrottledStore ---------------------------------------------------------------------------------


class SimulatedThrottledStore(ThrottledStore):
    """A ThrottledStore on a simulated clock: waiting on the link moves the clock, no time passes, so what
    the link delivers when is asserted exactly (speed itself lives in benchmarks/)."""

    def reset(self) -> None:
        self.now = 0.0
        super().reset()

    def clock(self) -> float:
        return self.now

    async def _sleep(self, seconds: float) -> None:
        self.now = max(self.now, self.clock() + seconds)  # concurrent waits end at the latest of them
        await anyio.sleep(0)


def test_throttled_store_delivers_at_its_rate_shared_by_concurrent_reads():
    async def main():
        inner = MemoryStore()
        for k in ("aa" * 8, "bb" * 8):
            await inner.put(k, b"x" * 50_000)
        store = SimulatedThrottledStore(inner, 1e6)  # 50 ms per object
        await store.get("aa" * 8)
        one = store.clock()
        store.reset()
        finished = {}

        async def read(key):
            await store.get(key)
            finished[key] = store.clock()

        async with anyio.create_task_group() as tg:
            for k in ("aa" * 8, "bb" * 8):
                tg.start_soon(read, k)
        return one, finished

    one, finished = anyio.run(main)
    assert one == pytest.approx(0.05)
    # one link: the first read is delivered at 50 ms, the second, queued behind it, at 100 ms
    assert sorted(finished.values()) == pytest.approx([0.05, 0.10])


def test_throttled_store_follows_a_trace_and_latency():
    trace = BandwidthTrace(((0.0, 1e5), (0.05, 1e7)))

    async def main():
        inner = MemoryStore()
        await inner.put("cc" * 8, b"y" * 10_000)
        store = SimulatedThrottledStore(inner, trace=trace, latency_s=0.02)
        data = await store.get("cc" * 8)
        took = store.clock()
        assert data == b"y" * 10_000
        assert await store.contains(["cc" * 8, "dd" * 8]) == [True, False]
        assert store.clock() == pytest.approx(took + 0.02)  # a lookup costs one round trip
        assert await store.get("dd" * 8) is None
        return took

    # 20 ms latency, then 3 kB by 50 ms at 100 kB/s, the remaining 7 kB at 10 MB/s: 50.7 ms
    assert anyio.run(main) == pytest.approx(0.0507, abs=1e-4)


def test_throttled_store_validates_its_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        ThrottledStore(MemoryStore())
    with pytest.raises(ValueError, match="exactly one"):
        ThrottledStore(MemoryStore(), 1e6, trace=BandwidthTrace.constant(1e6))
    with pytest.raises(ValueError, match="positive"):
        ThrottledStore(MemoryStore(), -1)
    with pytest.raises(ValueError, match="increase"):
        BandwidthTrace(((0.0, 1.0), (0.0, 2.0)))
    with pytest.raises(ValueError, match="last one > 0"):
        BandwidthTrace(((0.0, 1.0), (1.0, 0.0)))


def test_a_link_counts_the_bytes_of_the_transfer_crossing_it():
    """`Link.delivered`: transfers cross one after another after their latency, and the one crossing
    now counts the part that has arrived, at the trace's rate."""
    link = Link(BandwidthTrace(((0.0, 100.0), (1.0, 10.0))), latency_s=0.5)
    assert link.reserve(0.0, 50) == pytest.approx(1.0)  # 0.5 s of latency, then 50 bytes at 100/s
    assert link.reserve(0.0, 20) == pytest.approx(3.0)  # behind it, at 10/s
    assert link.delivered(0.5) == 0.0
    assert link.delivered(0.75) == pytest.approx(25.0)
    assert link.delivered(2.0) == pytest.approx(60.0)
    assert link.delivered(5.0) == pytest.approx(70.0)
    link.reset()
    assert link.delivered(5.0) == 0.0


def test_a_throttled_store_says_what_its_link_has_delivered():
    async def main():
        inner = MemoryStore()
        for k in ("aa" * 8, "bb" * 8):
            await inner.put(k, b"x" * 50_000)
        store = SimulatedThrottledStore(inner, 1e6)
        assert inner.delivered_bytes() is None  # a store that sees bytes only once a read is done
        async with anyio.create_task_group() as tg:
            for k in ("aa" * 8, "bb" * 8):
                tg.start_soon(store.get, k)
        return store.delivered_bytes(), BoundedStore(store, 10**9).delivered_bytes()

    assert anyio.run(main) == (100_000, 100_000)  # a wrapper passes its inner store's count on


def test_a_fresh_restore_over_a_hopeless_link_computes_in_few_units(tiny_backend):
    """Nothing known of a link too slow for any fetch to land before computing ends: the bytes the
    store shows arriving give the link's rate within the first units, and the compute lane then takes
    every chunk left in one unit (judged on the guess that a fetch needs as long again as it has been
    in flight, it would go on in units of two: seven units for thirteen chunks). Exact."""
    tokens = random_tokens(200, tiny_backend.spec.vocab_size)

    async def main():
        inner = MemoryStore()
        await Restorer(tiny_backend, inner, chunk_size=16).save(tokens)
        chunk_bytes = len(await inner.get(chunk_keys(tokens, tiny_backend.spec.fingerprint, 16)[0].key))
        store = ThrottledStore(inner, chunk_bytes / 100.0)  # 100 s a chunk
        return await Restorer(tiny_backend, store, chunk_size=16).restore(tokens, TokenTwoPointer(2))

    res = anyio.run(main)
    assert res.stats.computed_chunks == res.stats.n_chunks == 13
    assert len(res.trace.of_kind("compute")) <= 3
    torch.testing.assert_close(res.kv.data, full_prefill(tiny_backend, tokens), atol=ATOL, rtol=0)


def test_bandwidth_trace_arithmetic():
    trace = BandwidthTrace(((0.0, 10.0), (1.0, 0.0), (2.0, 5.0)))
    assert trace.finish_time(0.0, 10) == pytest.approx(1.0)
    assert trace.finish_time(0.5, 10) == pytest.approx(3.0)  # 5 bytes, a stall, then 5 at 5/s
    assert trace.bytes_between(0.0, 3.0) == pytest.approx(15.0)
    assert trace.rate_at(1.5) == 0.0 and trace.rate_at(99) == 5.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("through", ["lane-threads", "async-store"])
def test_two_pointer_on_cuda_streams_is_exact(through):
    """On CUDA: compute on the compute lane's stream, loads through pinned memory on the load stream,
    from a store read on the lane threads (memory) and from one read by async tasks (a fast throttle).
    Only the first half of the prompt is stored, so the second half is computed whatever the race
    does; compute is slowed in proportion to its tokens (as a real model's is), so the stored half's
    small in-memory loads land while it runs."""
    from kvrestore.backends.hf import HFBackend

    from .conftest import tiny_model

    class SlowUnits(HFBackend):
        min_unit_tokens = 32  # a unit per chunk: as slow as a large model, so not launch-bound

        def prefill_into(self, tokens, *args, **kwargs):
            time.sleep(2e-4 * tokens.numel())
            return super().prefill_into(tokens, *args, **kwargs)

    backend = SlowUnits(tiny_model("llama").to("cuda"), name="tiny-llama-cuda")
    tokens = random_tokens(512, backend.spec.vocab_size)

    async def main():
        inner = MemoryStore()
        await Restorer(backend, inner, chunk_size=32).save(tokens[:256])
        store = inner if through == "lane-threads" else ThrottledStore(inner, 2e8)
        r = Restorer(backend, store, chunk_size=32)
        res = await r.restore(tokens, TokenTwoPointer())
        assert r.engine.cuda_stream("compute", "cuda") is not r.engine.cuda_stream("load", "cuda")
        return res

    res = anyio.run(main)
    assert res.kv.data.is_cuda and res.stats.computed_chunks >= 8 and res.stats.loaded_chunks >= 1
    torch.testing.assert_close(res.kv.data, full_prefill(backend, tokens), atol=1e-4, rtol=0)


def test_concurrent_restores_share_one_compute_lane():
    """Two restores on one engine: their compute units never overlap (one lane), both finish."""
    engine = Engine(load_lanes=2)
    running, overlaps = [0], [0]
    lock = threading.Lock()

    def compute(a: int, b: int) -> None:
        with lock:
            running[0] += 1
            overlaps[0] = max(overlaps[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    async def load(i: int) -> int:
        await anyio.sleep(0.01)
        return 1

    async def main():
        progresses = [Progress([16] * 6, [False, True] * 3) for _ in range(2)]
        async with anyio.create_task_group() as tg:
            for p in progresses:
                tg.start_soon(engine.run, RunRequest(p, TokenTwoPointer(1), compute, load))
        return progresses

    assert all(p.finished for p in anyio.run(main))
    assert overlaps[0] == 1
