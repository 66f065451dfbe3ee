"""Bounded in time and memory, whatever the store or the files on disk do (issue 32).

Stores that misbehave are real: an S3 client (s3fs) against a socket on 127.0.0.1 that accepts and never
answers, and against a proxy in front of a real moto server that holds each answer back. The time
bounds asserted are generous multiples of the deadlines given (never of how fast this machine is): they
catch a call that waits on the client's own timeouts and retries (minutes), nothing finer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from functools import partial

import anyio
import msgspec
import pytest
import torch

from kvrestore import KVCache, LoadOnly, Restorer, open_store
from kvrestore.core.errors import InvalidInputError, StoreError, StoreTimeoutError
from kvrestore.core.spec import dtype_name
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.learned import CostLearner, LearnedState, store_name
from kvrestore.costs.links import LinkCost
from kvrestore.costs.profile import Profile, machine_id, profile_key
from kvrestore.runtime.engine import Engine
from kvrestore.stores import BoundedStore, LocalStore, MemoryStore
from kvrestore.stores.deadline import Deadlines, DeadlineStore
from kvrestore.stores.files import TMP_PREFIX
from kvrestore.stores.shared_dir import RESERVE_PREFIX
from kvrestore.stores.wrapper import WrapperStore

from .conftest import random_tokens
from .hostile_servers import BlackHole, SlowProxy
from .waiting import wait_until

pytest.importorskip("s3fs")
ATOL = 1e-5
DEADLINE = 0.5
#: what "returns within the deadline" is checked against: ten deadlines, far below the client's own
#: read timeout (20 s) times its retries, which is what a call without a deadline waits
BOUND = 10 * DEADLINE


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def s3_options(endpoint: str) -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


def timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the caller checks which
        return exc, time.monotonic() - t0


def deadline_restorer(b, store, **kw):
    kw = {"lookup_timeout_s": DEADLINE, "load_timeout_s": DEADLINE, "save_timeout_s": DEADLINE, **kw}
    return Restorer(b, store, chunk_size=32, learn=False, **kw)


# -- (1) deadlines: a black hole and a slow server ---------------------------------------------------


def test_black_hole_s3_lookup_restore_and_save_return_within_their_deadlines(llama_backend):
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=1)
    ref = b.prefill_chunk(tokens, None, 0).data
    with BlackHole() as hole:

        def fresh() -> Restorer:  # each call on a restorer that has not seen the store time out yet
            return deadline_restorer(b, open_store("s3://kv/p", **s3_options(hole.endpoint)))

        async def lookup():
            async with fresh() as r:
                return await r.lookup(tokens)

        async def restore():
            async with fresh() as r:
                return await r.restore(tokens)

        async def save():
            async with fresh() as r:
                return await r.save(tokens)

        looked, lookup_s = timed(lambda: run(lookup))
        restored, restore_s = timed(lambda: run(restore))
        saved, save_s = timed(lambda: run(save))
        run(wait_until, lambda: hole.accepted >= 3, 10)  # each call did reach the server, never answered

    assert isinstance(looked, StoreTimeoutError) and lookup_s < BOUND
    assert isinstance(saved, StoreTimeoutError) and save_s < BOUND
    assert restore_s < BOUND + 30  # the deadline, then the tiny model computes all 256 tokens
    assert restored.stats.computed_chunks == 8 and restored.stats.loaded_chunks == 0
    assert restored.stats.errors[0].startswith("lookup: StoreTimeoutError")
    assert restored.stats.seconds >= DEADLINE  # the lookup it waited on is part of the restore's time
    torch.testing.assert_close(restored.kv.data, ref, atol=ATOL, rtol=0)


def test_a_store_that_timed_out_is_not_asked_again_until_its_back_off_ends(llama_backend):
    class Counted(WrapperStore):
        """The S3 store, counting the calls that reach it."""

        calls = 0

        async def contains(self, keys):
            Counted.calls += 1
            return await self.inner.contains(keys)

        async def put(self, key, data):
            Counted.calls += 1
            await self.inner.put(key, data)

    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=2)
    with BlackHole() as hole:

        async def main():
            store = Counted(open_store("s3://kv/p", **s3_options(hole.endpoint)))
            async with deadline_restorer(b, store) as r:
                with pytest.raises(StoreTimeoutError):
                    await r.lookup(tokens)
                asked = Counted.calls
                res = await r.restore(tokens)  # within the back-off: not asked, computed at once
                with pytest.raises(StoreTimeoutError, match="not asked again"):
                    await r.save(tokens)
                return asked, Counted.calls, res, r.bounded_store.down_for

        asked, after, res, down_for = run(main)
        run(wait_until, lambda: hole.accepted >= 1, 10)  # the first lookup did reach the server
    assert asked == 1 and after == 1  # nothing reached the store during the back-off
    assert res.stats.computed_chunks == 2 and "not asked again" in res.stats.errors[0]
    assert down_for > 0


def test_back_off_doubles_while_the_store_keeps_timing_out_and_resets_once_it_answers():
    class Hanging(MemoryStore):
        hang = True

        async def contains(self, keys):
            if self.hang:
                await anyio.sleep(60)
            return await super().contains(keys)

    inner = Hanging()
    store = DeadlineStore(inner, Deadlines(lookup_s=0.05, backoff_s=0.1, max_backoff_s=0.25))

    async def main():
        backoffs = []
        for _ in range(3):
            with pytest.raises(StoreTimeoutError):
                await store.contains(["ab" * 8])
            backoffs.append(store._backoff)
            await anyio.sleep(store.down_for + 0.01)
        inner.hang = False
        assert await store.contains(["ab" * 8]) == [False]
        return backoffs, store._backoff

    backoffs, after = run(main)
    assert backoffs == [0.1, 0.2, 0.25] and after == 0.0


def test_a_store_that_is_down_flushes_only_what_was_written_through_it():
    class Hanging(MemoryStore):
        async def contains(self, keys):
            await anyio.sleep(60)
            return await super().contains(keys)

    async def down(store: DeadlineStore) -> None:
        with pytest.raises(StoreTimeoutError):
            await store.contains(["ab" * 8])
        assert store.down_for > 0

    async def main():
        read_only = DeadlineStore(Hanging(), Deadlines(lookup_s=0.05, backoff_s=30))
        await down(read_only)
        await read_only.flush()  # it accepted no write: nothing of its own to flush
        written = DeadlineStore(Hanging(), Deadlines(lookup_s=0.05, backoff_s=30))
        await written.put("cd" * 8, b"x")
        await down(written)
        with pytest.raises(StoreTimeoutError, match="flush"):
            await written.flush()  # an accepted write may not be durable: say so

    run(main)


def test_a_call_that_failed_marks_the_store_down_like_a_timeout():
    """`failed` (a refused or unreachable store, not a deadline): down for one back-off, not longer when
    told twice, and every call refused until it ends."""
    store = DeadlineStore(MemoryStore(), Deadlines(lookup_s=1.0, backoff_s=30, max_backoff_s=60))
    assert store.down_for == 0
    store.failed()
    first = store.down_for
    store.failed()  # the same outage
    assert 0 < store.down_for <= first <= 30
    with pytest.raises(StoreTimeoutError):
        store.contains_sync(["ab" * 8])


@pytest.mark.slow
def test_slow_s3_within_the_deadline_loads_and_past_it_recomputes(llama_backend, s3_server, s3_bucket):
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=3)
    ref = b.prefill_chunk(tokens, None, 0).data
    url = f"s3://{s3_bucket}/slow"

    async def save():
        async with Restorer(b, open_store(url, **s3_server.options()), chunk_size=32, learn=False) as w:
            await w.save(tokens)

    run(save)
    with SlowProxy(s3_server.port, delay_s=0.2) as slow:

        async def restore(lookup_s):
            store = open_store(url, **s3_options(slow.endpoint))
            async with deadline_restorer(b, store, lookup_timeout_s=lookup_s, load_timeout_s=10) as r:
                return await r.restore(tokens, LoadOnly())

        patient = run(restore, 10.0)  # every answer 0.2 s late, well within 10 s: loaded
        hasty, hasty_s = timed(lambda: run(restore, 0.05))  # a lookup cannot answer in 0.05 s: computed

    assert patient.stats.loaded_chunks == 4 and patient.stats.failed_loads == 0
    assert hasty.stats.computed_chunks == 4 and hasty.stats.errors[0].startswith("lookup: StoreTimeoutError")
    assert hasty_s < BOUND + 30
    for res in (patient, hasty):
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_deadlines_are_checked():
    for bad in (0, -1, float("nan"), "2"):
        with pytest.raises(InvalidInputError, match="lookup_timeout_s"):
            Deadlines(lookup_s=bad)
    assert issubclass(StoreTimeoutError, StoreError) and issubclass(StoreTimeoutError, TimeoutError)


# -- (2) files on disk are only ever a hint -----------------------------------------------------------


def _poisoned_state(b, store, **fields) -> LearnedState:
    """Learned costs as a file would hold them for this machine, model and store, with `fields` set."""
    learner = CostLearner(b.spec, b.device, store_name(store))
    state = learner.state
    state.chunk = [[32.0, 0.0, 0.01], [32.0, 32.0, 0.012], [64.0, 0.0, 0.02]]
    state.link = LinkCost(1e8, 1e-4)
    for name, value in fields.items():
        setattr(state, name, value)
    return state


@pytest.mark.parametrize(
    "bad",
    [
        {"chunk": [[32.0, 0.0]]},  # a sample of the wrong length
        {"chunk": [[1e308, 0.0, 0.01]]},  # a token count no prompt has
        {"chunk": [[32.0, 0.0, float("nan")]]},
        {"layer": [[32.0, -1.0]]},
        {"link": LinkCost(0.0, 0.0)},  # no bandwidth
        {"link": LinkCost(-5.0, 0.0)},
        {"link": LinkCost(1.0, 0.0)},  # 1 B/s
        {"link": LinkCost(1e8, 1e6)},  # a million seconds a request
        {"restores": -3},
        {"calibration": {"load-only": float("inf")}},
    ],
    ids=lambda bad: next(iter(bad)) + "=" + repr(next(iter(bad.values())))[:24],
)
def test_learned_costs_out_of_bounds_are_ignored_and_auto_restores(llama_backend, tmp_path, bad):
    b = llama_backend
    store = MemoryStore()
    tokens = random_tokens(96, b.spec.vocab_size, seed=4)
    path = tmp_path / "learned.json"
    path.write_bytes(msgspec.json.encode(_poisoned_state(b, store, **{"restores": 5, **bad})))

    async def main():
        async with Restorer(b, store, chunk_size=32, learn=path) as r:
            await r.save(tokens, KVCache(b.spec, b.prefill_chunk(tokens, None, 0).data))
            return r, await r.restore(tokens)

    r, res = run(main)
    assert (
        r.planner.costs.state.restores == 1
    )  # learning started again: the file's state (5 restores) was not taken
    torch.testing.assert_close(res.kv.data, b.prefill_chunk(tokens, None, 0).data, atol=ATOL, rtol=0)


def test_learned_costs_in_bounds_are_taken(llama_backend, tmp_path):
    b = llama_backend
    store = MemoryStore()
    path = tmp_path / "learned.json"
    path.write_bytes(msgspec.json.encode(_poisoned_state(b, store, restores=7)))
    r = Restorer(b, store, chunk_size=32, learn=path)
    assert r.planner.costs.state.restores == 7 and r.planner.link.current == LinkCost(1e8, 1e-4)


@pytest.mark.parametrize("content", [b"", b'{"machine": ', b"\x00garbage\xff", b"[1, 2, 3]"])
def test_an_unreadable_saved_profile_never_stops_a_restorer(llama_backend, tmp_path, monkeypatch, content):
    b = llama_backend
    monkeypatch.setenv("KVRESTORE_CACHE_DIR", str(tmp_path))
    key = profile_key(machine_id(), b.spec.fingerprint, dtype_name(b.spec.dtype), torch.device(b.device).type)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / f"{key}.json").write_bytes(content)
    r = Restorer(b, MemoryStore(), chunk_size=32)  # the caller passed no profile: the file is a hint
    assert r.planner.profile is None


def test_a_saved_profile_out_of_bounds_is_ignored(llama_backend, tmp_path, monkeypatch):
    b = llama_backend
    monkeypatch.setenv("KVRESTORE_CACHE_DIR", str(tmp_path))
    good = Profile(
        machine_id(),
        b.spec.name,
        b.spec.fingerprint,
        dtype_name(b.spec.dtype),
        torch.device(b.device).type,
        ChunkCost(1e-3, 1e-5, 0.0),
        LayerCost(1e-4, 1e-6, 0.0),
        LinkCost(1e8, 1e-4),
    )
    good.save()
    assert Restorer(b, MemoryStore(), chunk_size=32).planner.profile == good
    msgspec.structs.replace(good, link=LinkCost(0.0, 0.0)).save()
    assert Restorer(b, MemoryStore(), chunk_size=32).planner.profile is None
    with pytest.raises(InvalidInputError, match="bandwidth"):  # given by the caller: a typed error
        Restorer(b, MemoryStore(), chunk_size=32, profile=msgspec.structs.replace(good, link=LinkCost(0.0)))


def test_a_poisoned_learned_link_traps_auto_for_one_restore_at_most(llama_backend, tmp_path):
    """A well-formed learned link, in bounds but far too slow (2 kB/s, 5 s a request): `Auto` would
    compute everything for ever and never measure the link again. The first restore probes it instead,
    and from the second on `Auto` loads."""
    b = llama_backend
    store = MemoryStore()
    tokens = random_tokens(256, b.spec.vocab_size, seed=5)
    ref = b.prefill_chunk(tokens, None, 0).data
    path = tmp_path / "learned.json"
    path.write_bytes(msgspec.json.encode(_poisoned_state(b, store, link=LinkCost(2e3, 5.0))))

    async def main():
        async with Restorer(b, store, chunk_size=32, learn=path) as r:
            assert r.planner.link.current == LinkCost(2e3, 5.0)  # in bounds: taken
            await r.save(tokens, KVCache(b.spec, ref))
            return r, [await r.restore(tokens) for _ in range(4)]

    r, results = run(main)
    assert "probing" in results[0].plan.reason and results[0].stats.loaded_chunks > 0
    assert (
        r.planner.link.current.bytes_per_s > 1e6 and r.planner.link.current.latency_s < 1.0
    )  # measured, not mixed
    for res in results[1:]:
        assert res.plan.choice.name != "compute-only" and res.stats.loaded_chunks > 0
    for res in results:
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


# -- (3) memory bounded by what a chunk can be; close() gives it back -----------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_garbage_objects_under_chunk_keys_are_misses_that_leave_no_memory_behind(llama_backend, tmp_path):
    """Four 64 MB objects of garbage under a prompt's chunk keys, behind a `BoundedStore` (reads go
    through the event loop into staging): each is a miss read no further than a chunk can be, and the
    restores leave resident memory where it was. Staged whole, as they were, they stayed in the pool."""
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=6)
    ref = b.prefill_chunk(tokens, None, 0).data
    garbage = 64 << 20
    store = BoundedStore(LocalStore(str(tmp_path / "kv")), 1 << 34)
    r = Restorer(b, store, chunk_size=32, load_lanes=4, learn=False)
    _, refs = r.chunks(tokens)

    async def main():
        for ref_ in refs:
            await store.put(ref_.key, os.urandom(1024) * (garbage // 1024))
        before = _rss()
        res = await r.restore(tokens, LoadOnly())
        held = _rss() - before
        await r.close()
        return res, held

    res, held = run(main)
    assert res.stats.failed_loads == 4 and res.stats.computed_chunks == 4
    assert all("more than this chunk can take" in e for e in res.stats.errors)
    assert held < garbage  # one object staged would be 64 MB; four were 256 MB
    torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_close_stops_the_load_threads_and_frees_the_staging_pool(llama_backend):
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=7)
    start = threading.active_count()

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32, load_lanes=4, learn=False)
        await r.save(tokens, KVCache(b.spec, b.prefill_chunk(tokens, None, 0).data))
        res = await r.restore(tokens, LoadOnly())
        lanes = r.engine.lane_threads().threads
        await r.close()
        return res, lanes, r.loader.pool(False).idle_bytes

    res, lanes, idle = run(main)
    assert res.stats.loaded_chunks == 4 and lanes >= 1 and idle == 0
    # the event loop's own worker threads end with it; idle lane threads lived on for 10 s
    run(wait_until, lambda: threading.active_count() <= start, 5)


def test_close_leaves_a_shared_engine_running(llama_backend):
    b = llama_backend
    engine = Engine(2)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32, engine=engine, learn=False)
        lanes = engine.lane_threads()
        await r.close()
        return lanes

    assert run(main) is engine.lane_threads()  # the engine's owner closes it, not a restorer using it


# -- (4) no surprises on S3 -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_missing_bucket_is_a_store_error_at_save_and_a_miss_at_restore(llama_backend, s3_server):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=8)
    bucket = f"missing-{os.getpid()}-{time.monotonic_ns()}"
    names = lambda: [x["Name"] for x in s3_server.client().list_buckets()["Buckets"]]  # noqa: E731

    async def main(**options):
        async with Restorer(
            b, open_store(f"s3://{bucket}/p", **s3_server.options(**options)), chunk_size=32
        ) as r:
            res = await r.restore(tokens)
            try:
                saved = await r.save(tokens)
            except StoreError as exc:
                saved = exc
            return res, saved

    res, saved = run(main)
    assert res.stats.computed_chunks == 2 and res.stats.failed_loads == 0  # a miss, not a fault
    assert isinstance(saved, StoreError) and "bucket does not exist" in str(
        saved.failed[next(iter(saved.failed))]
    )
    assert bucket not in names()  # nothing created behind the caller's back
    _, created = run(partial(main, create_bucket=True))  # an explicit option
    assert created.written_chunks == 2 and bucket in names()


# -- (5) save(kv=...) stores only what this model could have made ----------------------------------------


def test_save_refuses_kv_with_nan_or_inf_or_of_another_shape_or_device(llama_backend):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=9)
    good = b.prefill_chunk(tokens, None, 0).data
    nan, inf = good.clone(), good.clone()
    nan[1, 0, 0, 40, 3] = float("nan")
    inf[0, 1, 1, 2, 0] = float("-inf")
    wide = torch.zeros(*good.shape[:4], good.shape[4] * 2, dtype=good.dtype)
    store = MemoryStore()

    async def main():
        async with Restorer(b, store, chunk_size=32, learn=False) as r:
            errors = []
            for data, match in (
                (nan, "NaN"),
                (inf, "NaN or infinite"),
                (wide, "shape"),
                (good.to("meta"), "on meta"),
            ):
                with pytest.raises(InvalidInputError, match=match) as exc:
                    await r.save(tokens, KVCache(b.spec, data))
                errors.append(exc.value)
            return errors, await store.contains([ref.key for ref in r.chunks(tokens)[1]])

    errors, stored = run(main)
    assert len(errors) == 4 and stored == [False, False]  # nothing was written


# -- (6) a shared directory under a cap: a dead writer's temp files go with its reservation --------------

BOUNDED_KILLED_WRITER = """
import os, signal, sys
import anyio
from kvrestore.stores import open_store

store = open_store(sys.argv[1], capacity_bytes=1 << 22)
os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # die between write and rename
anyio.run(store.put, sys.argv[2], b"half-written chunk" * 50_000)
"""


def test_a_dead_writers_temp_file_goes_when_its_reservation_is_reclaimed(tmp_path):
    root = tmp_path / "kv"
    live = open_store(str(root), capacity_bytes=1 << 22)  # a process that was running all along
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDED_KILLED_WRITER, str(root), "ab" * 16],
        cwd=here,
        env=dict(os.environ, PYTHONPATH=here),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert len(list(root.rglob(f"{TMP_PREFIX}*"))) == 1 and list(root.glob(f"{RESERVE_PREFIX}*"))
    run(live.put, "cd" * 16, b"x" * 1000)  # takes the lock: reclaims the dead writer's reservation
    assert not list(root.rglob(f"{TMP_PREFIX}*")) and not list(root.glob(f"{RESERVE_PREFIX}*"))


# -- (7) token ids: anything that is not a 1-D sequence of integer ids is refused -------------------------


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(8, dtype=torch.long, device="meta"),
        lambda: torch.arange(8).to_sparse(),
        lambda: torch.arange(8).reshape(1, 8).to_sparse_csr(),  # a [1, n] prompt, in a sparse layout
        lambda: [2**70, 1],
        lambda: [1, None, 3],
        lambda: [[1, 2], [3, 4]],
        lambda: torch.ones(4, dtype=torch.complex64),
    ],
    ids=["meta", "sparse", "sparse-csr", "overflow", "none", "2-d", "complex"],
)
def test_any_token_input_that_is_not_integer_ids_is_an_invalid_input_error(llama_backend, make):
    tokens = make()
    r = Restorer(llama_backend, MemoryStore(), chunk_size=32, learn=False)
    with pytest.raises(InvalidInputError):
        run(r.restore, tokens)
    with pytest.raises(InvalidInputError):
        run(r.lookup, tokens)
