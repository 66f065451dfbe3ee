"""What `open_store` makes of the URLs people type: every typo a typed error naming the known schemes,
never a store somewhere unexpected; and a local store that writes nothing until a write needs it."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import anyio
import pytest

from kvrestore import InvalidInputError, KVRestoreError, StoreError, UnsupportedURLError
from kvrestore.stores import (
    BoundedStore,
    FsspecStore,
    LocalStore,
    MemoryStore,
    ReadOnlyStore,
    check_store_url,
    known_schemes,
    open_store,
    register_store,
)
from kvrestore.stores.shared_dir import LOCK_NAME

K1, K2 = "ab" * 16, "cd" * 16


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty working directory: where a typo taken as a relative path would have made a store."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


# (url, error, what the message must say)
TYPOS = [
    ("memory:/", InvalidInputError, "did you mean memory://"),
    ("memory:", InvalidInputError, "did you mean memory://"),
    ("memroy://", UnsupportedURLError, "did you mean memory://"),
    ("mem://", UnsupportedURLError, "did you mean memory://"),
    ("s4://bucket/kv", UnsupportedURLError, "did you mean s3://"),
    ("s3:/bucket/kv", InvalidInputError, "did you mean s3://bucket/kv"),
    ("S3:bucket/kv", InvalidInputError, "did you mean s3://bucket/kv"),
    ("file:/var/kv", InvalidInputError, "did you mean file:///var/kv"),
    ("flie:///var/kv", UnsupportedURLError, "did you mean file://"),
    ("ftp://host/kv", UnsupportedURLError, "known schemes"),
    ("c:/kv", UnsupportedURLError, "known schemes"),
    ("://kv", InvalidInputError, "no scheme before"),
    ("kv/a://b", InvalidInputError, "no scheme before"),
    ("file://relative/dir", InvalidInputError, "file:///abs/path"),
    ("file://localhost/var/kv", InvalidInputError, "file:///abs/path"),
    ("file://~/kv", InvalidInputError, "file:///abs/path"),
    ("file://", InvalidInputError, "names no directory"),
    ("s3://", InvalidInputError, "names no directory or bucket"),
    ("memory://shared", InvalidInputError, "takes no name or path"),
    (" /var/kv", InvalidInputError, "whitespace"),
    ("/var/kv\n", InvalidInputError, "whitespace"),
    ("memory:// ", InvalidInputError, "whitespace"),
    ("\ts3://bucket/kv", InvalidInputError, "whitespace"),
    ("", InvalidInputError, "non-empty"),
    ("   ", InvalidInputError, "non-empty"),
    (None, InvalidInputError, "non-empty string or path"),
    (b"/var/kv", InvalidInputError, "non-empty string or path"),
]


@pytest.mark.parametrize(("url", "error", "says"), TYPOS, ids=[repr(t[0]) for t in TYPOS])
def test_every_typo_is_a_typed_error_and_makes_nothing(url, error, says, cwd):
    with pytest.raises(error, match=says) as exc:
        open_store(url)
    assert isinstance(exc.value, KVRestoreError) and isinstance(exc.value, ValueError)
    if "known schemes" in str(exc.value):
        assert all(f"{s}://" in str(exc.value) for s in known_schemes())
    if url not in ("s3://", "memory://shared"):  # the syntax of every URL; those two are their store's
        with pytest.raises(error):
            check_store_url(url)  # the same verdict without opening anything
    assert tree(cwd) == []  # no directory named "memory:" or "relative" in the working directory


def test_a_scheme_error_names_every_registered_scheme(cwd):
    register_store("kvtest-redis", lambda url, **o: MemoryStore())
    try:
        for url, error in (
            ("kvtest-rdis://host/0", UnsupportedURLError),
            ("kvtest-redis:/host/0", InvalidInputError),
        ):
            with pytest.raises(error, match="did you mean kvtest-redis://") as exc:
                open_store(url)
            assert "memory://" in str(exc.value) and "s3://" in str(exc.value)
        assert isinstance(open_store("kvtest-redis://host/0"), MemoryStore)
        assert check_store_url("KVTEST-REDIS://host/0") == "kvtest-redis"
    finally:
        from kvrestore import stores

        stores._REGISTRY.pop("kvtest-redis")
    with pytest.raises(UnsupportedURLError, match="known schemes") as exc:
        open_store("kvtest-redis://host/0")
    assert "kvtest-redis" not in str(exc.value).split("known schemes")[1]


@pytest.mark.parametrize("scheme", ["", "my store", "1st", "s3://", None])
def test_register_store_refuses_a_scheme_no_url_could_name(scheme):
    with pytest.raises(InvalidInputError, match="a store scheme is"):
        register_store(scheme, lambda url, **o: MemoryStore())
    assert scheme not in known_schemes()


def test_the_forms_that_are_accepted(tmp_path, cwd):
    def local(url):
        store = open_store(url)
        assert isinstance(store, LocalStore)
        return store.root

    assert local(f"file://{tmp_path}/a") == str(tmp_path / "a")
    assert local(f"FILE://{tmp_path}/a") == str(tmp_path / "a")
    assert local(str(tmp_path / "b")) == str(tmp_path / "b")
    assert local(tmp_path / "c") == str(tmp_path / "c")  # a pathlib.Path
    assert local("rel/kv") == str(cwd / "rel" / "kv")  # a plain relative path: under the working dir
    assert local("./memory:") == str(cwd / "memory:")  # a colon in a directory's name, said plainly
    assert local("~/kv") == os.path.join(os.path.expanduser("~"), "kv")
    assert isinstance(open_store("memory://"), MemoryStore)
    assert isinstance(open_store("Memory://"), MemoryStore)
    assert check_store_url("s3://bucket/kv") == "s3" and check_store_url("kv") == "file"
    assert tree(cwd) == []  # opening made none of them


# -- a local directory is made by the first write -------------------------------------------------------


@pytest.mark.parametrize("capacity", [None, 1 << 20])
def test_a_local_store_makes_its_directory_at_the_first_write(tmp_path, capacity):
    root = tmp_path / "deep" / "kv"
    store = open_store(str(root), capacity_bytes=capacity)
    assert isinstance(store, BoundedStore if capacity else LocalStore)
    assert run(store.get, K1) is None and run(store.contains, [K1]) == [False]
    assert run(store.scan) == [] and run(store.get_range, K1, 0, 4) is None
    run(store.delete, K1)
    assert not (tmp_path / "deep").exists()  # reads and a delete of nothing: nothing made

    run(store.put, K1, b"abc")
    assert run(store.get, K1) == b"abc"
    assert (root / K1[:2] / f"{K1}.kvc").read_bytes() == b"abc"
    if capacity:  # the capacity shared by every process on the directory: its lock made with it
        assert (root / LOCK_NAME).exists()
        assert run(store.put, K2, b"x" * (1 << 20)) is None and run(store.get, K1) is None  # evicted


def test_a_bounded_store_keeps_its_capacity_across_processes_once_made(tmp_path):
    """Two stores on one directory not made yet: the first write makes it; the other one's capacity
    counts what the first wrote (the shared lock and listing work on a directory made after opening)."""
    a = open_store(str(tmp_path / "kv"), capacity_bytes=100)
    b = open_store(str(tmp_path / "kv"), capacity_bytes=100)
    run(a.get, K1)  # a read first: nothing to evict, nothing made
    assert not (tmp_path / "kv").exists()
    run(a.put, K1, b"x" * 60)
    run(b.put, K2, b"y" * 60)  # no room beside a's object: b evicts it
    assert run(b.contains, [K1, K2]) == [False, True]
    assert sorted(o.key for o in run(a.scan)) == [K2]


def test_a_directory_that_could_never_be_made_is_refused_at_open(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    for url in (str(blocker / "kv"), f"file://{blocker}/deeper/kv", str(blocker)):
        with pytest.raises(StoreError, match="not usable") as exc:
            open_store(url)
        assert str(blocker) in str(exc.value)
    assert tree(tmp_path) == ["a-file"]


def test_an_existing_directory_is_probed_and_left_as_it_was(tmp_path):
    (tmp_path / "kv").mkdir()
    FsspecStore(str(tmp_path / "kv"))
    assert tree(tmp_path) == ["kv"]  # the probe file is gone


# -- read-only creates nothing -----------------------------------------------------------------------------


def test_read_only_creates_nothing_anywhere(tmp_path, cwd):
    missing = tmp_path / "missing" / "kv"
    with pytest.raises(StoreError, match="read-only"):
        open_store(str(missing), read_only=True)
    with pytest.raises(StoreError, match="read-only"):
        open_store(missing, read_only=True)
    assert not (tmp_path / "missing").exists()

    shared = tmp_path / "shared"
    writer = open_store(str(shared))
    run(writer.put, K1, b"abc")
    before = tree(tmp_path)
    reader = open_store(f"file://{shared}", read_only=True)
    assert run(reader.get, K1) == b"abc" and run(reader.contains, [K1, K2]) == [True, False]
    with pytest.raises(StoreError, match="read-only"):
        run(reader.put, K2, b"x")
    assert tree(tmp_path) == before  # no probe, no lock file, no shard directory
    assert tree(cwd) == []


@pytest.mark.parametrize("url", ["dir", "memory://"])
def test_read_only_refuses_a_capacity_it_could_never_keep(tmp_path, url):
    """A read-only store never writes, so it never evicts (a capacity would delete others' objects)."""
    url = str(tmp_path) if url == "dir" else url
    for options in ({"capacity_bytes": 100}, {"eviction": "lru"}):
        with pytest.raises(InvalidInputError, match="read_only=True takes no capacity_bytes"):
            open_store(url, read_only=True, **options)
    assert isinstance(open_store("memory://", read_only=True), ReadOnlyStore)
    assert tree(tmp_path) == []
