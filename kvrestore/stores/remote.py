"""Chunk store over an fsspec filesystem other than local disk: s3://, and whatever else fsspec can open.

Objects live at `<root>/<key[:2]>/<key>.kvc` (see `kvrestore.stores.files`). Two ways of doing I/O,
picked from the filesystem:

* async filesystems (`fs.async_impl`, e.g. s3fs): the `_cat_file`/`_pipe_file`/... coroutines on the
  caller's event loop. Object stores make each PUT atomic themselves. The client session is bound to
  the loop that made it, so a store used from a new event loop (another `anyio.run`) makes a new one.
* other sync filesystems: their sync calls in a worker thread (`anyio.to_thread.run_sync`).

A local directory is a `LocalStore` (atomic renames, `preadv` reads); `FsspecStore(path)` of a local path
makes one, so a caller can hand any URL to `FsspecStore`. A missing object reads as None; any other
filesystem failure raises StoreError, which the restorer treats as a miss.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import fsspec

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.settings import check_bool
from kvrestore.stores.base import ChunkStore, StoredObject, check_key, copy_object, in_order
from kvrestore.stores.files import SUFFIX, check_range, filesystem_class, is_local, stored_key
from kvrestore.stores.local import LocalStore
from kvrestore.stores.outage import COOLOFF_S, Outage

#: concurrent requests one batch call (contains, get_many, get_ranges) keeps in flight on a remote store
REMOTE_CONCURRENCY = 32

T = TypeVar("T")

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


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


def _empty_range(exc: BaseException) -> bool:
    """Whether `exc` is an object store's answer that a range starting at byte 0 cannot be served
    (HTTP 416, InvalidRange): what a ranged read of an empty object gets.

    Judged from the answer itself (a botocore error code, an HTTP status) along the exception's causes,
    or from the phrase servers send with it; never from digits in the text, which can be a port number
    in a connection error, and a failure to reach the server never counts."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _unreachable(e):
            return False
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            if response.get("Error", {}).get("Code") == "InvalidRange":
                return True
            if response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                return True
        if getattr(e, "status", None) == 416:  # aiohttp's ClientResponseError (http, gcsfs)
            return True
        e = e.__cause__ or e.__context__
    text = str(exc).lower()
    return "invalidrange" in text or "range not satisfiable" in text or "range is not satisfiable" in text


class FsspecStore(ChunkStore):
    """ChunkStore over an fsspec URL, e.g. `FsspecStore("s3://b/p")`; `FsspecStore("/var/cache/kv")` (a
    local path) makes a `LocalStore`.

    `storage_options` go to the filesystem (credentials, endpoint_url, ...); `fsync` is for a local
    directory (see `LocalStore`) and means nothing to an object store.

    An object store's bucket is never created behind the caller's back: a write to a bucket that does
    not exist raises StoreError (reads of it are misses), unless `create_bucket=True`.

    A remote store that cannot be reached (connection refused or timed out) fails fast for
    `unreachable_cooloff_s` seconds before it asks again, so a restore running while its server is down
    recomputes at once instead of paying a connection attempt (and retries) per chunk.
    """

    #: kept for callers that ask a store built from a URL which kind it is
    local = False
    #: seconds a remote store answers "unreachable" without asking after a connection failure
    unreachable_cooloff_s: float = COOLOFF_S

    def __new__(
        cls,
        url: str | None = None,
        *,
        fsync: bool = False,
        create_bucket: bool = False,
        **storage_options: Any,
    ) -> Any:
        # url None: copy and pickle make an empty instance to fill in
        if cls is FsspecStore and url is not None and is_local(filesystem_class(url)):
            return LocalStore(url, fsync=fsync, **storage_options)  # not a FsspecStore: no __init__ after
        return super().__new__(cls)

    def __init__(
        self, url: str, *, fsync: bool = False, create_bucket: bool = False, **storage_options: Any
    ) -> None:
        fs_cls = filesystem_class(url)
        fsync, create_bucket = check_bool("fsync", fsync), check_bool("create_bucket", create_bucket)
        if is_local(fs_cls):  # a subclass of FsspecStore given a local path
            raise InvalidInputError(f"{url!r} is a local directory: use (or subclass) LocalStore")
        if fs_cls.async_impl:
            # Run the coroutines on the caller's loop, and do not share a cached instance bound to another.
            storage_options.setdefault("asynchronous", True)
            storage_options.setdefault("skip_instance_cache", True)
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except Exception as e:
            raise StoreError(f"cannot open {url!r}: {type(e).__name__}: {e}") from e
        self._setup(fs, root, url, fsync)
        self.create_bucket = create_bucket

    @classmethod
    def from_filesystem(
        cls, fs: fsspec.AbstractFileSystem, root: str, *, fsync: bool = False
    ) -> FsspecStore | LocalStore:
        """A store over an already built filesystem object, rooted at `root` (a path on that filesystem);
        a `LocalStore` for the local filesystem."""
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if is_local(type(fs)):
            return LocalStore(root, fsync=fsync)
        self = ChunkStore.__new__(cls)  # past the local-path dispatch of __new__
        self._setup(fs, root, f"{protocol}://{root}", fsync)
        return self

    def _setup(self, fs: fsspec.AbstractFileSystem, root: str, name: str, fsync: bool) -> None:
        self.fs = fs
        self.name = name
        self.fsync = fsync
        self.root = root.rstrip("/")
        self.is_async = bool(getattr(fs, "async_impl", False))
        self.create_bucket = False
        #: an object store (s3): no directories, and its first path component is a bucket
        self.object_store = hasattr(fs, "_call_s3")
        #: reachability of the server: fails fast for `unreachable_cooloff_s` after it cannot be reached
        self.outage = Outage(name, self.unreachable_cooloff_s)
        self._session: Any = None
        self._session_loop: Any = None  # the event loop token the session belongs to
        self._session_lock: anyio.Lock | None = None

    def path(self, key: str) -> str:
        """Where the object of `key` lives on the filesystem."""
        check_key(key)
        return f"{self.root}/{key[:2]}/{key}{SUFFIX}"

    # -- calls to the filesystem -------------------------------------------------------------------

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

    async def connect(self) -> None:
        """The client session on the running loop (`_ensure_session`): building one loads the client's
        service models, CPU work of a fraction of a second that no store deadline should count."""
        await self._ensure_session()

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
        self.outage.check()
        try:
            if self.is_async:
                await self._ensure_session()
                out = await getattr(self.fs, "_" + method)(*args, **kwargs)
            else:
                out = await anyio.to_thread.run_sync(partial(getattr(self.fs, method), *args, **kwargs))
        except FileNotFoundError:
            self.outage.answered()  # the server answered
            raise
        except Exception as e:
            if _unreachable(e):
                self.outage.unreachable(e)
            elif not _empty_range(e):  # an empty object's ranged read is an answer, not a fault
                self.outage.refused(e)
            raise
        self.outage.answered()
        return out

    async def _cat(self, key: str, start: int | None = None, end: int | None = None) -> bytes | None:
        path = self.path(key)
        try:
            return bytes(await self._call("cat_file", path, start=start, end=end))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise StoreError(f"cannot read {self.name} {path}: {type(e).__name__}: {e}") from e

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
    async def _batch(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        """`in_order(calls)`, at most REMOTE_CONCURRENCY at a time; a failure raised by itself."""
        try:
            return await in_order(calls, REMOTE_CONCURRENCY)
        except BaseExceptionGroup as group:  # the first failure, by itself, says what went wrong
            raise group.exceptions[0] from None

    # -- ChunkStore --------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        return await self._cat(key)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        """One ranged read of at most `len(buffer) + 1` bytes: an object that does not fit is never
        downloaded whole (a caller with a buffer sized to what it can use learns that it is larger,
        `len(buffer) + 1`, at the cost of one byte more)."""
        path = self.path(key)
        try:
            data = bytes(await self._call("cat_file", path, start=0, end=len(buffer) + 1))
        except FileNotFoundError:
            return None
        except Exception as e:
            if _empty_range(e):  # no byte 0 to send: the object is empty
                return 0
            raise StoreError(f"cannot read {self.name} {path}: {type(e).__name__}: {e}") from e
        return await copy_object(buffer, data)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """`end` passes on as it is (an HTTP Range on s3)."""
        check_range(start, end)
        if end == start:  # an empty range request is invalid HTTP; answer it from existence
            return b"" if (await self.contains([key]))[0] else None
        return await self._cat(key, start, end)

    async def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        try:
            try:
                await self._call("pipe_file", path, bytes(data))
            except FileNotFoundError:  # filesystems with real directories (sftp, wrapped local)
                if self.object_store and not self.create_bucket:  # its bucket is missing
                    raise StoreError(
                        f"cannot write {self.name} {path}: its bucket does not exist (create it, or "
                        "open the store with create_bucket=True)"
                    ) from None
                await self._call("makedirs", path.rsplit("/", 1)[0], exist_ok=True)
                await self._call("pipe_file", path, bytes(data))
        except StoreError:
            raise
        except Exception as e:
            raise StoreError(f"cannot write {self.name} {path}: {type(e).__name__}: {e}") from e

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        paths = [self.path(k) for k in keys]
        try:
            if not self.is_async:
                return await anyio.to_thread.run_sync(lambda: [bool(self.fs.exists(p)) for p in paths])
            # Object stores have no multi-key HEAD: all requests go out at once (one round trip of
            # latency for up to REMOTE_CONCURRENCY keys), never one after another.
            return await self._batch([partial(self._exists, p) for p in paths])
        except Exception as e:
            raise StoreError(f"cannot list {self.name}: {type(e).__name__}: {e}") from e

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._batch([partial(self._cat, k) for k in keys])

    async def scan(self) -> list[StoredObject]:
        """Every object under the root (temp files and foreign names skipped): one listing."""
        try:
            found = await self._call("find", self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StoreError(f"cannot list {self.name}: {type(e).__name__}: {e}") from e
        out = []
        for path, info in found.items():
            parts: list[str] = ["", *str(path).split("/")]
            shard, name = parts[-2], parts[-1]
            key = stored_key(name, shard)
            if key is not None:
                mtime = info.get("LastModified") or info.get("mtime") or info.get("created") or 0.0
                if hasattr(mtime, "timestamp"):
                    mtime = mtime.timestamp()
                out.append(StoredObject(key, int(info.get("size") or 0), float(mtime)))
        return out

    async def delete(self, key: str) -> None:
        path = self.path(key)
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
