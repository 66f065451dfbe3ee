"""Hard guarantees of the store layer.

* Through any stack of wrappers (ThrottledStore, PrefetchStore, BoundedStore, TieredStore) every call
  reaches the innermost store, and after `flush()` every write that returned is on the durable tier.
* A BoundedStore never holds more than its capacity, also while many writes run at once and when several
  processes share one directory; an object larger than the capacity is refused.
* Bad arguments are refused when a store is made, with InvalidInputError naming the problem.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from contextlib import suppress
from functools import partial
from pathlib import Path

import anyio
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from kvrestore.core.bandwidth import BandwidthTrace
from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.stores import (
    BoundedStore,
    ChunkStore,
    FsspecStore,
    LocalStore,
    MemoryStore,
    PrefetchStore,
    ThrottledStore,
    TieredStore,
    WrapperStore,
    open_store,
)
from kvrestore.stores.shared_dir import RESERVE_PREFIX

ROOT = str(Path(__file__).resolve().parents[1])
SHARD = "ab"  # every key of the capacity tests lies in one shard directory: one listing samples it all


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def key(i: int, prefix: str = SHARD) -> str:
    """A valid store key (64 lowercase hex digits) in the shard directory of `prefix`."""
    return f"{prefix}{i:0{64 - len(prefix)}x}"


def payloads(
    n: int, low: int = 1000, high: int = 3000, seed: int = 0, prefix: str = SHARD
) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {key(i, prefix): rng.randbytes(rng.randint(low, high)) for i in range(n)}


WRAPPERS = {
    "throttled": lambda s: ThrottledStore(s, bytes_per_s=1e10),
    "prefetch": lambda s: PrefetchStore(s),
    "bounded": lambda s: BoundedStore(s, 1 << 30),
}
#: outermost first: every wrapper alone, every ordered pair, every order of all three
STACKS = [
    *((w,) for w in WRAPPERS),
    *itertools.product(WRAPPERS, repeat=2),
    *itertools.permutations(WRAPPERS),
]


def wrap(store: ChunkStore, stack: tuple[str, ...]) -> ChunkStore:
    for name in reversed(stack):
        store = WRAPPERS[name](store)
    return store


class RecordingDisk(LocalStore):
    """A real local directory that notes which of the optional calls reached it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls: Counter[str] = Counter()

    async def scan(self):
        self.calls["scan"] += 1
        return await super().scan()

    def prefetch(self, keys) -> None:
        self.calls["prefetch"] += 1

    async def flush(self) -> None:
        self.calls["flush"] += 1

    async def close(self) -> None:
        self.calls["close"] += 1
        await super().close()


# -- every call reaches the innermost store --------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS, ids="/".join)
def test_flush_makes_every_acknowledged_write_durable_through_any_stack(tmp_path, stack):
    """The reported loss: `ThrottledStore(TieredStore([memory, file], write="back")).flush()` returned
    with objects still only in memory. The loop then ends (a process exiting), cancelling any write-back
    still in flight; a fresh store on the same directory must find every object whose `put` returned."""
    disk = RecordingDisk(str(tmp_path / "disk"))
    tiered = TieredStore([MemoryStore(), disk], write="back")
    store = wrap(tiered, stack)
    objects = payloads(40, 2000, 20_000, prefix="")

    async def write():
        async with anyio.create_task_group() as tg:
            for k, v in objects.items():
                tg.start_soon(store.put, k, v)
        await store.flush()
        return tiered.pending_writes, {o.key for o in await store.scan()}

    pending, listed = run(write)
    assert pending == 0
    assert set(objects) <= listed  # scan through the stack lists them
    assert disk.calls["flush"] >= 1 and disk.calls["scan"] >= 1

    async def reopen():
        fresh = FsspecStore(str(tmp_path / "disk"))
        return {k: await fresh.get(k) for k in objects}

    assert run(reopen) == objects
    run(store.close)
    assert disk.calls["close"] == 1


@pytest.mark.parametrize("stack", STACKS, ids="/".join)
def test_every_call_reaches_the_innermost_store(tmp_path, stack):
    disk = RecordingDisk(str(tmp_path / "disk"))
    store = wrap(disk, stack)
    data, k, absent = os.urandom(5000), key(1), key(2)

    async def body():
        await store.put(k, data)
        assert await store.contains([k, absent]) == [True, False]
        assert await store.get(k) == data
        assert await store.get_range(k, 100, 200) == data[100:200]
        assert await store.get_ranges(k, [(0, 3), (4990, 6000)]) == [data[:3], data[4990:]]
        buf = bytearray(len(data))
        assert await store.read_into(k, memoryview(buf)) == len(data) and buf == data
        assert await store.get_many([k, absent]) == [data, None]
        assert [o.key for o in await store.scan()] == [k]
        store.prefetch([k])
        await store.flush()
        await store.delete(k)
        assert not os.path.exists(disk.path(k)) and await store.get(k) is None
        await store.close()

    run(body)
    assert {"scan", "prefetch", "flush", "close"} <= set(disk.calls)
    assert store.local_dir == disk.root  # what a BoundedStore looks for, through any wrapper
    # every wrapper here does something on a read: none may hand out the disk's blocking reads
    assert disk.reads_sync and not store.reads_sync
    with pytest.raises(NotImplementedError):
        store.get_sync(k)


def test_a_wrapper_that_changes_one_read_of_a_pair_must_change_both():
    with pytest.raises(TypeError, match="override get, read_into together"):

        class HalfThrottled(WrapperStore):
            async def get(self, key):
                return await self.inner.get(key)

    with pytest.raises(TypeError, match="get_range, get_ranges"):

        class HalfRanged(WrapperStore):
            async def get_ranges(self, key, ranges):
                return await self.inner.get_ranges(key, ranges)


# -- capacity ----------------------------------------------------------------------------------------


def shard_bytes(root: Path) -> int:
    """Bytes of every file in the shard directory (objects and the temp files of writes in flight).

    One listing of one small directory (one `getdents` call) is a snapshot of its names: a sum over it
    never counts an evicted object together with the object that replaced it."""
    total = 0
    with suppress(FileNotFoundError), os.scandir(root / SHARD) as it:
        for e in it:
            with suppress(FileNotFoundError):  # renamed or deleted since the listing
                total += e.stat(follow_symlinks=False).st_size
    return total


class Sampler(threading.Thread):
    """Samples `shard_bytes(root)` about every millisecond until stopped."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.samples = root, 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, shard_bytes(self.root))
            self.samples += 1
            time.sleep(0.001)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_event.set()
        self.join()


@pytest.mark.parametrize("through", ["file", "throttled-file"])
def test_concurrent_puts_never_take_the_directory_over_the_capacity(tmp_path, through):
    capacity = 20_000
    inner = FsspecStore(str(tmp_path))
    store = BoundedStore(inner if through == "file" else ThrottledStore(inner, 1e10), capacity)
    assert store.shared is not None  # a local directory: one account for every process

    async def body(objects):
        async with anyio.create_task_group() as tg:
            for k, v in objects.items():
                tg.start_soon(store.put, k, v)

    with Sampler(tmp_path) as sampler:
        for seed in range(3):  # 3 rounds of 40 concurrent puts, each round new keys
            run(body, payloads(40, seed=seed, prefix=f"{SHARD}{seed:02x}"))
    assert sampler.samples >= 10
    assert sampler.peak <= capacity
    assert store.bytes_used == shard_bytes(tmp_path) <= capacity
    assert store.evictions > 0 and not list(tmp_path.glob(f"{RESERVE_PREFIX}*"))  # none left behind


class SlowMemory(MemoryStore):
    """Writes that take a while and overlap; remembers the most bytes it ever held."""

    peak = 0

    async def put(self, key, data):
        await anyio.sleep(random.random() * 0.003)
        await super().put(key, data)
        self.peak = max(self.peak, self.bytes_used)


def test_concurrent_puts_stay_under_the_capacity_of_a_per_process_store():
    inner = SlowMemory()
    store = BoundedStore(inner, 20_000)
    assert store.shared is None  # not a local directory: a per-process limit

    async def body():
        async with anyio.create_task_group() as tg:
            for k, v in payloads(40).items():
                tg.start_soon(store.put, k, v)

    run(body)
    assert 15_000 < inner.peak <= 20_000 and store.bytes_used == inner.bytes_used <= 20_000


def test_an_object_larger_than_the_capacity_is_refused(tmp_path):
    store = BoundedStore(FsspecStore(str(tmp_path)), 1000)

    async def body():
        await store.put(key(1), b"x" * 1000)  # exactly the capacity fits
        with pytest.raises(StoreError, match="1001 bytes is more than the whole capacity") as info:
            await store.put(key(2), b"y" * 1001)
        assert isinstance(info.value, StoreError)
        return await store.contains([key(1), key(2)])

    assert run(body) == [True, False]  # nothing written, nothing evicted for it
    assert shard_bytes(tmp_path) == 1000


@pytest.mark.parametrize("where", ["local", "fsspec-memory"])
def test_a_bounded_store_over_a_throttled_one_rebuilds_its_index_after_a_restart(tmp_path, where):
    """`scan` (and `local_dir`) pass through the throttle: a second run on the same store stays under
    the capacity instead of starting from an empty index."""
    capacity, root = 10_000, f"/kvtest-{uuid.uuid4().hex}"

    def open_bounded() -> BoundedStore:
        inner = (
            FsspecStore(str(tmp_path))
            if where == "local"
            else FsspecStore.from_filesystem(MemoryFileSystem(), root)
        )
        return BoundedStore(ThrottledStore(inner, 1e10), capacity)

    async def fill(store, seed):
        for k, v in payloads(20, seed=seed, prefix=f"{SHARD}{seed:02x}").items():
            await store.put(k, v)
        return sum(o.size for o in await open_bounded().inner.inner.scan())

    first = open_bounded()
    assert run(fill, first, 1) <= capacity
    restarted = open_bounded()  # a new process: an empty index until it lists the store
    assert run(fill, restarted, 2) <= capacity
    assert restarted.bytes_used <= capacity


# -- several processes on one directory --------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import os, random, sys, time
    import anyio
    from kvrestore.stores import open_store

    root, me, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = open_store(root, capacity_bytes=capacity)
    open(os.path.join(root, f"ready-{me}"), "w").close()
    while not os.path.exists(os.path.join(root, "go")):
        time.sleep(0.001)
    rng = random.Random(me)

    async def main():
        for round in range(4):
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    key = f"ab{me:02x}{round:02x}{i:058x}"
                    tg.start_soon(store.put, key, rng.randbytes(rng.randint(1000, 3000)))

    anyio.run(main)
    """
)


def test_processes_sharing_a_directory_share_one_capacity(tmp_path):
    """Two processes, each with its own BoundedStore of capacity C on one directory: together they stay
    within C (one account, under a lock in the directory), not 2C."""
    capacity = 20_000
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(me), str(capacity)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
            stderr=subprocess.PIPE,
        )
        for me in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{me}").exists() for me in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        with Sampler(tmp_path) as sampler:
            (tmp_path / "go").touch()
            codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        errors = [p.stderr.read().decode()[-2000:] for p in procs]
        for p in procs:
            p.stderr.close()
    assert codes == [0, 0], errors
    assert sampler.samples >= 10
    assert sampler.peak <= capacity
    stored = sum(f.stat().st_size for f in (tmp_path / SHARD).iterdir())
    assert 0.5 * capacity < stored <= capacity
    assert not list(tmp_path.glob(f"{RESERVE_PREFIX}*"))


def test_two_stores_in_one_process_share_a_directory_too(tmp_path):
    capacity = 20_000
    a, b = (BoundedStore(FsspecStore(str(tmp_path)), capacity) for _ in range(2))

    async def body():
        async with anyio.create_task_group() as tg:
            for i, (k, v) in enumerate(payloads(60).items()):
                tg.start_soon((a if i % 2 else b).put, k, v)

    with Sampler(tmp_path) as sampler:
        run(body)
    assert sampler.peak <= capacity and shard_bytes(tmp_path) <= capacity


# -- bad arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [-5, 0, "10", 10.0, True, None])
def test_bounded_store_refuses_a_bad_capacity(capacity):
    with pytest.raises(InvalidInputError, match="capacity_bytes must be a positive int"):
        BoundedStore(MemoryStore(), capacity)


@pytest.mark.parametrize("rate", [-1, 0, "fast", True, math.nan, math.inf])
def test_throttled_store_refuses_a_bad_rate(rate):
    with pytest.raises(InvalidInputError, match="bytes_per_s must be a positive finite number"):
        ThrottledStore(MemoryStore(), rate)


def test_throttled_store_refuses_its_other_bad_arguments():
    with pytest.raises(InvalidInputError, match="exactly one of bytes_per_s or trace"):
        ThrottledStore(MemoryStore())
    with pytest.raises(InvalidInputError, match="exactly one of bytes_per_s or trace"):
        ThrottledStore(MemoryStore(), 1e6, trace=BandwidthTrace.constant(1e6))
    with pytest.raises(InvalidInputError, match="trace must be a BandwidthTrace"):
        ThrottledStore(MemoryStore(), trace=[(0.0, 1e6)])
    for latency in (-0.1, "1ms", math.nan):
        with pytest.raises(InvalidInputError, match="latency_s must be a finite number >= 0"):
            ThrottledStore(MemoryStore(), 1e6, latency_s=latency)
    with pytest.raises(InvalidInputError, match="inner must be a ChunkStore"):
        ThrottledStore("memory://", 1e6)


def test_prefetch_and_tiered_stores_refuse_bad_arguments():
    for kw in ({"depth": 0}, {"max_bytes": -1}, {"depth": 1.5}, {"max_age_s": 0}):
        with pytest.raises(InvalidInputError):
            PrefetchStore(MemoryStore(), **kw)
    with pytest.raises(InvalidInputError, match="write must be"):
        TieredStore([MemoryStore()], write="sideways")


@pytest.mark.parametrize("url", ["file://", "file://  ", "s3://"])
def test_open_store_refuses_a_url_without_a_path(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where "file://" used to write
    with pytest.raises(InvalidInputError, match="names no directory or bucket|whitespace"):
        open_store(url)
    with pytest.raises(InvalidInputError):
        FsspecStore(url)
    assert list(tmp_path.iterdir()) == []


def test_open_store_refuses_unknown_options(tmp_path):
    with pytest.raises(InvalidInputError, match="bogus"):
        open_store("memory://", bogus=1)
    with pytest.raises(InvalidInputError, match="takes no storage options, got bogus"):
        open_store(str(tmp_path), bogus=1)
    with pytest.raises(InvalidInputError, match="takes no storage options"):
        open_store(f"file://{tmp_path}", capacity_bytes=1000, endpoint_url="http://x")
    with pytest.raises(InvalidInputError, match="capacity_bytes must be a positive int"):
        open_store(str(tmp_path), capacity_bytes=-1)
    assert isinstance(open_store(str(tmp_path), fsync=True), LocalStore)  # a real option still works


def test_a_reservation_holds_room_until_its_writer_is_gone(tmp_path):
    """A write in flight in another process holds its room; a killed writer's reservation does not."""
    from kvrestore.stores.local import _HOST

    store = BoundedStore(FsspecStore(str(tmp_path)), 10_000)
    store.room_timeout_s = 0.1
    other_host = tmp_path / f"{RESERVE_PREFIX}otherhost-1-{uuid.uuid4().hex}-10000"
    other_host.touch()
    with pytest.raises(StoreError, match="writes in flight hold 10000"):
        run(store.put, key(1), b"x" * 100)
    other_host.unlink()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / f"{RESERVE_PREFIX}{_HOST}-{dead.pid}-{uuid.uuid4().hex}-10000"
    killed.touch()
    run(store.put, key(1), b"x" * 100)
    assert not killed.exists() and store.bytes_used == 100
