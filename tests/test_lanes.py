"""Load lanes as threads: the lane pool itself, and restores whose loads run on it (memory, local file)."""

from __future__ import annotations

import math
import threading
import time

import anyio
import pytest
import torch

from kvrestore import KVCache, LoadOnly, Restorer, TokenTwoPointer, open_store
from kvrestore.runtime.lanes import LaneThreads
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .waiting import wait_until

ATOL = 1e-5


def full_prefill(backend, tokens):
    return backend.prefill_chunk(tokens, None, 0).data


# -- the pool ----------------------------------------------------------------------------------------


def test_lane_threads_run_every_job_on_at_most_lanes_threads():
    lanes = LaneThreads(3, idle_s=0.2)
    running, peak, done = 0, 0, []
    lock = threading.Lock()
    finished = threading.Event()

    def job(i):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)
        with lock:
            running -= 1
            done.append(i)
            if len(done) == 40:
                finished.set()

    for i in range(40):
        lanes.submit(lambda i=i: job(i))
    assert finished.wait(10)
    assert sorted(done) == list(range(40))
    assert peak <= 3 and lanes.threads <= 3
    deadline = time.monotonic() + 5  # idle lanes end: an idle engine holds no thread
    while lanes.threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lanes.threads == 0
    got = threading.Event()  # and new work starts a lane again
    lanes.submit(got.set)
    assert got.wait(5)


def test_reserved_lanes_start_before_their_jobs_and_no_more_start_for_them():
    """`reserve(n)` starts the threads a batch of n jobs needs before any of them is queued (so no
    start waits behind a running job), never past `lanes`; submitting the batch then starts none."""
    lanes = LaneThreads(3, idle_s=5.0)
    gate, done = threading.Event(), threading.Semaphore(0)
    lanes.reserve(5)
    assert lanes.threads == 3
    for _ in range(5):
        lanes.submit(lambda: (gate.wait(5), done.release()))
    assert lanes.threads == 3
    gate.set()
    for _ in range(5):
        assert done.acquire(timeout=5)
    lanes.reserve(2)  # every lane has its thread: nothing more starts
    assert lanes.threads == 3
    lanes.close()


def test_lane_threads_reject_zero_lanes():
    with pytest.raises(ValueError):
        LaneThreads(0)


# -- restores on lane threads ------------------------------------------------------------------------


class CountingStore(MemoryStore):
    """Records which threads its blocking reads ran on (it reads exactly as MemoryStore does)."""

    def __init__(self):
        super().__init__()
        self.threads: set[str] = set()

    def get_sync(self, key):
        self.threads.add(threading.current_thread().name)
        return super().get_sync(key)


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("policy", [LoadOnly(), TokenTwoPointer()], ids=["load-only", "two-pointer"])
def test_restores_through_lane_threads_equal_a_full_prefill(llama_backend, tmp_path, kind, policy):
    tokens = random_tokens(200, llama_backend.spec.vocab_size)
    store = MemoryStore() if kind == "memory" else open_store(tmp_path.as_uri())
    assert store.reads_sync

    async def main():
        r = Restorer(llama_backend, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        return await r.restore(tokens, policy)

    res = anyio.run(main)
    assert res.stats.failed_loads == 0 and res.stats.loaded_chunks > 0
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_loads_run_on_the_engines_lane_threads(llama_backend):
    tokens = random_tokens(160, llama_backend.spec.vocab_size)
    store = CountingStore()
    assert (
        store.reads_sync
    )  # get_sync is its own, get / read_into are MemoryStore's: it still reads synchronously

    async def main():
        r = Restorer(llama_backend, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        return await r.restore(tokens, LoadOnly())

    res = anyio.run(main)
    assert res.stats.loaded_chunks == 5
    assert store.threads and all(name.startswith("kvrestore-load") for name in store.threads)


def test_a_subclass_that_changes_reads_is_not_bypassed():
    class Delayed(MemoryStore):
        async def get(self, key):
            await anyio.sleep(0)
            return await super().get(key)

    assert MemoryStore().reads_sync and not Delayed().reads_sync


def test_a_damaged_chunk_found_on_a_lane_thread_is_recomputed_and_deleted(llama_backend):
    tokens = random_tokens(160, llama_backend.spec.vocab_size)
    store = MemoryStore()

    async def main():
        r = Restorer(llama_backend, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        _, refs = r.chunks(tokens)
        bad = refs[2].key
        data = bytearray(store._objects[bad])
        data[-5] ^= 0xFF  # a flipped byte in the last layer's section
        store._objects[bad] = bytes(data)
        res = await r.restore(tokens, LoadOnly())
        return res, bad, (await store.contains([bad]))[0]

    res, bad, still_there = anyio.run(main)
    assert res.stats.failed_loads == 1 and res.stats.computed_chunks >= 1
    assert "checksum" in res.stats.errors[0]
    assert not still_there  # never served again
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


class SlowSyncStore(MemoryStore):
    """Blocking reads that take a while, so the compute lane overtakes loads running on lane threads."""

    def __init__(self):
        super().__init__()
        self.active = 0
        self.lock = threading.Lock()

    def get_sync(self, key):
        with self.lock:
            self.active += 1
        try:
            time.sleep(0.15)
            return super().get_sync(key)
        finally:
            with self.lock:
                self.active -= 1


class HeldSyncStore(MemoryStore):
    """Blocking reads: the first `open_reads` go through, later ones wait on lane threads until
    `release` is set, so a restore is cancelled with loads running there."""

    def __init__(self, open_reads: int) -> None:
        super().__init__()
        self.open_reads = open_reads
        self.active = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.held: list[threading.Thread] = []  # the threads of the reads held

    def get_sync(self, key):
        with self.lock:
            self.active += 1
            held, self.open_reads = self.open_reads <= 0, self.open_reads - 1
            if held:
                self.held.append(threading.current_thread())
        try:
            if held:
                self.release.wait(timeout=30)  # only a bound on a hang
            return super().get_sync(key)
        finally:
            with self.lock:
                self.active -= 1


def test_a_cancelled_restore_returns_at_once_and_its_abandoned_reads_never_write_its_kv(llama_backend):
    """Cancelled while two reads are held on lane threads, a restore returns with both still held; once
    they end, what they read is dropped: the rows of every chunk not loaded before stay untouched."""
    tokens = random_tokens(256, llama_backend.spec.vocab_size)
    store = HeldSyncStore(open_reads=2)
    assert store.reads_sync
    out = KVCache(llama_backend.spec, torch.full_like(KVCache.empty(llama_backend.spec, 256).data, math.nan))

    async def main():
        r = Restorer(llama_backend, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        events: list = []
        returned: list[int] = []  # how many reads were running when the cancelled restore returned
        scope = anyio.CancelScope()

        async def restore() -> None:
            with scope:
                await r.restore(tokens, LoadOnly(), on_event=events.append, out=out)
            returned.append(store.active)

        async with anyio.create_task_group() as tg:
            tg.start_soon(restore)
            await wait_until(lambda: len(events) >= 2 and store.active == 2)  # both lanes held
            scope.cancel()
            await wait_until(lambda: returned)
            assert returned == [2]  # it returned while both reads were still held
            store.release.set()
            for thread in store.held:  # a lane thread whose load was abandoned ends with it
                await anyio.to_thread.run_sync(thread.join, 30)
                assert not thread.is_alive()
        assert scope.cancelled_caught
        res = await r.restore(tokens, LoadOnly())  # the engine is still usable
        return events, res

    events, res = anyio.run(main)
    loaded = {e.first_chunk for e in events if e.kind == "load"}
    assert 0 < len(loaded) < 8
    for c in range(8):
        rows = out.data[:, :, :, 32 * c : 32 * (c + 1)]
        assert bool(rows.isnan().all()) != (c in loaded), c  # the late reads wrote nothing
    assert res.stats.loaded_chunks == 8
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_the_two_pointer_drops_loads_on_lane_threads_cleanly(llama_backend):
    """Slow thread loads against a fast compute lane: the two-pointer overtakes loads in flight (racing
    them); a lost load's chunk is written by compute only after that load has stopped, and the KV is
    exact."""
    tokens = random_tokens(256, llama_backend.spec.vocab_size)
    store = SlowSyncStore()

    async def main():
        r = Restorer(llama_backend, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        return await r.restore(tokens, TokenTwoPointer())

    res = anyio.run(main)
    assert res.stats.computed_chunks + res.stats.loaded_chunks == 8
    dropped = res.trace.of_kind("load-dropped")
    assert dropped, "the compute lane should have overtaken a slow load"
    for d in dropped:  # its rows were written by compute only once the load had stopped writing them
        unit = next(e for e in res.trace.of_kind("compute") if e.first_chunk <= d.first_chunk <= e.last_chunk)
        if unit.start_s < d.end_s:  # a unit that raced the load: it writes its KV when it has won
            assert unit.first_chunk == unit.last_chunk and unit.end_s >= d.end_s - 1e-6
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


# -- scatter reads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("sizes", [[7, 0, 13, 1], [3] * 1500, [100_000, 5]], ids=["odd", "many", "large"])
def test_scatter_reads_fill_buffers_in_order(tmp_path, kind, sizes):
    """More buffers than one preadv takes, empty ones, and an object that ends part-way through."""
    from kvrestore.stores import FsspecStore

    store = MemoryStore() if kind == "memory" else FsspecStore(str(tmp_path))
    blob = bytes(range(256)) * 400  # 102,400 bytes
    key = "ab" * 16
    anyio.run(store.put, key, blob)
    offset = 11
    buffers = [memoryview(bytearray(n)) for n in sizes]
    placed = store.scatter_into_sync(key, offset, buffers)
    assert placed == min(sum(sizes), len(blob) - offset)
    assert b"".join(bytes(b) for b in buffers)[:placed] == blob[offset : offset + placed]
    assert store.scatter_into_sync("cd" * 16, 0, buffers) is None


@pytest.mark.parametrize("batch", [False, True], ids=["engine", "batch-engine"])
def test_a_restore_leaves_no_stream_open(llama_backend, batch):
    """The memory object streams that carry a restore's events are closed once it ends (an unclosed
    one warns with ResourceWarning when it is collected)."""
    import gc
    import warnings

    from kvrestore import BatchEngine

    tokens = random_tokens(96, llama_backend.spec.vocab_size)

    async def main():
        store = MemoryStore()
        await Restorer(llama_backend, store, chunk_size=32).save(tokens)
        if not batch:
            async with Restorer(llama_backend, store, chunk_size=32) as r:
                return await r.restore(tokens, TokenTwoPointer())
        async with BatchEngine(load_lanes=2) as engine:
            r = Restorer(llama_backend, store, chunk_size=32, engine=engine)
            out = await r.restore(tokens, TokenTwoPointer())
            await r.close()
            return out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        res = anyio.run(main)
        gc.collect()
    assert res.stats.loaded_chunks + res.stats.computed_chunks == 3
    assert not [
        w for w in caught if issubclass(w.category, ResourceWarning) and "MemoryObject" in str(w.message)
    ]


def test_a_thread_load_dropped_while_placing_reports_as_dropped():
    """A lane thread's load that had read and placed its chunk when the policy dropped it (its report
    still on its way to the loop) is reported as "load-dropped": the drop was begun, so its chunk went to
    the compute lane, and a "load" would break the bookkeeping. The window is set up, not waited for."""
    from kvrestore.core.trace import TraceEvent
    from kvrestore.policies import Progress
    from kvrestore.runtime.engine import Engine, _RealLanes
    from kvrestore.runtime.lanes import ThreadLoad
    from kvrestore.runtime.request import FastPaths, RunRequest

    async def never(i: int) -> int:
        raise AssertionError("no async load runs here")

    async def main():
        engine = Engine(load_lanes=1)
        request = RunRequest(Progress([16], [True]), LoadOnly(), lambda a, b: None, never)
        lanes = _RealLanes(engine, request, FastPaths())
        job = ThreadLoad()
        assert job.begin_placing()  # its read has ended: it places (bounded work), then reports
        lanes.thread_loads[job] = 0
        lanes.loads[0] = (job, job.stopped)
        lanes.stop([0])  # the drop cannot stop a load that is placing: it reports when done
        assert not job.stopped.is_set()
        lanes._landed(job, TraceEvent("load", 0, 0, 0.0, 0.1, 10))
        event = lanes.receive.receive_nowait()
        lanes.send.close()
        lanes.receive.close()
        engine.close()
        return event, job.stopped.is_set()

    event, stopped = anyio.run(main)
    assert event.kind == "load-dropped" and (event.start_s, event.end_s) == (0.0, 0.1) and stopped
