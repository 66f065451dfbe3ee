"""Chunk store in a local directory: plain `open`/`preadv`/`os.replace` in worker threads.

Objects live at `<root>/<key[:2]>/<key>.kvc` (see `kvrestore.stores.files`). A put writes
`.tmp-<host>-<pid>-<uuid>` in the target directory and renames it over the final name, so readers never
see half an object, even when several writers race on one key (the last rename wins, each rename is
whole). Temp files are never listed as objects; opening a store removes those of dead writers on this
host at once and any older than `STALE_TMP_SECONDS`.

Reads go straight into the caller's buffers (`preadv`, the GIL released) and work from any thread
(`reads_sync`), so a chunk load runs start to end on a load-lane thread. The reads that make their own
result (`get`, `get_range(s)`, `contains`) run in threads a cancellation abandons at once: on a network
filesystem that stalls, a deadline ends them, and what they bring late is dropped. A missing object
reads as None; any other OS failure raises StoreError, which the restorer treats as a miss.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from itertools import accumulate
from typing import Any, TypeVar

import anyio.to_thread
import fsspec

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.settings import check_bool
from kvrestore.stores.base import ChunkStore, StoredObject, check_key, mirrors_reads_of
from kvrestore.stores.files import SUFFIX, TMP_PREFIX, check_range, filesystem_class, is_local, stored_key
from kvrestore.stores.urls import check_local_url

#: temp files older than this are leftovers of a killed writer (a live one finishes in seconds)
STALE_TMP_SECONDS = 3600.0
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
_TMP_OWNER = re.compile(rf"^{re.escape(TMP_PREFIX)}([A-Za-z0-9]+)-(\d+)-[0-9a-f]+$")
#: buffers per `preadv` call (Linux's IOV_MAX is 1024)
IOV_BATCH = 512
#: seconds a directory may change again without its timestamp moving: a kernel's coarse clock ticks
#: every few ms; filesystems that store whole seconds (their timestamps have no fraction) take up to 2 s
RACY_FINE_S, RACY_COARSE_S = 0.05, 2.5

T = TypeVar("T")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        pass
    return True


def _dead_writer(name: str) -> bool:
    """A temp file written by a process of this host that has exited (so it will never be renamed)."""
    m = _TMP_OWNER.match(name)
    if m is None:
        return False
    return m.group(1) == _HOST and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2)))


def sweep_temp(root: str, doomed: Callable[[os.DirEntry[str]], bool]) -> None:
    """Remove the temp files of writes under `root` (in it and its shard directories) that `doomed`
    picks. One scandir per shard directory: on a store with millions of objects this costs about a
    second."""
    dirs = [root]
    with suppress(OSError), os.scandir(root) as it:
        dirs += [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    for d in dirs:
        with suppress(OSError), os.scandir(d) as it:
            for e in it:
                if e.name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False):
                    with suppress(OSError):
                        if doomed(e):
                            os.remove(e.path)


def temp_prefix(host: str, pid: int) -> str:
    """How the names of the temp files written by process `pid` of `host` begin."""
    return f"{TMP_PREFIX}{host}-{pid}-"


def _trusted(mtime_ns: int, listed_at: float) -> bool:
    """Whether a listing begun at `listed_at` of a directory whose mtime was then `mtime_ns` shows every
    change until that mtime moves: the directory had been still for longer than its timestamps' step,
    so any later change gets a later timestamp (git's "racy clean" rule)."""
    step = RACY_FINE_S if mtime_ns % 1_000_000_000 else RACY_COARSE_S
    return mtime_ns / 1e9 < listed_at - step


def _read_all(fd: int, buffer: memoryview) -> int:
    """Fill `buffer` from the start of the file, or as much as the file holds; returns bytes read.

    One `preadv` per call into the caller's buffer: the kernel copies from the page cache, the GIL is
    released for the whole read, and no Python object is made per byte range.
    """
    total = 0
    while total < len(buffer):
        n = os.preadv(fd, [buffer[total:]], total)
        if n == 0:
            break
        total += n  # a short read (a signal, a huge request): go on where it stopped
    return total


def _scatter_read(fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
    """Fill `buffers` one after another from byte `offset` of the file with as few `preadv` calls as the
    kernel allows (the GIL released for each); returns the bytes placed (fewer where the file ends).
    A read of thousands of small buffers (a layer's pages) does no Python work per buffer beyond the
    batch it is passed in: where the next read starts is found among the buffers' running ends."""
    ends = list(accumulate(map(len, buffers)))  # ends[i]: bytes up to the end of buffers[i]
    placed, i = 0, 0  # buffers[i] is where the next byte goes
    while i < len(buffers):
        first = placed - (ends[i - 1] if i else 0)
        batch = [buffers[i][first:], *buffers[i + 1 : i + IOV_BATCH]]
        n = os.preadv(fd, batch, offset + placed)
        if n == 0:
            break
        placed += n
        i = bisect_right(ends, placed, i)  # past every buffer now full
    return placed


def _read_ranges(path: str, ranges: Sequence[tuple[int, int]] | None) -> list[bytes] | None:
    """The whole file (`ranges` None) or the given byte ranges of it; None when it is absent."""
    try:
        with open(path, "rb") as f:
            if ranges is None:
                return [f.read()]
            # clamp at the file size: read(n) allocates n bytes up front, even past the end
            size = os.fstat(f.fileno()).st_size
            out = []
            for a, b in ranges:
                f.seek(a)
                out.append(f.read(max(0, min(b, size) - a)))
            return out
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e


def _on_file(path: str, read: Callable[[int], T]) -> T | None:
    """`read(fd)` on the open file at `path`; None when it is absent; OS errors as StoreError."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return read(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e


def _read_file_into(path: str, buffer: memoryview) -> int | None:
    """The object's size, and as much of it as fits read into `buffer` (see `ChunkStore.read_into`)."""

    def read(fd: int) -> int:
        # the file a rename may replace is this open one: size and bytes agree
        size = os.fstat(fd).st_size
        got = _read_all(fd, buffer[: min(size, len(buffer))])
        return size if got == min(size, len(buffer)) else got  # shrank under us: report what is there

    return _on_file(path, read)


def _delete_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StoreError(f"cannot delete {path}: {type(e).__name__}: {e}") from e


async def _abandonable(fn: Callable[[], T]) -> T:
    """`fn()` in a thread that a cancellation (a deadline) abandons at once: for a call that makes its
    own result (bytes, flags) and writes nowhere else, so a read stalled on a network filesystem holds
    nobody up, and what it brings late is dropped."""
    return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)


class LocalStore(ChunkStore):
    """ChunkStore in a local directory, e.g. `LocalStore("/var/cache/kv")` or `LocalStore("file:///kv")`.

    The directory is made by the first write that needs it (with its parents), not when the store opens:
    opening checks only that it could be made, so a store opened and only read leaves nothing behind.

    `fsync=True` makes puts durable across power loss at the cost of a disk flush per object (a cache
    rarely needs it). `read_only=True` opens an existing directory without writing to it (no write
    probe, no sweep of dead writers' temp files): it loads, and a put or delete is a `StoreError`, for a
    replica that only reads a shared cache, with read-only rights. `FsspecStore(path)` of a local path
    makes one of these too.
    """

    #: kept for callers that ask a store built from a URL which kind it is
    local = True
    is_async = False

    def __init__(
        self, url: str, *, fsync: bool = False, read_only: bool = False, **storage_options: Any
    ) -> None:
        if not is_local(filesystem_class(url)):
            raise InvalidInputError(f"{url!r} is not a local directory (FsspecStore opens remote URLs)")
        check_local_url(url, *fsspec.core.split_protocol(url))
        if storage_options:  # a local filesystem would ignore them silently
            raise InvalidInputError(
                f"a local directory store takes no storage options, got {', '.join(sorted(storage_options))}"
            )
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except Exception as e:
            raise StoreError(f"cannot open {url!r}: {type(e).__name__}: {e}") from e
        self.name = url
        self.fsync = check_bool("fsync", fsync)
        self.read_only = check_bool("read_only", read_only)
        self.root = self.local_dir = os.path.abspath(root)
        self._listings: dict[str, tuple[int, list[StoredObject]]] = {}  # shard dir: (its mtime, objects)
        self._open()

    def path(self, key: str) -> str:
        """Where the object of `key` lives on disk."""
        check_key(key)
        return os.path.join(self.root, key[:2], key + SUFFIX)

    def _open(self) -> None:
        """Check the root can be used, creating nothing: an existing root is proved writable (a probe
        file, removed) and swept of temp files left by killed writers; a missing one must be creatable
        (its nearest existing ancestor a writable directory) and is made by the first write that needs
        it. Read-only: the root must be a directory that can be read."""
        if self.read_only:
            if not os.path.isdir(self.root) or not os.access(self.root, os.R_OK | os.X_OK):
                raise StoreError(
                    f"chunk store directory {self.root!r} is not usable read-only (not a readable directory)"
                )
            return
        if not os.path.isdir(self.root):
            self._check_creatable()
            return
        probe = os.path.join(self.root, f"{TMP_PREFIX}probe-{uuid.uuid4().hex}")
        try:
            with open(probe, "wb") as f:
                f.write(b"kvrestore")
            os.remove(probe)
        except OSError as e:
            raise StoreError(
                f"chunk store directory {self.root!r} is not usable (cannot write it): {type(e).__name__}: {e}"
            ) from e
        self._sweep_temp()

    def _check_creatable(self) -> None:
        """Refuse a missing root that a write could not create (see `_open`)."""
        there = self.root
        while not os.path.lexists(there):
            there = os.path.dirname(there)
        if not os.path.isdir(there) or not os.access(there, os.W_OK | os.X_OK):
            why = "not a directory" if not os.path.isdir(there) else "not a writable directory"
            raise StoreError(
                f"chunk store directory {self.root!r} is not usable (cannot create it: {there!r} is {why})"
            )

    def _sweep_temp(self) -> None:
        cutoff = time.time() - STALE_TMP_SECONDS
        sweep_temp(
            self.root, lambda e: e.stat(follow_symlinks=False).st_mtime < cutoff or _dead_writer(e.name)
        )

    def _write(self, path: str, data: bytes) -> None:
        d = os.path.dirname(path)
        tmp = os.path.join(d, f"{temp_prefix(_HOST, os.getpid())}{uuid.uuid4().hex}")
        try:
            try:
                f = open(tmp, "wb")  # noqa: SIM115 - closed by the with below
            except FileNotFoundError:
                os.makedirs(d, exist_ok=True)
                f = open(tmp, "wb")  # noqa: SIM115
            with f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            with suppress(OSError):
                os.remove(tmp)
            raise StoreError(f"cannot write {path}: {type(e).__name__}: {e}") from e

    # -- ChunkStore --------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        got = await _abandonable(partial(_read_ranges, self.path(key), None))
        return None if got is None else got[0]

    @property
    def reads_sync(self) -> bool:  # type: ignore[override]
        """Reads work from any thread (`preadv`), unless a subclass changed how it reads."""
        return self._preads and mirrors_reads_of(self, LocalStore)

    @property
    def _preads(self) -> bool:
        """A system with `preadv`: reads go straight into the caller's buffers."""
        return hasattr(os, "preadv")

    def get_sync(self, key: str) -> bytes | None:
        got = _read_ranges(self.path(key), None)
        return None if got is None else got[0]

    def read_into_sync(self, key: str, buffer: memoryview) -> int | None:
        if not self._preads:
            return super().read_into_sync(key, buffer)
        return _read_file_into(self.path(key), buffer)

    def scatter_into_sync(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int | None:
        if not self._preads:
            return super().scatter_into_sync(key, offset, buffers)
        return _on_file(self.path(key), lambda fd: _scatter_read(fd, offset, buffers))

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        if self._preads:
            return await anyio.to_thread.run_sync(_read_file_into, self.path(key), buffer)
        return await super().read_into(key, buffer)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end), `end` clamped at the file size."""
        check_range(start, end)
        got = await _abandonable(partial(_read_ranges, self.path(key), [(start, end)]))
        return None if got is None else got[0]

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        for a, b in ranges:
            check_range(a, b)
        got = await _abandonable(partial(_read_ranges, self.path(key), list(ranges)))
        return [None] * len(ranges) if got is None else list(got)

    async def put(self, key: str, data: bytes) -> None:
        self._check_writable("write", key)
        await anyio.to_thread.run_sync(self._write, self.path(key), data)

    def _check_writable(self, what: str, key: str) -> None:
        if self.read_only:
            raise StoreError(f"chunk store {self.root!r} is read-only: cannot {what} {key[:12]}")

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return await _abandonable(partial(self._exists, keys))

    def contains_sync(self, keys: Sequence[str]) -> list[bool] | None:
        return self._exists(keys) if mirrors_reads_of(self, LocalStore, ("contains",)) else None

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.path(k)) for k in keys]

    async def scan(self) -> list[StoredObject]:
        """Every object under the root (temp files and foreign names skipped)."""
        return await anyio.to_thread.run_sync(self._scan)

    def _scan(self) -> list[StoredObject]:
        """One listing per shard directory, except shards whose directory has not changed since a
        listing that can be trusted (see `_trusted`): a store listed again and again (a shared
        `BoundedStore` lists before every write) pays only for the shards written since."""
        out: list[StoredObject] = []
        shards: list[str] = []  # none in a root not made yet
        with suppress(OSError), os.scandir(self.root) as top:
            shards = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        for d in shards:
            listed_at = time.time()  # before the stat: see _trusted
            try:
                mtime_ns = os.stat(d).st_mtime_ns
            except OSError:
                continue
            cached = self._listings.get(d)
            if cached is not None and cached[0] == mtime_ns:
                out += cached[1]
                continue
            found = self._scan_shard(d)
            if _trusted(mtime_ns, listed_at):
                self._listings[d] = (mtime_ns, found)
            else:
                self._listings.pop(d, None)
            out += found
        return out

    @staticmethod
    def _scan_shard(d: str) -> list[StoredObject]:
        out = []
        shard = os.path.basename(d)
        with suppress(OSError), os.scandir(d) as it:
            for e in it:
                key = stored_key(e.name, shard)
                if key is not None:
                    with suppress(OSError):
                        st = e.stat(follow_symlinks=False)
                        out.append(StoredObject(key, st.st_size, st.st_mtime))
        return out

    async def delete(self, key: str) -> None:
        self._check_writable("delete", key)
        await anyio.to_thread.run_sync(_delete_file, self.path(key))

    def __repr__(self) -> str:
        return f"LocalStore({self.name!r})"
