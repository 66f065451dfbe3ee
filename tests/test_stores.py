"""ChunkStore contract for every store, plus LRU, atomic file puts and open_store."""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from functools import partial

import anyio
import pytest
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvrestore.core.errors import InvalidInputError, StoreError, UnsupportedURLError
from kvrestore.stores import (
    ChunkStore,
    FsspecStore,
    LocalStore,
    MemoryStore,
    ReadOnlyStore,
    known_schemes,
    open_store,
    register_store,
)

K1, K2, K3 = "a1" * 10, "b2" * 10, "c3" * 10
BAD_KEYS = ["../etc/passwd", "ABC", "", "a1" * 10 + "/x", "AB" * 10, "a1b2"]


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def evict_under_capacity(store: ChunkStore) -> list[bool]:
    """Three 100-byte objects into a store of 250 bytes, the first read between the second and third
    writes: which of them are stored after (an LRU keeps the first and third)."""

    async def body():
        async with store:
            await store.put(K1, b"1" * 100)
            await store.put(K2, b"2" * 100)
            assert await store.get(K1) is not None  # K1 used: K2 is now the least recent
            await store.put(K3, b"3" * 100)
            return await store.contains([K1, K2, K3])

    return run(body)


@pytest.fixture(params=["memory", "file", "fsspec-sync", "fsspec-async"])
def store(request, tmp_path) -> ChunkStore:
    kind = request.param
    if kind == "memory":
        return MemoryStore()
    if kind == "file":
        return FsspecStore(str(tmp_path / "store"))
    if kind == "fsspec-sync":  # a non-local sync filesystem: calls go to worker threads
        return FsspecStore.from_filesystem(MemoryFileSystem(), f"/kvtest-{uuid.uuid4().hex}")
    # an async filesystem (the s3fs code path), here a wrapped local disk
    fs = AsyncFileSystemWrapper(LocalFileSystem(), asynchronous=True)
    return FsspecStore.from_filesystem(fs, str(tmp_path / "async"))


def test_contract(store: ChunkStore):
    async def body():
        async with store:
            assert await store.get(K1) is None
            assert await store.get_range(K1, 0, 4) is None
            assert await store.contains([K1, K2]) == [False, False]
            await store.delete(K1)  # absent: ignored

            data = bytes(range(256)) * 4
            await store.put(K1, data)
            await store.put(K2, bytearray(b"second"))
            assert await store.get(K1) == data
            assert await store.get(K2) == b"second"
            assert await store.contains([K1, K3, K2]) == [True, False, True]
            # the blocking face answers alike where the store reads without its loop
            sync = store.contains_sync([K1, K3, K2])
            assert sync == ([True, False, True] if store.reads_sync else None)
            assert await store.get_range(K1, 0, 4) == data[:4]
            assert await store.get_range(K1, 1000, 5000) == data[1000:]  # clamped at the end
            assert await store.get_range(K1, 7, 7) == b""
            if isinstance(store, MemoryStore) or store.local:  # generic fsspec may allocate `end - start`
                assert await store.get_range(K1, 0, 1 << 40) == data
            assert await store.get_many([K1, K3, K2]) == [data, None, b"second"]
            assert await store.get_ranges(K1, [(0, 2), (10, 20), (1020, 2000)]) == [
                data[:2],
                data[10:20],
                data[1020:],
            ]
            assert await store.get_ranges(K3, [(0, 2)]) == [None]

            await store.put(K1, b"replaced")
            assert await store.get(K1) == b"replaced"
            await store.delete(K1)
            assert await store.get(K1) is None
            assert await store.contains([K1, K2]) == [False, True]

            with pytest.raises(ValueError):
                await store.get_range(K2, 5, 2)
            with pytest.raises(ValueError):
                await store.get_range(K2, -1, 2)

    run(body)


def test_contains_sync_is_only_where_contains_is_the_store_own(tmp_path):
    """A subclass or a wrapper that answers `contains` its own way is never bypassed by the blocking
    face: it answers None (ask `contains`); a deadline around a local store passes it on."""
    from kvrestore.stores import ThrottledStore
    from kvrestore.stores.deadline import Deadlines, DeadlineStore

    class Counting(LocalStore):
        async def contains(self, keys):
            return await super().contains(keys)

    local = LocalStore(str(tmp_path))
    run(local.put, K1, b"x")
    assert local.contains_sync([K1, K2]) == [True, False]
    assert Counting(str(tmp_path)).contains_sync([K1]) is None
    assert ThrottledStore(local, 1e9).contains_sync([K1]) is None
    assert DeadlineStore(local, Deadlines()).contains_sync([K1, K2]) == [True, False]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_invalid_keys_rejected(store: ChunkStore, bad: str):
    async def body():
        for call in (
            store.get(bad),
            store.get_range(bad, 0, 1),
            store.put(bad, b"x"),
            store.contains([K1, bad]),
            store.delete(bad),
        ):
            with pytest.raises(ValueError, match="invalid store key"):
                await call

    run(body)


# -- MemoryStore -----------------------------------------------------------------------------------


def test_memory_lru_evicts_least_recently_used():
    async def body():
        s = MemoryStore(capacity_bytes=100)
        await s.put(K1, b"1" * 40)
        await s.put(K2, b"2" * 40)
        assert await s.get(K1) is not None  # K1 is now the most recently used
        await s.put(K3, b"3" * 40)  # 120 > 100: evict K2
        assert await s.contains([K1, K2, K3]) == [True, False, True]
        assert (s.bytes_used, s.evictions) == (80, 1)
        await s.put("d4" * 10, b"4" * 101)  # bigger than the whole capacity: not stored
        assert await s.get("d4" * 10) is None
        assert s.bytes_used == 80
        assert (s.hits, s.misses) == (1, 1)

    run(body)


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(0, 200),
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "get", "range", "delete"]), st.integers(0, 5), st.integers(0, 120)),
        max_size=40,
    ),
)
def test_memory_lru_matches_model(capacity, ops):
    keys = [f"{i:02x}" * 10 for i in range(6)]

    async def body():
        s = MemoryStore(capacity_bytes=capacity)
        model: OrderedDict[str, bytes] = OrderedDict()
        for op, k, size in ops:
            key = keys[k]
            if op == "put":
                data = bytes([k]) * size
                model.pop(key, None)
                if size <= capacity:
                    model[key] = data
                    while sum(map(len, model.values())) > capacity:
                        model.popitem(last=False)
                await s.put(key, data)
            elif op in ("get", "range"):
                got = await s.get(key) if op == "get" else await s.get_range(key, 0, size)
                want = model.get(key)
                if want is not None:
                    model.move_to_end(key)
                    want = want if op == "get" else want[:size]
                assert got == want
            else:
                model.pop(key, None)
                await s.delete(key)
            assert s.bytes_used == sum(map(len, model.values())) <= capacity
            assert await s.contains(keys) == [key in model for key in keys]

    run(body)


# -- FsspecStore on local disk ---------------------------------------------------------------------


def test_file_layout(tmp_path):
    async def body():
        s = open_store(f"file://{tmp_path}")
        await s.put(K1, b"abc")
        assert (tmp_path / K1[:2] / f"{K1}.kvc").read_bytes() == b"abc"
        assert not [p for p in tmp_path.rglob(".tmp-*")]

    run(body)


def test_file_put_is_atomic_under_races(tmp_path):
    payloads = [bytes([i]) * (256 * 1024 + i) for i in range(12)]

    async def body():
        s = FsspecStore(str(tmp_path))
        seen: list[bytes | None] = []
        done = anyio.Event()

        async def writer(p: bytes) -> None:
            for _ in range(3):
                await s.put(K1, p)

        async def reader() -> None:
            while not done.is_set():
                seen.append(await s.get(K1))
                seen.append(await s.get_range(K1, 0, 300 * 1024))

        async with anyio.create_task_group() as readers:
            for _ in range(4):
                readers.start_soon(reader)
            async with anyio.create_task_group() as writers:
                for p in payloads:
                    writers.start_soon(writer, p)
            done.set()

        assert len(seen) > 8
        assert all(got is None or got in payloads for got in seen)
        assert await s.get(K1) in payloads
        assert not list(tmp_path.rglob(".tmp-*"))

    run(body)


def test_stale_temp_files_removed_on_open(tmp_path):
    (tmp_path / "a1").mkdir()
    old = tmp_path / "a1" / ".tmp-dead"
    fresh = tmp_path / "a1" / ".tmp-live"
    old_root = tmp_path / ".tmp-probe-dead"
    for p in (old, fresh, old_root):
        p.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    os.utime(old_root, (two_hours_ago, two_hours_ago))
    FsspecStore(str(tmp_path))
    assert not old.exists() and not old_root.exists()
    assert fresh.exists()  # might belong to a writer still running


def test_unwritable_root_is_a_clear_store_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    bad = blocker / "store"
    with pytest.raises(StoreError, match="not usable") as exc:
        FsspecStore(str(bad))
    assert str(bad) in str(exc.value)
    with pytest.raises(StoreError, match=str(blocker)):
        open_store(str(blocker))  # the root itself is a regular file


def test_read_failure_other_than_missing_is_store_error(tmp_path):
    async def body():
        s = FsspecStore(str(tmp_path))
        os.makedirs(s.path(K1))  # a directory where the object should be
        with pytest.raises(StoreError, match="cannot read"):
            await s.get(K1)
        with pytest.raises(StoreError):
            await s.get_range(K1, 0, 4)

    run(body)


# -- open_store ------------------------------------------------------------------------------------


def test_open_store_schemes(tmp_path):
    m = open_store("memory://", capacity_bytes=1234)
    assert isinstance(m, MemoryStore) and m.capacity_bytes == 1234
    f = open_store(f"file://{tmp_path}/a")
    assert isinstance(f, LocalStore) and f.root == str(tmp_path / "a")
    p = open_store(str(tmp_path / "b"))
    assert isinstance(p, LocalStore) and p.root == str(tmp_path / "b")
    assert {"memory", "file", "s3"} <= set(known_schemes())


def test_open_store_rejects_bad_urls():
    with pytest.raises(UnsupportedURLError, match="ftpx") as exc:
        open_store("ftpx://host/path")
    assert "memory://" in str(exc.value) and "s3://" in str(exc.value)
    with pytest.raises(ValueError):
        open_store("")


def test_open_store_s3_without_s3fs(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else real(name, *a)
    )
    with pytest.raises(StoreError, match=r"kvrestore\[s3\]"):
        open_store("s3://bucket/prefix")


def test_register_store():
    made = []

    def factory(url, **options):
        made.append((url, options))
        return MemoryStore()

    register_store("kvtest", factory)
    try:
        assert isinstance(open_store("kvtest://x", a=1), MemoryStore)
        assert made == [("kvtest://x", {"a": 1})]
        with pytest.raises(ValueError, match="already registered"):
            register_store("kvtest", lambda url: MemoryStore())
    finally:
        register_store("kvtest", factory)  # same factory: allowed
        from kvrestore import stores

        stores._REGISTRY.pop("kvtest")


@pytest.mark.parametrize("length", [0, 10, 5000, 9000])
@pytest.mark.parametrize("room", [0, 4096, 9000])
def test_read_into_fills_the_buffer_and_reports_the_size(store: ChunkStore, length: int, room: int):
    data = bytes(i % 251 for i in range(length))

    async def body():
        async with store:
            buf = bytearray(b"\xee" * room)
            assert await store.read_into(K1, memoryview(buf)) is None
            await store.put(K1, data)
            size = await store.read_into(K1, memoryview(buf))
            return size, bytes(buf)

    size, buf = run(body)
    placed = min(length, room)
    # the whole object's size, even when the buffer held less of it (or, from a store that reads no
    # more than fits, one byte more than the buffer: `ChunkStore.read_into`)
    assert size == length or (length > room and size == room + 1 and isinstance(store, FsspecStore))
    assert buf[:placed] == data[:placed]
    assert buf[placed:] == b"\xee" * (room - placed)  # nothing written past the object


def test_read_into_a_large_object_off_the_event_loop(tmp_path):
    """Objects past the inline-copy size are copied in a worker thread; the bytes are the same."""
    from kvrestore.stores.base import INLINE_COPY_BYTES

    data = bytes(i % 253 for i in range(INLINE_COPY_BYTES + 12345))

    async def body():
        out = []
        for s in (MemoryStore(), FsspecStore(str(tmp_path))):
            async with s:
                await s.put(K1, data)
                buf = bytearray(len(data))
                out.append((await s.read_into(K1, memoryview(buf)), bytes(buf)))
        return out

    for size, buf in run(body):
        assert size == len(data) and buf == data


@pytest.mark.parametrize("clock", ["fine", "whole-seconds"])
def test_repeated_scans_see_every_change_of_a_shard(tmp_path, clock):
    """Local scans reuse a shard's listing while its directory's mtime stands still; a change right
    after a listing (within one tick of the filesystem's clock: the same mtime) must still be seen."""
    lister, writer = FsspecStore(str(tmp_path)), FsspecStore(str(tmp_path))  # two processes, say
    keys = [f"ab{i:062x}" for i in range(30)]  # one shard directory

    def tick() -> None:
        if clock == "whole-seconds":  # a filesystem that stores seconds: every change in one second
            second = int(time.time()) * 10**9
            os.utime(tmp_path / "ab", ns=(second, second))

    async def body():
        for i, k in enumerate(keys):
            await writer.put(k, b"x" * i)
            tick()
            assert {o.key: o.size for o in await lister.scan()} == {k: j for j, k in enumerate(keys[: i + 1])}
            if i % 10 == 9:
                await anyio.sleep(0.1)  # past the fine racy window: the next listing is trusted, then reused
        await writer.delete(keys[0])
        tick()
        assert {o.key for o in await lister.scan()} == set(keys[1:])

    run(body)


def test_a_listing_is_trusted_only_after_the_directory_has_been_still():
    from kvrestore.stores.local import RACY_COARSE_S, RACY_FINE_S, _trusted

    now = 1_700_000_000.5
    fine, whole = int((now - 1.0) * 1e9) + 123, int(now - 1.0) * 10**9  # changed about 1 s ago
    assert _trusted(fine, now) and not _trusted(whole, now)  # whole seconds: a coarse filesystem
    assert not _trusted(int((now - RACY_FINE_S / 2) * 1e9) + 1, now)
    assert _trusted(int(now - RACY_COARSE_S - 1) * 10**9, now)


@settings(max_examples=50, deadline=None)
@example(sizes=[7] * 1300 + [0, 3], file_len=5000, offset=3)  # three batches, the file ending in one
@example(sizes=[0, 5, 0, 0, 9] * 300, file_len=30000, offset=0)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=1300),
    file_len=st.integers(0, 30000),
    offset=st.integers(0, 100),
)
def test_a_scatter_read_fills_many_buffers_in_order(tmp_path_factory, sizes, file_len, offset):
    """`LocalStore.scatter_into_sync` over more buffers than one `preadv` takes (`IOV_BATCH`), empty
    ones among them, from a file that may end part-way: every byte lands where it belongs, in order,
    and the count says how many did."""
    store = LocalStore(str(tmp_path_factory.mktemp("scatter")))
    data = bytes(i % 251 for i in range(file_len))
    anyio.run(store.put, "ab" * 16, data)
    buffers = [memoryview(bytearray(n)) for n in sizes]
    placed = store.scatter_into_sync("ab" * 16, offset, buffers)
    expect = data[offset:][: sum(sizes)]
    assert placed == len(expect)
    assert b"".join(bytes(b) for b in buffers)[:placed] == expect


@pytest.mark.parametrize("url", ["file", "memory://"])
def test_a_store_opened_read_only_reads_and_never_writes(tmp_path, url):
    url = str(tmp_path / "kv") if url == "file" else url
    writer = open_store(url)
    run(writer.put, K1, b"abc")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    reader = open_store(url, read_only=True) if url != "memory://" else ReadOnlyStore(writer)
    assert run(reader.get, K1) == b"abc" and run(reader.contains, [K1, K2]) == [True, False]
    for call in (partial(reader.put, K2, b"x"), partial(reader.delete, K1)):
        with pytest.raises(StoreError, match="read-only"):
            run(call)
    assert run(writer.get, K1) == b"abc" and run(writer.contains, [K2]) == [False]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # not even a probe


def test_read_only_needs_an_existing_directory_and_is_a_flag(tmp_path):
    with pytest.raises(StoreError, match="read-only"):
        open_store(str(tmp_path / "missing"), read_only=True)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(InvalidInputError, match="read_only"):
        open_store(str(tmp_path), read_only="yes")
    assert isinstance(open_store("memory://", read_only=True), ReadOnlyStore)
    assert not isinstance(open_store(str(tmp_path), read_only=True), ReadOnlyStore)  # keeps its sync reads
    assert open_store(str(tmp_path), read_only=True).reads_sync
