"""TieredStore, BoundedStore (capacities that evict, pluggable policy, restart), PrefetchStore."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from functools import partial

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import InvalidInputError, LoadOnly, Restorer, StoreError, open_store
from kvrestore.stores import (
    FIFO,
    LRU,
    BoundedStore,
    ChunkStore,
    FsspecStore,
    MemoryStore,
    PrefetchStore,
    TieredStore,
)

from .conftest import random_tokens
from .test_stores import BAD_KEYS, K1, K2, K3
from .test_stores import test_contract as check_contract
from .waiting import wait_until

K4 = "d4" * 10
ATOL = 1e-5


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def disk_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvc"))


class CountingStore(MemoryStore):
    """A real MemoryStore that counts calls (to check batching), optionally slow (a round trip)."""

    def __init__(self, *, delay: float = 0.0, **kw) -> None:
        super().__init__(**kw)
        self.delay = delay
        self.calls: dict[str, int] = {}
        self.reading = 0  # gets in flight now
        self.peak_reading = 0  # the most gets ever in flight at once

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def get(self, key):
        self._count("get")
        self.reading += 1
        self.peak_reading = max(self.peak_reading, self.reading)
        try:
            await anyio.sleep(self.delay)
            return await super().get(key)
        finally:
            self.reading -= 1

    async def contains(self, keys):
        self._count("contains")
        await anyio.sleep(self.delay)
        return await super().contains(keys)


class BrokenStore(MemoryStore):
    """A tier whose backend is down: every call raises StoreError (as FsspecStore does)."""

    name = "broken://"

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def get(self, key):
        if self.down:
            raise StoreError("connection refused")
        return await super().get(key)

    async def put(self, key, data):
        if self.down:
            raise StoreError("connection refused")
        await super().put(key, data)

    async def contains(self, keys):
        if self.down:
            raise StoreError("connection refused")
        return await super().contains(keys)


def three_tiers(tmp_path, **kw) -> TieredStore:
    return TieredStore([MemoryStore(), FsspecStore(str(tmp_path / "disk")), MemoryStore()], **kw)


@pytest.mark.parametrize("write", ["back", "through"])
def test_tiered_contract(tmp_path, write):
    store = three_tiers(tmp_path, write=write)
    store.local = True  # tells the shared contract that every tier clamps huge ranges
    check_contract(store)


def test_bounded_contract(tmp_path):
    store = open_store(str(tmp_path), capacity_bytes=1 << 20)
    store.local = True
    check_contract(store)


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_tiered_rejects_bad_keys(tmp_path, bad):
    store = three_tiers(tmp_path)

    async def body():
        for call in (store.get(bad), store.put(bad, b"x"), store.contains([bad]), store.delete(bad)):
            with pytest.raises(ValueError, match="invalid store key"):
                await call

    run(body)


def test_bad_construction():
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])
    with pytest.raises(InvalidInputError, match="every tier must be a ChunkStore"):
        TieredStore([MemoryStore(), "file:///tmp"])
    with pytest.raises(ValueError, match="write must be"):
        TieredStore([MemoryStore()], write="sometimes")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        MemoryStore(10, eviction="random")
    with pytest.raises(ValueError, match="capacity_bytes"):
        open_store("file:///tmp/x", eviction="lru")


def test_reads_promote_to_upper_tiers(tmp_path):
    top, mid, bottom = MemoryStore(), FsspecStore(str(tmp_path / "disk")), MemoryStore()
    store = TieredStore([top, mid, bottom])

    async def body():
        await bottom.put(K1, b"from the bottom")
        await mid.put(K2, b"from the middle")
        assert await store.get(K1) == b"from the bottom"
        buf = bytearray(15)
        assert await store.read_into(K2, memoryview(buf)) == 15 and buf == b"from the middle"
        await store.flush()  # promotions run in the background
        return await top.contains([K1, K2]), await mid.contains([K1, K2])

    assert run(body) == ([True, True], [True, True])
    assert [s.promoted_in for s in store.stats] == [2, 1, 0]
    assert [s.hits for s in store.stats] == [0, 1, 1]


def test_write_back_and_write_through(tmp_path):
    async def body(write):
        top, bottom = MemoryStore(), FsspecStore(str(tmp_path / write))
        store = TieredStore([top, bottom], write=write)
        await store.put(K1, b"payload")
        right_after = (await top.contains([K1]))[0], (await bottom.contains([K1]))[0]
        await store.flush()
        assert store.pending_writes == 0 and store.dirty_bytes == 0
        return right_after, (await bottom.contains([K1]))[0]

    assert run(body, "through") == ((True, True), True)
    # write-back: put returns once the top tier has it; the bottom gets it in the background
    (top_now, _), bottom_later = run(body, "back")
    assert top_now and bottom_later


def test_full_dirty_buffer_makes_put_write_through(tmp_path):
    bottom = FsspecStore(str(tmp_path))
    store = TieredStore([MemoryStore(), bottom], max_dirty_bytes=150)

    async def body():
        await store.put(K1, b"1" * 100)  # fits the dirty buffer: written back later
        await store.put(K2, b"2" * 100)  # would not fit: written through, now
        now = await bottom.contains([K2])
        await store.flush()
        return now, await bottom.contains([K1, K2])

    assert run(body) == ([True], [True, True])


def test_bounded_store_adopts_objects_other_processes_wrote(tmp_path):
    mine = open_store(str(tmp_path), capacity_bytes=250)
    theirs = FsspecStore(str(tmp_path))

    async def body():
        await mine.put(K1, b"1" * 100)
        await theirs.put(K2, b"2" * 100)  # another process, after this one listed the directory
        await theirs.put(K3, b"3" * 100)
        assert await mine.get(K2) is not None and await mine.get(K3) is not None  # adopted: 300 > 250
        return await theirs.contains([K1, K2, K3])

    assert run(body) == [False, True, True]  # the least recently used (K1) was evicted
    assert mine.bytes_used == 200 == disk_bytes(tmp_path)


def test_write_back_never_loses_an_object_the_top_tier_evicted(tmp_path):
    top = MemoryStore(capacity_bytes=100)  # holds one object
    bottom = FsspecStore(str(tmp_path))
    store = TieredStore([top, bottom])

    async def body():
        for k in (K1, K2, K3):
            await store.put(k, k.encode() * 4)  # 80 bytes each: the top keeps only the last
        assert await top.contains([K1, K2, K3]) == [False, False, True]
        assert await store.get(K1) == K1.encode() * 4  # from the disk or the dirty buffer
        await store.flush()
        return await bottom.contains([K1, K2, K3])

    assert run(body) == [True, True, True]


def test_write_back_survives_the_end_of_its_event_loop(tmp_path):
    """A loop that ends cancels the background flush; the next flush (another loop) finishes it."""
    bottom = FsspecStore(str(tmp_path))
    store = TieredStore([MemoryStore(), bottom])

    async def put_and_leave():
        await store.put(K1, b"x" * 1000)  # no flush: the loop ends with the write pending

    run(put_and_leave)

    async def later():
        await store.close()
        return await bottom.get(K1)

    assert run(later) == b"x" * 1000


def test_lower_tier_down_write_back_keeps_it_dirty_and_flush_says_so():
    broken = BrokenStore()
    store = TieredStore([MemoryStore(), broken], flush_retries=2)

    async def body():
        await store.put(K1, b"keep me")
        with pytest.raises(StoreError, match=r"1 objects not yet written to broken://"):
            await store.flush()
        assert store.pending_writes == 1 and await store.get(K1) == b"keep me"
        assert store.stats[1].errors >= 2 and "connection refused" in store.stats[1].last_error
        broken.down = False  # back up: the next flush writes it
        await store.flush()
        return await broken.get(K1)

    assert run(body) == b"keep me"


def test_failing_tier_is_a_miss_unless_no_tier_has_it():
    broken = BrokenStore()
    top = MemoryStore()
    store = TieredStore([top, broken], write="through")

    async def body():
        await top.put(K1, b"cached")
        assert await store.get(K1) == b"cached"  # the top tier answers; the broken one is not asked
        assert await store.contains([K1, K2]) == [True, False]  # a failing tier answers "no"
        with pytest.raises(StoreError, match="found in no tier.*connection refused"):
            await store.get(K2)
        with pytest.raises(StoreError, match="broken://"):
            await store.put(K3, b"x")  # write-through: the caller learns the write did not land

    run(body)


def test_contains_is_one_batch_per_tier():
    top, mid, bottom = CountingStore(), CountingStore(), CountingStore()
    store = TieredStore([top, mid, bottom])
    keys = [f"{i:040x}" for i in range(1, 41)]

    async def body():
        for k in keys[:10]:
            await top.put(k, b"t")
        for k in keys[10:20]:
            await bottom.put(k, b"b")
        return await store.contains(keys)

    assert run(body) == [True] * 20 + [False] * 20
    assert [s.calls["contains"] for s in (top, mid, bottom)] == [1, 1, 1]


# -- capacities ----------------------------------------------------------------------------------------


def test_disk_tier_capacity_really_evicts(tmp_path):
    disk = open_store(str(tmp_path), capacity_bytes=10_000)
    assert isinstance(disk, BoundedStore)
    store = TieredStore([MemoryStore(capacity_bytes=3000), disk], write="through")
    keys = [f"{i:040x}" for i in range(1, 30)]

    async def body():
        for i, k in enumerate(keys):
            await store.put(k, bytes([i]) * 1000)
            await disk.get(keys[0])  # keep the first one hot on disk (the memory tier would answer)
        return await disk.contains(keys)

    present = run(body)
    assert disk_bytes(tmp_path) <= 10_000 and disk.bytes_used == disk_bytes(tmp_path)
    assert present[0] and sum(present) == 10 and present[-9:] == [True] * 9
    assert disk.evictions == len(keys) - 10


@pytest.mark.parametrize(("policy", "kept"), [("lru", K1), ("fifo", K2), (LRU(), K1), (FIFO(), K2)])
def test_eviction_policy_is_pluggable(tmp_path, policy, kept):
    disk = open_store(str(tmp_path), capacity_bytes=250, eviction=policy)

    async def body():
        await disk.put(K1, b"1" * 100)
        await disk.put(K2, b"2" * 100)
        await disk.get(K1)
        await disk.put(K3, b"3" * 100)  # one of K1, K2 must go
        return await disk.contains([K1, K2])

    assert run(body) == [kept == K1, kept == K2]


def test_custom_eviction_policy(tmp_path):
    class BiggestFirst:
        def __init__(self):
            self.sizes = {}

        def add(self, key, size):
            self.sizes[key] = size

        def touch(self, key):
            pass

        def remove(self, key):
            self.sizes.pop(key, None)

        def victim(self):
            return max(self.sizes, key=self.sizes.get, default=None)

    store = MemoryStore(capacity_bytes=300, eviction=BiggestFirst())

    async def body():
        await store.put(K1, b"1" * 200)
        await store.put(K2, b"2" * 50)
        await store.put(K3, b"3" * 100)  # 350 > 300: the biggest (K1) goes
        return await store.contains([K1, K2, K3])

    assert run(body) == [False, True, True]


def test_restart_keeps_the_disk_tier(tmp_path):
    """A new process's store finds the old objects, rebuilds its index, evicts the oldest to fit."""
    first = open_store(str(tmp_path), capacity_bytes=100_000)
    keys = [f"{i:040x}" for i in range(1, 11)]

    async def fill():
        for i, k in enumerate(keys):
            await first.put(k, bytes([i]) * 1000)
        for i, k in enumerate(keys):  # distinct write times, oldest first
            t = time.time() - 100 + i
            os.utime(first.inner.path(k), (t, t))

    run(fill)
    stray = tmp_path / keys[0][:2] / ".tmp-crashed-1-00"  # a half write: not an object
    stray.write_bytes(b"partial")

    restarted = open_store(str(tmp_path), capacity_bytes=5_500)
    store = TieredStore([MemoryStore(), restarted])

    async def reopen():
        got = await store.get(keys[-1])
        return got, await restarted.contains(keys)

    got, present = run(reopen)
    assert got == bytes([9]) * 1000
    assert present == [False] * 5 + [True] * 5  # the 5 oldest evicted on open
    assert restarted.bytes_used == 5000 == disk_bytes(tmp_path) and len(restarted) == 5


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 300),
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 4), st.integers(0, 150)),
        max_size=30,
    ),
)
def test_bounded_store_matches_an_lru_model(capacity, ops):
    """An object larger than the capacity is refused (StoreError) and leaves the store as it was."""
    keys = [f"{i:02x}" * 10 for i in range(5)]

    async def body():
        s = BoundedStore(MemoryStore(), capacity)
        model: OrderedDict[str, int] = OrderedDict()
        for op, k, size in ops:
            key = keys[k]
            if op == "put" and size > capacity:
                with pytest.raises(StoreError, match="more than the whole capacity"):
                    await s.put(key, bytes(size))
            elif op == "put":
                model.pop(key, None)  # room is made before the write: the old copy may go first
                while model and sum(model.values()) + size > capacity:
                    model.popitem(last=False)
                model[key] = size
                await s.put(key, bytes(size))
            elif op == "get":
                got = await s.get(key)
                assert (got is None) == (key not in model)
                if key in model:
                    model.move_to_end(key)
            else:
                model.pop(key, None)
                await s.delete(key)
            assert s.bytes_used == sum(model.values()) <= capacity
            assert await s.contains(keys) == [key in model for key in keys]

    run(body)


# -- prefetch --------------------------------------------------------------------------------------------


def test_prefetch_hint_and_bounded_buffer():
    inner = CountingStore(delay=0.02)
    store = PrefetchStore(inner, max_bytes=250, depth=2)
    keys = [f"{i:040x}" for i in range(1, 9)]

    async def body():
        for k in keys:
            await inner.put(k, k.encode()[:100].ljust(100, b"."))
        store.prefetch(keys)
        await wait_until(lambda: not store._inflight)  # every fetch the bounds allow has ended
        assert store.buffered_bytes <= 250 + 100  # stops starting fetches once full
        started = inner.calls["get"]
        assert 2 <= started <= 4
        got = [await store.get(k) for k in keys]
        return got

    got = run(body)
    assert got == [k.encode()[:100].ljust(100, b".") for k in keys]
    assert store.hits >= 2 and store.buffered_bytes == 0


@pytest.mark.parametrize("backwards", [False, True])
def test_read_ahead_follows_the_direction_of_loads(backwards):
    inner = CountingStore(delay=0.01)
    store = PrefetchStore(inner, depth=3)
    keys = [f"{i:040x}" for i in range(1, 11)]

    async def body():
        for k in keys:
            await inner.put(k, k.encode())
        assert await store.contains(keys) == [True] * 10
        order = keys[::-1] if backwards else keys
        return [await store.get(k) for k in order]

    got = run(body)
    assert got == [k.encode() for k in (keys[::-1] if backwards else keys)]
    assert store.hits == 9 and store.wasted == 0 and inner.calls["get"] == 10


def test_prefetch_overlaps_the_round_trips_of_a_slow_store(llama_backend):
    """One load lane against a store with a 20 ms round trip: alone it waits for one round trip at a time;
    read-ahead keeps several in flight at once (how much faster that is: benchmarks/)."""
    b = llama_backend
    tokens = random_tokens(320, b.spec.vocab_size, seed=11)
    ref = b.prefill_chunk(tokens, None, 0).data

    async def restore(store: ChunkStore):
        async with Restorer(b, store, chunk_size=32, load_lanes=1) as r:
            await r.save(tokens)
            return await r.restore(tokens, LoadOnly())

    plain_inner, pre_inner = CountingStore(delay=0.02), CountingStore(delay=0.02)
    plain = run(restore, plain_inner)
    prefetching = PrefetchStore(pre_inner, depth=4)
    pre = run(restore, prefetching)
    for res in (plain, pre):
        assert res.stats.loaded_chunks == 10 and res.stats.failed_loads == 0
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)
    assert plain_inner.peak_reading == 1  # one lane, no read-ahead: one round trip at a time
    assert pre_inner.peak_reading >= 2 and prefetching.hits >= 5, (pre_inner.peak_reading, prefetching.hits)


def test_prefetched_object_deleted_meanwhile_is_not_served():
    inner = CountingStore(delay=0.01)
    store = PrefetchStore(inner)

    async def body():
        await inner.put(K1, b"old")
        store.prefetch([K1])
        await wait_until(lambda: store.buffered_bytes == 3)  # fetched into the buffer
        await store.delete(K1)
        return await store.get(K1)

    assert run(body) is None


# -- a restore through the tiers -------------------------------------------------------------------------


def test_restore_through_tiers_is_exact_and_warms_the_upper_tiers(llama_backend, tmp_path):
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=12)
    ref = b.prefill_chunk(tokens, None, 0).data
    bottom = FsspecStore(str(tmp_path / "slow"))

    async def main():
        async with Restorer(b, bottom, chunk_size=32) as r:
            await r.save(tokens)  # only the bottom tier has the chunks
        top, mid = MemoryStore(), open_store(str(tmp_path / "disk"), capacity_bytes=1 << 20)
        store = TieredStore([top, mid, FsspecStore(str(tmp_path / "slow"))])
        r = Restorer(b, store, chunk_size=32)
        first = await r.restore(tokens, LoadOnly())
        await store.flush()
        hits_before = [s.hits for s in store.stats]
        second = await r.restore(tokens, LoadOnly())
        hits_after = [s.hits for s in store.stats]
        await r.close()
        return first, second, hits_before, hits_after

    first, second, before, after = run(main)
    assert before == [0, 0, 4] and after == [4, 0, 4]  # the second restore is served from memory
    for res in (first, second):
        assert res.stats.loaded_chunks == 4
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_a_restorer_wraps_a_tiered_store_and_leaves_the_callers_object_as_it_was(llama_backend, tmp_path):
    """The restorer bounds each tier through a view of its own (`TieredStore.over_tiers`): the caller's
    store keeps its tiers and parts, and still sees what the restorer did (counters, write-back)."""
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=13)
    top, bottom = MemoryStore(), FsspecStore(str(tmp_path / "disk"))
    store = TieredStore([top, bottom])
    before = dict(vars(store))
    tiers, moves_tiers = list(store.tiers), store.moves.tiers

    async def main():
        async with Restorer(b, store, chunk_size=32) as r:
            assert r.bounded_store is not store and r.bounded_store.tiers[1] is not bottom
            await r.save(tokens)
            res = await r.restore(tokens, LoadOnly())
        return res, await bottom.contains([c.key for c in r.chunks(tokens)[1]])

    res, on_disk = run(main)
    assert vars(store).keys() == before.keys() and all(vars(store)[k] is v for k, v in before.items())
    assert store.tiers == tiers and all(t is u for t, u in zip(store.tiers, tiers, strict=True))
    assert store.inner is top and store.moves.tiers is moves_tiers
    assert res.stats.loaded_chunks == 2 and store.stats[0].hits == 2  # counted on the caller's store
    assert on_disk == [True, True]  # the restorer's write-back reached the lower tier


def test_write_back_put_and_delete_are_not_overtaken_by_an_older_flush(tmp_path):
    """A flush still writing an older object to a slow lower tier must not land after a newer put or a
    delete of the same key (it would resurrect stale or deleted bytes)."""

    class SlowPuts(MemoryStore):
        """A slow lower tier (the slowness is the subject: an older flush is still writing when newer
        writes of the same key come); counts the writes started and still running."""

        def __init__(self) -> None:
            super().__init__()
            self.started = self.writing = 0

        async def put(self, key, data):
            self.started += 1
            self.writing += 1
            try:
                await anyio.sleep(0.05)
                await super().put(key, data)
            finally:
                self.writing -= 1

    key = "ab" * 16

    async def body():
        lower = SlowPuts()
        store = TieredStore([MemoryStore(), lower], write="back")
        await store.put(key, b"first")
        await wait_until(lambda: lower.writing == 1)  # its flush to the slow tier is now in flight
        await store.put(key, b"second")
        await store.delete(key)
        await store.flush()
        await wait_until(lambda: lower.writing == 0)  # the older flush has ended, landed or not
        assert await lower.get(key) is None and await store.get(key) is None
        started = lower.started
        await store.put(key, b"third")
        await wait_until(lambda: lower.started > started and lower.writing == 1)  # "third" is being written
        await store.put(key, b"fourth")
        await store.flush()
        await wait_until(lambda: lower.writing == 0)
        assert await lower.get(key) == b"fourth"

    run(body)
