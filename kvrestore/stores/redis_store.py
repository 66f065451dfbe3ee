"""Chunk store in Redis (or Valkey): `redis://host:port[/db][/prefix]`, `rediss://` for TLS, and
`redis+cluster://` / `rediss+cluster://` for a Redis Cluster (any of its nodes; the client finds the rest).

One object per chunk, a Redis string at `<prefix>/<key>` (default prefix `kvrestore`), written with one
SET (atomic: a reader sees the old value, the new one, or none). The client is redis-py's asyncio client
(the `redis` extra; hiredis parses replies where it is installed) over a connection pool of at most
`max_connections` connections; batch calls (`contains`, `get_many`, `get_ranges`) are one pipeline, one
round trip. Range reads (`get_range`, and `read_into`, which reads no more than its buffer holds) ask for the
range, the object's size and its existence in one MULTI/EXEC, so a missing object and an empty range are
told apart and an object larger than the caller's buffer is never sent whole. A chunk's load
(`read_into`) on one server skips redis-py altogether: its bytes are received straight into a buffer over
connections of the store's own (`redis_reads`).

Eviction: Redis' own. Give the server a `maxmemory` and a `maxmemory-policy` (`allkeys-lru` for a cache
only kvrestore uses; `volatile-*` policies never evict kvrestore's objects, which have no TTL): every
server sharing it sees one capacity, and an evicted chunk is a miss (recomputed). `open_store(url,
capacity_bytes=...)` instead keeps kvrestore's own capacity (a `BoundedStore`, rebuilt from a SCAN of the
prefix), which bounds what one process writes, not what the fleet holds.

A server that cannot be reached fails fast for a while (`Outage`), then is asked again: a restarted
server is used again without restarting the process. The client binds its connections to the event loop
that made them; a store used from another loop (another `anyio.run`) makes new ones.
"""

from __future__ import annotations

import importlib.util
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import anyio.lowlevel
import anyio.to_thread

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.settings import check_int, check_text
from kvrestore.stores.base import ChunkStore, StoredObject, check_key, copy_object, is_key
from kvrestore.stores.bounce import Lease, ReadBuffers
from kvrestore.stores.files import check_range
from kvrestore.stores.outage import COOLOFF_S, Outage
from kvrestore.stores.redis_reads import RawReads, RespError

T = TypeVar("T")

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
DEFAULT_PREFIX = "kvrestore"
#: connections one store keeps to one server at most (its pool; a cluster: per node)
MAX_CONNECTIONS = 32
#: bytes asked of the socket at once: a chunk object is megabytes
SOCKET_READ_SIZE = 1 << 20

#: options passed on to redis-py as they are (TLS, timeouts)
CLIENT_OPTIONS = (
    "socket_timeout",
    "socket_connect_timeout",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "client_name",
)


def _redis_errors() -> tuple[type[BaseException], type[BaseException], type[BaseException]]:
    """redis-py's (any error, cannot reach the server, wrong credentials) exception classes."""
    from redis import exceptions

    return exceptions.RedisError, exceptions.ConnectionError, exceptions.AuthenticationError


class RedisStore(ChunkStore):
    """ChunkStore over a Redis server or cluster (see the module docstring).

    `url`: `redis://[user:password@]host[:port][/db][/prefix/...]`; `rediss://` connects over TLS,
    `redis+cluster://` (or `rediss+cluster://`) to a Redis Cluster, which has no db (its path is the
    prefix). Options: `password` and `username` (rather than in the URL), `db`, `prefix`,
    `max_connections`, `socket_timeout` (20 s) and `socket_connect_timeout` (5 s), redis-py's TLS options
    (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_password`, `ssl_cert_reqs`, `ssl_check_hostname`,
    `ssl_ca_data`), `client_name`, `unreachable_cooloff_s`.
    """

    local = False

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        username: str | None = None,
        db: int | None = None,
        prefix: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        unreachable_cooloff_s: float = COOLOFF_S,
        **options: Any,
    ) -> None:
        if importlib.util.find_spec("redis") is None:
            raise StoreError(f"{url!r} needs redis-py, which is not installed: pip install kvrestore[redis]")
        check_text("url", url)
        for name, value in (("password", password), ("username", username), ("prefix", prefix)):
            if value is not None:
                check_text(name, value, empty=True, secret=name == "password")
        unknown = sorted(set(options) - set(CLIENT_OPTIONS))
        if unknown:
            raise InvalidInputError(
                f"redis:// does not take {', '.join(unknown)}; it takes password, username, db, prefix, "
                f"max_connections, unreachable_cooloff_s, capacity_bytes, eviction, read_only and "
                f"{', '.join(CLIENT_OPTIONS)}"
            )
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in SCHEMES:
            raise InvalidInputError(f"{url!r} is not a Redis URL ({', '.join(s + '://' for s in SCHEMES)})")
        if parts.query or parts.fragment:
            raise InvalidInputError(f"{url!r}: give Redis options as open_store keywords, not in the URL")
        try:
            port = parts.port or 6379
        except ValueError as e:
            raise InvalidInputError(f"{url!r}: {e}") from None
        host = parts.hostname
        if not host:
            raise InvalidInputError(f"{url!r} names no host")
        self.cluster = scheme.endswith("+cluster")
        self.tls = scheme.startswith("rediss")
        tls_options = sorted(o for o in options if o.startswith("ssl_"))
        if tls_options and not self.tls:
            raise InvalidInputError(
                f"{', '.join(tls_options)} need a TLS connection: rediss:// (or rediss+cluster://), not {scheme}://"
            )
        segments = [s for s in parts.path.split("/") if s]
        url_db = 0
        if segments and not self.cluster and segments[0].isdigit():
            url_db = int(segments.pop(0))
        if db is not None:
            db = check_int("db", db, minimum=0)
        self.db = url_db if db is None else db
        if self.cluster and self.db:
            raise InvalidInputError(f"{url!r}: a Redis Cluster has one database (db 0)")
        path_prefix = "/".join(segments)
        self.prefix = (prefix if prefix is not None else path_prefix or DEFAULT_PREFIX).strip("/")
        if not self.prefix:
            raise InvalidInputError("prefix must not be empty: kvrestore's objects live under one")
        max_connections = check_int("max_connections", max_connections)
        self.host, self.port = host, port
        self.max_connections = max_connections
        self._username = username if username is not None else unquote(parts.username or "") or None
        self._password = password if password is not None else unquote(parts.password or "") or None
        self._options = {"socket_timeout": 20.0, "socket_connect_timeout": 5.0, **options}
        db_part = "" if self.cluster else f"/{self.db}"
        self.name = f"{scheme}://{host}:{port}{db_part}/{self.prefix}"
        self.outage = Outage(self.name, unreachable_cooloff_s)
        self._client: Any = None
        self._raw: RawReads | None = None  # chunk reads over connections of their own
        self._buffers: ReadBuffers | None = None
        self._loop: Any = None  # the event loop token the client's connections belong to

    def redis_key(self, key: str) -> str:
        """The Redis key of chunk `key`."""
        return f"{self.prefix}/{check_key(key)}"

    # -- the client ----------------------------------------------------------------------------------

    def _make_client(self) -> Any:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        common: dict[str, Any] = dict(
            username=self._username,
            password=self._password,
            socket_read_size=SOCKET_READ_SIZE,
            # one more try on a fresh connection (a pooled one the server closed when it restarted),
            # no waiting: a server that is down fails the call at once, and `Outage` takes over
            retry=Retry(NoBackoff(), 1),
            **self._options,
        )
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster

            return RedisCluster(
                host=self.host, port=self.port, ssl=self.tls, max_connections=self.max_connections, **common
            )
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.asyncio.connection import Connection, SSLConnection

        pool = BlockingConnectionPool(
            connection_class=SSLConnection if self.tls else Connection,
            host=self.host,
            port=self.port,
            db=self.db,
            max_connections=self.max_connections,
            timeout=None,  # a call waits for a free connection; the restorer's deadlines bound it
            **common,
        )
        return Redis(connection_pool=pool)

    def _client_here(self) -> Any:
        """The client of the running event loop (made here if the store was last used on another)."""
        loop = anyio.lowlevel.current_token()
        if self._client is None or self._loop != loop:
            # a client of another (possibly closed) loop cannot be closed from here: its sockets go
            # with it when it is collected
            self._client, self._loop = self._make_client(), loop
        return self._client

    async def connect(self) -> None:
        """The client of the running loop (no request to the server)."""
        self._client_here()

    async def _call(self, what: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """`fn(client)`, with the server's faults as StoreError and its reachability kept (`Outage`)."""
        self.outage.check()
        any_error, unreachable, auth = _redis_errors()
        try:
            out = await fn(self._client_here())
        except auth as e:
            self.outage.refused(e)
            raise StoreError(f"cannot {what} {self.name}: {type(e).__name__}: {e}") from e
        except RespError as e:
            self.outage.refused(e)
            raise StoreError(f"cannot {what} {self.name}: {e}") from e
        except (unreachable, TimeoutError, OSError) as e:
            self.outage.unreachable(e)
            raise StoreError(f"cannot {what} {self.name}: {type(e).__name__}: {e}") from e
        except any_error as e:
            self.outage.refused(e)
            raise StoreError(f"cannot {what} {self.name}: {type(e).__name__}: {e}") from e
        self.outage.answered()
        return out

    async def _ranges(self, keys: Sequence[str], ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """For each (key, range): [the range's bytes, the object's size], or None where the object does
        not exist; in one round trip (EXISTS, STRLEN, GETRANGE per range), atomic per range on one
        server (MULTI/EXEC), in order on a cluster (whose pipelines are not transactions)."""
        names = [self.redis_key(k) for k in keys]

        async def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=not self.cluster)
            for name, (a, b) in zip(names, ranges, strict=True):
                pipe.exists(name)
                pipe.strlen(name)
                # GETRANGE's end is inclusive (and -1 the last byte): an empty range asks for none
                if b > a:
                    pipe.getrange(name, a, b - 1)
                else:
                    pipe.exists(name)  # a placeholder: no byte asked
            answers = await pipe.execute()
            out: list[Any] = []
            for i, (a, b) in enumerate(ranges):
                exists, size, data = answers[3 * i : 3 * i + 3]
                out.append(None if not exists else [data if b > a else b"", int(size)])
            return out

        return await self._call("read", run)

    async def _pipeline(self, what: str, command: str, keys: Sequence[str]) -> list[Any]:
        """One `command` per key in one pipeline (one round trip)."""
        names = [self.redis_key(k) for k in keys]

        async def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                getattr(pipe, command)(name)
            return list(await pipe.execute())

        return await self._call(what, run) if names else []

    # -- ChunkStore ----------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        name = self.redis_key(key)
        data = await self._call("read", lambda c: c.get(name))
        return None if data is None else bytes(data)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        """One range read of at most `len(buffer)` bytes; returns the object's size. On one server (not a
        cluster) over a connection of its own, the bytes received straight into a buffer
        (`redis_reads`)."""
        if not self.cluster and len(buffer):
            return await self._raw_read(self.redis_key(key), buffer)
        found = (await self._ranges([key], [(0, len(buffer))]))[0]
        if found is None:
            return None
        data, size = found
        await copy_object(buffer, data)
        return int(size)

    def _raw_reads(self) -> RawReads:
        if self._raw is None:
            o = self._options
            self._raw = RawReads(
                self.host,
                self.port,
                self.db,
                username=self._username,
                password=self._password,
                tls=tls_context(o) if self.tls else None,
                connect_timeout_s=o["socket_connect_timeout"],
                timeout_s=o["socket_timeout"],
                keep=self.max_connections,
            )
            self._buffers = ReadBuffers(self.max_connections)
        return self._raw

    async def _raw_read(self, name: str, into: memoryview) -> int | None:
        raw = self._raw_reads()
        assert self._buffers is not None
        lease = Lease(self._buffers, self._buffers.acquire(len(into)))
        placed = [0]

        def read() -> int | None:
            try:
                size = raw.read(name.encode(), len(into), lease.buf.data)
                placed[0] = 0 if size is None else min(size, len(into))
                return size
            finally:
                lease.finish()

        async def call(_client: Any) -> int | None:
            return await anyio.to_thread.run_sync(read, abandon_on_cancel=True)

        try:
            size = await self._call("read", call)
            if size is not None:
                await copy_object(into, lease.buf.data[: placed[0]])
        finally:
            lease.settle()
        return size

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        found = (await self._ranges([key], [(start, end)]))[0]
        return None if found is None else bytes(found[0])

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        for a, b in ranges:
            check_range(a, b)
        if not ranges:
            return []
        found = await self._ranges([key] * len(ranges), list(ranges))
        return [None if f is None else bytes(f[0]) for f in found]

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None if d is None else bytes(d) for d in await self._pipeline("read", "get", keys)]

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in await self._pipeline("look up keys in", "exists", keys)]

    async def put(self, key: str, data: bytes) -> None:
        name = self.redis_key(key)
        payload = bytes(data) if not isinstance(data, bytes) else data
        await self._call("write", lambda c: c.set(name, payload))

    async def delete(self, key: str) -> None:
        name = self.redis_key(key)
        await self._call("delete from", lambda c: c.unlink(name))

    async def scan(self) -> list[StoredObject]:
        """Every chunk under the prefix (SCAN), with its size and, as its last write time, its last use
        (OBJECT IDLETIME; now where the server's eviction policy does not track it)."""
        pattern = _glob_escape(self.prefix + "/") + "*"

        async def run(client: Any) -> list[StoredObject]:
            names = [n.decode() if isinstance(n, bytes) else n async for n in client.scan_iter(pattern, 1000)]
            names = [n for n in names if is_key(n.rsplit("/", 1)[-1])]
            if not names:
                return []
            pipe = client.pipeline(transaction=False)
            for n in names:
                pipe.strlen(n)
                pipe.object("idletime", n)
            answers = await pipe.execute(raise_on_error=False)
            now = time.time()
            out = []
            for i, n in enumerate(names):
                size, idle = answers[2 * i], answers[2 * i + 1]
                if isinstance(size, int) and size > 0:
                    age = idle if isinstance(idle, int) else 0
                    out.append(StoredObject(n.rsplit("/", 1)[-1], size, now - age))
            return out

        return await self._call("list", run)

    async def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        client, self._client = self._client, None
        if client is not None and self._loop == anyio.lowlevel.current_token():
            with suppress(Exception):  # closing a client whose server is gone
                await client.aclose()

    def __repr__(self) -> str:
        return f"RedisStore({self.name!r})"


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The TLS settings of redis-py's options (`ssl_ca_certs`, `ssl_certfile`, ...) as an SSLContext."""
    ctx = ssl.create_default_context(cafile=options.get("ssl_ca_certs"), cadata=options.get("ssl_ca_data"))
    if options.get("ssl_certfile"):
        ctx.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"), options.get("ssl_password"))
    reqs = options.get("ssl_cert_reqs", "required")
    reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}.get(
        reqs, reqs
    )
    if reqs == ssl.CERT_NONE or options.get("ssl_check_hostname") is False:
        ctx.check_hostname = False
    ctx.verify_mode = reqs
    return ctx


def _glob_escape(text: str) -> str:
    """`text` matched literally by a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


__all__ = ["DEFAULT_PREFIX", "SCHEMES", "RedisStore"]
