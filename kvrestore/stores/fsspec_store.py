"""Chunk store over any fsspec filesystem: local disk, s3://, and whatever else fsspec can open.

Objects live at `<root>/<key[:2]>/<key>.kvc` (256 shard directories keep listings short on disk).

Three ways of doing I/O, picked from the filesystem:

* local disk: plain `open`/`os.replace` in a worker thread. A put writes `.tmp-<uuid>` in the target
  directory and renames it over the final name, so readers never see half an object, even when several
  writers race on one key (the last rename wins, each rename is whole).
* async filesystems (`fs.async_impl`, e.g. s3fs): the `_cat_file`/`_pipe_file`/... coroutines on the
  caller's event loop. Object stores make each PUT atomic themselves.
* other sync filesystems: their sync calls in a worker thread (`anyio.to_thread.run_sync`).

A missing object reads as None; any other filesystem failure raises StoreError, which the restorer
treats as a miss.
"""

from __future__ import annotations

import inspect
import os
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import StoreError
from .base import PROBE_BYTES, ChunkStore, ReadPlan, check_key

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
#: temp files older than this are leftovers of a killed writer (a live one finishes in seconds)
STALE_TMP_SECONDS = 3600.0

T = TypeVar("T")


def _check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end})")


def _preadv_all(fd: int, buffers: Sequence[memoryview], pos: int) -> int:
    """Fill `buffers` from byte `pos` of the file, or as much as the file holds; returns bytes read."""
    want = sum(b.nbytes for b in buffers)
    if len(buffers) <= 1024:  # IOV_MAX; the common case is one call that fills everything
        n = os.preadv(fd, buffers, pos)
        if n == want or n == 0:
            return n
    total, rest = 0, [b for b in buffers if b.nbytes]
    while rest:  # preadv returned early (a signal, a huge request): go on where it stopped
        n = os.preadv(fd, rest[:1024], pos + total)
        if n == 0:
            break
        total += n
        while rest and n >= rest[0].nbytes:
            n -= rest[0].nbytes
            rest.pop(0)
        if n:
            rest[0] = rest[0][n:]
    return total


class FsspecStore(ChunkStore):
    """ChunkStore over an fsspec URL, e.g. `FsspecStore("/var/cache/kv")` or `FsspecStore("s3://b/p")`.

    `storage_options` go to the filesystem (credentials, endpoint_url, ...). `fsync=True` makes local
    puts durable across power loss at the cost of a disk flush per object (a cache rarely needs it).
    """

    def __init__(self, url: str, *, fsync: bool = False, **storage_options: Any) -> None:
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        try:
            fs_cls = fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            raise StoreError(f"cannot open {url!r}: {e}") from e
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
        self._session: Any = None
        self._session_lock = anyio.Lock()
        if self.local:
            self.root = os.path.abspath(root)
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
                            if e.stat(follow_symlinks=False).st_mtime < cutoff:
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
    def _read_local_into(path: str, plan: ReadPlan) -> int | None:
        """pread the probe, ask the plan where the rest goes, preadv each group there: no extra copy."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        try:
            offset, groups = plan.locate(memoryview(os.pread(fd, PROBE_BYTES, 0)))
            pos = offset
            for i, group in enumerate(groups):
                got = _preadv_all(fd, group, pos)
                pos += got
                if got < sum(b.nbytes for b in group):
                    break
                plan.filled(i)
            return pos - offset
        except OSError as e:
            raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        finally:
            os.close(fd)

    def _write_local(self, path: str, data: bytes) -> None:
        d = os.path.dirname(path)
        tmp = os.path.join(d, f"{TMP_PREFIX}{uuid.uuid4().hex}")
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
        """Async filesystems with a client session (s3fs, http) must create it on the running loop."""
        if self._session is not None or not hasattr(self.fs, "set_session"):
            return
        async with self._session_lock:
            if self._session is None:
                self._session = await self.fs.set_session()

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`fs.<method>(...)`: the `_<method>` coroutine on async filesystems, else in a worker thread."""
        if self.is_async:
            await self._ensure_session()
            return await getattr(self.fs, "_" + method)(*args, **kwargs)
        return await self._thread(partial(getattr(self.fs, method), *args, **kwargs))

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

    async def read_into(self, key: str, plan: ReadPlan) -> int | None:
        if self.local and hasattr(os, "preadv"):
            return await self._thread(partial(self._read_local_into, self.path(key), plan))
        return await super().read_into(key, plan)

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
            out = [False] * len(paths)

            async def one(i: int, p: str) -> None:
                out[i] = bool(await self._call("exists", p))

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(paths):
                    tg.start_soon(one, i, p)
            return out
        except Exception as e:
            raise StoreError(f"cannot list {self.name}: {type(e).__name__}: {e}") from e

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
        session, self._session = self._session, None
        if session is not None and hasattr(session, "close"):
            with suppress(Exception):
                res = session.close()
                if inspect.isawaitable(res):
                    await res

    def __repr__(self) -> str:
        return f"FsspecStore({self.name!r})"
