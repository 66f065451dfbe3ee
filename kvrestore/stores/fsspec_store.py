"""Chunk store over any fsspec filesystem: local disk, s3://, and whatever else fsspec can open.

Objects live at `<root>/<key[:2]>/<key>.kvc` (256 shard directories keep listings short on disk).

Three ways of doing I/O, picked from the filesystem:

* local disk: plain `open`/`os.replace` in a worker thread. A put writes `.tmp-<host>-<pid>-<uuid>` in
  the target directory and renames it over the final name, so readers never see half an object, even
  when several writers race on one key (the last rename wins, each rename is whole). Temp files are
  never listed as objects; opening a store removes those of dead writers on this host at once and
  any older than `STALE_TMP_SECONDS`.
* async filesystems (`fs.async_impl`, e.g. s3fs): the `_cat_file`/`_pipe_file`/... coroutines on the
  caller's event loop. Object stores make each PUT atomic themselves. The client session is bound to
  the loop that made it, so a store used from a new event loop (another `anyio.run`) makes a new one.
* other sync filesystems: their sync calls in a worker thread (`anyio.to_thread.run_sync`).

A missing object reads as None; any other filesystem failure raises StoreError, which the restorer
treats as a miss.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.stores.base import ChunkStore, StoredObject, check_key, is_key, mirrors_reads_of

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
#: temp files older than this are leftovers of a killed writer (a live one finishes in seconds)
STALE_TMP_SECONDS = 3600.0
#: concurrent requests one batch call (contains, get_many, get_ranges) keeps in flight on a remote store
REMOTE_CONCURRENCY = 32
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
_TMP_OWNER = re.compile(rf"^{re.escape(TMP_PREFIX)}([A-Za-z0-9]+)-(\d+)-[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _unreachable(exc: BaseException) -> bool:
    """A failure to reach the server at all (not an answer such as 403), by type, across libraries."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ConnectionClosedError",
            "ClientConnectorError",
            "ServerDisconnectedError",
            "ConnectionError",
        }
    )


def _dead_writer(name: str) -> bool:
    """A temp file written by a process of this host that no longer runs (so it will never be renamed)."""
    m = _TMP_OWNER.match(name)
    return (
        bool(m) and m.group(1) == _HOST and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2)))
    )


T = TypeVar("T")

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


#: seconds a directory may change again without its timestamp moving: a kernel's coarse clock ticks
#: every few ms; filesystems that store whole seconds (their timestamps have no fraction) take up to 2 s
RACY_FINE_S, RACY_COARSE_S = 0.05, 2.5


def _trusted(mtime_ns: int, listed_at: float) -> bool:
    """Whether a listing begun at `listed_at` of a directory whose mtime was then `mtime_ns` shows every
    change until that mtime moves: the directory had been still for longer than its timestamps' step,
    so any later change gets a later timestamp (git's "racy clean" rule)."""
    step = RACY_FINE_S if mtime_ns % 1_000_000_000 else RACY_COARSE_S
    return mtime_ns / 1e9 < listed_at - step


def _check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise InvalidInputError(f"invalid byte range [{start}, {end})")


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


#: buffers per `preadv` call (Linux's IOV_MAX is 1024)
IOV_BATCH = 512


def _scatter_read(fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
    """Fill `buffers` one after another from byte `offset` of the file with as few `preadv` calls as the
    kernel allows (the GIL released for each); returns the bytes placed (fewer where the file ends)."""
    placed, i, first = 0, 0, 0  # buffers[i][first:] is where the next byte goes
    while i < len(buffers):
        batch = [buffers[i][first:], *buffers[i + 1 : i + IOV_BATCH]]
        n = os.preadv(fd, batch, offset + placed)
        if n == 0:
            break
        placed += n
        while i < len(buffers) and n >= len(buffers[i]) - first:  # step past the buffers it filled
            n -= len(buffers[i]) - first
            i, first = i + 1, 0
        first += n
    return placed


class FsspecStore(ChunkStore):
    """ChunkStore over an fsspec URL, e.g. `FsspecStore("/var/cache/kv")` or `FsspecStore("s3://b/p")`.

    `storage_options` go to the filesystem (credentials, endpoint_url, ...). `fsync=True` makes local
    puts durable across power loss at the cost of a disk flush per object (a cache rarely needs it).

    A remote store that cannot be reached (connection refused or timed out) fails fast for
    `unreachable_cooloff_s` seconds before it asks again, so a restore running while its server is down
    recomputes at once instead of paying a connection attempt (and retries) per chunk.
    """

    #: seconds a remote store answers "unreachable" without asking after a connection failure
    unreachable_cooloff_s: float = 2.0

    def __init__(self, url: str, *, fsync: bool = False, **storage_options: Any) -> None:
        protocol, path = fsspec.core.split_protocol(url)
        if not path.strip():  # "file://" would be the current directory, "s3://" no bucket
            raise InvalidInputError(f"store URL {url!r} names no directory or bucket")
        try:
            fs_cls = fsspec.get_filesystem_class(protocol or "file")
        except (ImportError, ValueError) as e:
            raise StoreError(f"cannot open {url!r}: {e}") from e
        if issubclass(fs_cls, LocalFileSystem) and storage_options:  # it would ignore them silently
            raise InvalidInputError(
                f"a local directory store takes no storage options, got {', '.join(sorted(storage_options))}"
            )
        if fs_cls.async_impl:
            # Run the coroutines on the caller's loop, and do not share a cached instance bound to another.
            storage_options.setdefault("asynchronous", True)
            storage_options.setdefault("skip_instance_cache", True)
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except Exception as e:
            raise StoreError(f"cannot open {url!r}: {type(e).__name__}: {e}") from e
        self._setup(fs, root, url, fsync)

    @classmethod
    def from_filesystem(cls, fs: fsspec.AbstractFileSystem, root: str, *, fsync: bool = False) -> FsspecStore:
        """A store over an already built filesystem object, rooted at `root` (a path on that filesystem)."""
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self = cls.__new__(cls)
        self._setup(fs, root, f"{protocol}://{root}", fsync)
        return self

    def _setup(self, fs: fsspec.AbstractFileSystem, root: str, name: str, fsync: bool) -> None:
        self.fs = fs
        self.name = name
        self.fsync = fsync
        self.local = isinstance(fs, LocalFileSystem)
        self.is_async = bool(getattr(fs, "async_impl", False)) and not self.local
        self._down_until = 0.0  # monotonic time before which a remote store does not ask again
        self._down_reason = ""
        self._session: Any = None
        self._session_loop: Any = None  # the event loop token the session belongs to
        self._session_lock: anyio.Lock | None = None
        self._listings: dict[str, tuple[int, list[StoredObject]]] = {}  # shard dir: (its mtime, objects)
        if self.local:
            self.root = self.local_dir = os.path.abspath(root)
            self._open_local()
        else:
            self.root = root.rstrip("/")

    # -- paths and local set-up ------------------------------------------------------------------

    def path(self, key: str) -> str:
        """Where the object of `key` lives on the filesystem."""
        check_key(key)
        if self.local:
            return os.path.join(self.root, key[:2], key + SUFFIX)
        return f"{self.root}/{key[:2]}/{key}{SUFFIX}"

    def _open_local(self) -> None:
        """Create the root, prove it is writable, and sweep temp files left by killed writers."""
        probe = os.path.join(self.root, f"{TMP_PREFIX}probe-{uuid.uuid4().hex}")
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"kvrestore")
            os.remove(probe)
        except OSError as e:
            raise StoreError(
                f"chunk store directory {self.root!r} is not usable (cannot create or write it): "
                f"{type(e).__name__}: {e}"
            ) from e
        self._sweep_temp()

    def _sweep_temp(self) -> None:
        # One scandir per shard directory: on a store with millions of objects this costs about a
        # second at open time, once per process.
        cutoff = time.time() - STALE_TMP_SECONDS
        dirs = [self.root]
        with suppress(OSError), os.scandir(self.root) as it:
            dirs += [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        for d in dirs:
            with suppress(OSError), os.scandir(d) as it:
                for e in it:
                    if e.name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False):
                        with suppress(OSError):
                            if e.stat(follow_symlinks=False).st_mtime < cutoff or _dead_writer(e.name):
                                os.remove(e.path)

    # -- local I/O (runs in worker threads) ------------------------------------------------------

    @staticmethod
    def _read_local(path: str, ranges: Sequence[tuple[int, int]] | None) -> list[bytes] | None:
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

    @staticmethod
    def _on_local_file(path: str, read: Callable[[int], T]) -> T | None:
        """`read(fd)` on the open file at `path`; None when it is absent; OS errors as StoreError."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        try:
            return read(fd)
        except OSError as e:
            raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        finally:
            os.close(fd)

    @classmethod
    def _read_local_into(cls, path: str, buffer: memoryview) -> int | None:
        """The object's size, and as much of it as fits read into `buffer` (see `ChunkStore.read_into`)."""

        def read(fd: int) -> int:
            # the file a rename may replace is this open one: size and bytes agree
            size = os.fstat(fd).st_size
            got = _read_all(fd, buffer[: min(size, len(buffer))])
            return size if got == min(size, len(buffer)) else got  # shrank under us: report what is there

        return cls._on_local_file(path, read)

    def _write_local(self, path: str, data: bytes) -> None:
        d = os.path.dirname(path)
        tmp = os.path.join(d, f"{TMP_PREFIX}{_HOST}-{os.getpid()}-{uuid.uuid4().hex}")
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

    @staticmethod
    def _delete_local(path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"cannot delete {path}: {type(e).__name__}: {e}") from e

    # -- generic fsspec I/O ------------------------------------------------------------------------

    async def _ensure_session(self) -> None:
        """Async filesystems with a client session (s3fs, http) must create it on the running loop.

        A session made on another (possibly closed) loop is dropped, its sockets closed, and a new one
        made here: the same store then works across `anyio.run` calls and blocking portals.
        """
        if not hasattr(self.fs, "set_session"):
            return
        loop = anyio.lowlevel.current_token()
        if self._session is not None and self._session_loop == loop:
            return
        if self._session_loop != loop:
            stale, self._session = self._session, None
            self._session_loop, self._session_lock = loop, anyio.Lock()
            if stale is not None:
                self._drop_stale_session()
        assert self._session_lock is not None
        async with self._session_lock:
            if self._session is None:
                self._session = await self.fs.set_session(refresh=True)

    def _drop_stale_session(self) -> None:
        """Close, without its (gone) loop, the sockets of a session made on another loop.

        Best effort over private attributes (aiobotocore's aiohttp sessions); the worst case is a
        ResourceWarning at garbage collection.
        """
        client = getattr(self.fs, "_s3", None)
        http = getattr(getattr(client, "_endpoint", None), "http_session", None)
        for sess in list((getattr(http, "_sessions", None) or {}).values()):
            with suppress(Exception):
                connector = sess.connector
                sess.detach()
                if connector is not None:
                    connector._close()
        with suppress(AttributeError):
            self.fs._s3 = None

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`fs.<method>(...)`: the `_<method>` coroutine on async filesystems, else in a worker thread."""
        if self._down_until and time.monotonic() < self._down_until:
            raise StoreError(
                f"{self.name} is unreachable ({self._down_reason}); asking again in "
                f"{self._down_until - time.monotonic():.1f} s"
            )
        try:
            if self.is_async:
                await self._ensure_session()
                out = await getattr(self.fs, "_" + method)(*args, **kwargs)
            else:
                out = await self._thread(partial(getattr(self.fs, method), *args, **kwargs))
        except FileNotFoundError:
            self._down_until = 0.0  # the server answered
            raise
        except Exception as e:
            if _unreachable(e):
                self._down_until = time.monotonic() + self.unreachable_cooloff_s
                self._down_reason = f"{type(e).__name__}: {e}"
            raise
        self._down_until = 0.0
        return out

    @staticmethod
    async def _thread(fn: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(fn)

    async def _cat(self, key: str, start: int | None = None, end: int | None = None) -> bytes | None:
        path = self.path(key)
        try:
            if start is None:
                return bytes(await self._call("cat_file", path))
            return bytes(await self._call("cat_file", path, start=start, end=end))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise StoreError(f"cannot read {self.name} {path}: {type(e).__name__}: {e}") from e

    # -- ChunkStore --------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        if self.local:
            path = self.path(key)
            got = await self._thread(partial(self._read_local, path, None))
            return None if got is None else got[0]
        return await self._cat(key)

    @property
    def reads_now(self) -> bool:  # type: ignore[override]
        """A local directory reads from any thread (`preadv`), unless a subclass changed how it reads."""
        return self._preads and mirrors_reads_of(self, FsspecStore)

    @property
    def _preads(self) -> bool:
        """A local directory on a system with `preadv`: reads go straight into the caller's buffers."""
        return self.local and hasattr(os, "preadv")

    def get_now(self, key: str) -> bytes | None:
        if not self.local:
            return super().get_now(key)
        got = self._read_local(self.path(key), None)
        return None if got is None else got[0]

    def read_into_now(self, key: str, buffer: memoryview) -> int | None:
        if not self._preads:
            return super().read_into_now(key, buffer)
        return self._read_local_into(self.path(key), buffer)

    def scatter_into_now(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int | None:
        if not self._preads:
            return super().scatter_into_now(key, offset, buffers)
        return self._on_local_file(self.path(key), lambda fd: _scatter_read(fd, offset, buffers))

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        if self._preads:
            return await self._thread(partial(self._read_local_into, self.path(key), buffer))
        return await super().read_into(key, buffer)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Local reads clamp `end` at the file size; remote ones pass it on (an HTTP Range on s3)."""
        _check_range(start, end)
        if self.local:
            path = self.path(key)
            got = await self._thread(partial(self._read_local, path, [(start, end)]))
            return None if got is None else got[0]
        if end == start:  # an empty range request is invalid HTTP; answer it from existence
            return b"" if (await self.contains([key]))[0] else None
        return await self._cat(key, start, end)

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        if not self.local:
            return await super().get_ranges(key, ranges)
        for a, b in ranges:
            _check_range(a, b)
        path = self.path(key)
        got = await self._thread(partial(self._read_local, path, list(ranges)))
        return [None] * len(ranges) if got is None else list(got)

    async def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        if self.local:
            await self._thread(partial(self._write_local, path, data))
            return
        try:
            try:
                await self._call("pipe_file", path, bytes(data))
            except FileNotFoundError:  # filesystems with real directories (sftp, wrapped local)
                await self._call("makedirs", path.rsplit("/", 1)[0], exist_ok=True)
                await self._call("pipe_file", path, bytes(data))
        except Exception as e:
            raise StoreError(f"cannot write {self.name} {path}: {type(e).__name__}: {e}") from e

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        paths = [self.path(k) for k in keys]
        if self.local:
            return await self._thread(lambda: [os.path.exists(p) for p in paths])
        try:
            if not self.is_async:
                return await self._thread(lambda: [bool(self.fs.exists(p)) for p in paths])
            # Object stores have no multi-key HEAD: all requests go out at once (one round trip of
            # latency for up to REMOTE_CONCURRENCY keys), never one after another.
            return await self._batch([partial(self._exists, p) for p in paths], bool)
        except Exception as e:
            raise StoreError(f"cannot list {self.name}: {type(e).__name__}: {e}") from e

    async def _exists(self, path: str) -> bool:
        """One HEAD on s3fs (its `exists` may add a LIST for a missing key, and may answer from a
        listing cache that other writers have made stale); `exists` elsewhere."""
        if not hasattr(self.fs, "_call_s3"):
            return bool(await self._call("exists", path))
        bucket, key, _ = self.fs.split_path(path)
        try:
            await self._call("call_s3", "head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    @staticmethod
    async def _batch(calls: Sequence[Callable[[], Any]], convert: Callable[[Any], T]) -> list[T]:
        """Run coroutine factories concurrently, at most REMOTE_CONCURRENCY at a time, results in order."""
        out: list[Any] = [None] * len(calls)
        limiter = anyio.CapacityLimiter(REMOTE_CONCURRENCY)

        async def one(i: int) -> None:
            async with limiter:
                out[i] = convert(await calls[i]())

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(calls)):
                    tg.start_soon(one, i)
        except BaseExceptionGroup as group:  # the first failure, by itself, says what went wrong
            raise group.exceptions[0] from None
        return out

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.local:
            return await super().get_many(keys)
        return await self._batch([partial(self._cat, k) for k in keys], lambda x: x)

    async def scan(self) -> list[StoredObject]:
        """Every object under the root (temp files and foreign names skipped): one listing."""
        if self.local:
            return await self._thread(self._scan_local)
        try:
            found = await self._call("find", self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StoreError(f"cannot list {self.name}: {type(e).__name__}: {e}") from e
        out = []
        for path, info in found.items():
            name = path.rsplit("/", 1)[-1]
            key = name[: -len(SUFFIX)]
            if name.endswith(SUFFIX) and is_key(key) and path.endswith(f"{key[:2]}/{name}"):
                mtime = info.get("LastModified") or info.get("mtime") or info.get("created") or 0.0
                if hasattr(mtime, "timestamp"):
                    mtime = mtime.timestamp()
                out.append(StoredObject(key, int(info.get("size") or 0), float(mtime)))
        return out

    def _scan_local(self) -> list[StoredObject]:
        """One listing per shard directory, except shards whose directory has not changed since a
        listing that can be trusted (see `_trusted`): a store listed again and again (a shared
        `BoundedStore` lists before every write) pays only for the shards written since."""
        out: list[StoredObject] = []
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
        with suppress(OSError), os.scandir(d) as it:
            for e in it:
                key = e.name[: -len(SUFFIX)]
                if e.name.endswith(SUFFIX) and is_key(key) and key[:2] == os.path.basename(d):
                    with suppress(OSError):
                        st = e.stat(follow_symlinks=False)
                        out.append(StoredObject(key, st.st_size, st.st_mtime))
        return out

    async def delete(self, key: str) -> None:
        path = self.path(key)
        if self.local:
            await self._thread(partial(self._delete_local, path))
            return
        try:
            await self._call("rm_file", path)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise StoreError(f"cannot delete {self.name} {path}: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        if self._session is not None and self._session_loop != anyio.lowlevel.current_token():
            self._drop_stale_session()  # made on another loop: its own close() cannot run here
            self._session = None
        session, self._session = self._session, None
        if session is not None and hasattr(session, "close"):
            with suppress(Exception):
                res = session.close()
                if inspect.isawaitable(res):
                    await res

    def __repr__(self) -> str:
        return f"FsspecStore({self.name!r})"
