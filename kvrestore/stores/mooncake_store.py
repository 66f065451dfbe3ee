"""Chunk store in Mooncake's distributed store: `mooncake://master_host[:port][/prefix]`.

Mooncake's store is a master (`mooncake_master`: where each object lives, eviction, leases), a metadata
server (HTTP, `mooncake_http_metadata_server` or the master's own), and storage nodes that lend memory to
the pool (`mooncake_client --global_segment_size 4GB`, or any client that mounts a segment). This store is
a client of it (`MooncakeDistributedStore`, the `mooncake` extra: PyPI's
`mooncake-transfer-engine-non-cuda`), which by default lends nothing (`global_segment_size=0`): its
objects live on the storage nodes, so they outlive the process that wrote them and every server of the
fleet reads them.

One object per chunk, at `<prefix>/<key>` (default prefix `kvrestore`), written with one upsert (a reader
sees the old object, the new one, or none). Mooncake's client is blocking: each call runs in a worker
thread. Reads go straight into a buffer registered with the transfer engine (`get_into`, the GIL
released), then one bulk copy (GIL-free) into the caller's buffer; a read abandoned by its deadline keeps
its registered buffer until the transfer engine is done with it. A range read (`get_range`) transfers
that range alone.

Eviction: Mooncake's own, within the memory its storage nodes lend (the master evicts past
`--eviction_high_watermark_ratio`); an evicted chunk is a miss. kvrestore's `capacity_bytes` is refused:
Mooncake lists no objects, so no capacity could be rebuilt after a restart. A chunk must fit the client's
`local_buffer_size` (a write is staged there).

The master keeps its objects in memory: a master that restarts comes back empty (the storage nodes mount
their memory again by themselves), and the client reaches it again by itself. While the master cannot be
reached a call fails fast (`Outage`) and the restore computes.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import numpy as np

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.settings import check_choice, check_int, check_text
from kvrestore.stores.base import ChunkStore, check_key, copy_object
from kvrestore.stores.bounce import Lease, ReadBuffers
from kvrestore.stores.files import check_range
from kvrestore.stores.outage import COOLOFF_S, Outage

T = TypeVar("T")

DEFAULT_PORT = 50051
DEFAULT_PREFIX = "kvrestore"
#: the client's transfer buffer: every object written is staged there, so it bounds a chunk's size
LOCAL_BUFFER_SIZE = 256 << 20
#: blocking calls one store runs at once (worker threads)
MAX_CONCURRENCY = 16

#: Mooncake's error codes (mooncake-store's `ErrorCode`) that mean a part of the store could not be reached
UNREACHABLE = {
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
ERRORS = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    **UNREACHABLE,
}
NOT_FOUND = -704


class MooncakeError(StoreError):
    """A call to Mooncake's store answered an error code (`code`; its name in the message)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _local_address(host: str, port: int) -> str:
    """The address this machine reaches `host` from (no packet is sent: a UDP socket is only pointed)."""
    with suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])
    return socket.gethostname()


class MooncakeStore(ChunkStore):
    """ChunkStore over Mooncake's distributed store (see the module docstring).

    `url`: `mooncake://master_host[:port][/prefix]` (port 50051). Options: `metadata_server` (default
    `http://<master_host>:8080/metadata`), `protocol` (`tcp`, or `rdma` with `rdma_devices`),
    `global_segment_size` (bytes this client lends to the pool; 0), `local_buffer_size` (its transfer
    buffer; 256 MB, at least the largest chunk), `local_hostname` (the address the store reaches this
    machine at; by default the one it reaches the master from), `prefix`, `unreachable_cooloff_s`.
    """

    local = False

    def __init__(
        self,
        url: str,
        *,
        metadata_server: str | None = None,
        protocol: str = "tcp",
        global_segment_size: int = 0,
        local_buffer_size: int = LOCAL_BUFFER_SIZE,
        local_hostname: str | None = None,
        rdma_devices: str = "",
        prefix: str | None = None,
        unreachable_cooloff_s: float = COOLOFF_S,
    ) -> None:
        if importlib.util.find_spec("mooncake") is None:
            raise StoreError(
                f"{url!r} needs Mooncake's store, which is not installed: pip install kvrestore[mooncake]"
            )
        parts = urlsplit(check_text("url", url))
        if parts.scheme.lower() != "mooncake":
            raise InvalidInputError(f"{url!r} is not a mooncake:// URL")
        if parts.query or parts.fragment:
            raise InvalidInputError(f"{url!r}: give Mooncake options as open_store keywords, not in the URL")
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError as e:
            raise InvalidInputError(f"{url!r}: {e}") from None
        if not parts.hostname:
            raise InvalidInputError(f"{url!r} names no master host")
        global_segment_size = check_int("global_segment_size", global_segment_size, minimum=0)
        local_buffer_size = check_int("local_buffer_size", local_buffer_size)  # every write is staged there
        check_choice("protocol", protocol, ("tcp", "rdma"))
        check_text("rdma_devices", rdma_devices, empty=True)
        for name, value in (("metadata_server", metadata_server), ("local_hostname", local_hostname)):
            if value is not None:
                check_text(name, value)
        if prefix is not None:
            check_text("prefix", prefix, empty=True)
        self.master = f"{parts.hostname}:{port}"
        self.metadata_server = metadata_server or f"http://{parts.hostname}:8080/metadata"
        self.protocol = protocol
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size
        self.local_hostname = local_hostname or _local_address(parts.hostname, port)
        self.rdma_devices = rdma_devices
        self.prefix = (prefix if prefix is not None else parts.path.strip("/") or DEFAULT_PREFIX).strip("/")
        if not self.prefix:
            raise InvalidInputError("prefix must not be empty: kvrestore's objects live under one")
        self.name = f"mooncake://{self.master}/{self.prefix}"
        self.outage = Outage(self.name, unreachable_cooloff_s)
        self._client: Any = None
        self._buffers: ReadBuffers | None = None
        self._setup_lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(MAX_CONCURRENCY)

    def object_key(self, key: str) -> str:
        """Mooncake's key of chunk `key`."""
        return f"{self.prefix}/{check_key(key)}"

    # -- the client (blocking; worker threads) -----------------------------------------------------

    def _ready_client(self) -> Any:
        """The set-up client (set up here on first use; StoreError if the store cannot be reached)."""
        with self._setup_lock:
            if self._client is not None:
                return self._client
            from mooncake.store import MooncakeDistributedStore

            # Mooncake's setup tries a master it cannot reach 20 times, seconds each: ask first
            _reachable(self.master, "master")
            meta = urlsplit(self.metadata_server)
            if meta.scheme in ("http", "https") and meta.hostname:
                _reachable(f"{meta.hostname}:{meta.port or 80}", "metadata server")

            if ipaddress.ip_address(_resolve(self.local_hostname)).is_loopback:
                # a client on loopback advertises loopback, not the machine's first interface
                os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
            client = MooncakeDistributedStore()
            rc = client.setup(
                self.local_hostname,
                self.metadata_server,
                self.global_segment_size,
                self.local_buffer_size,
                self.protocol,
                self.rdma_devices,
                self.master,
            )
            if rc != 0:
                with suppress(Exception):
                    client.close()
                raise ConnectionError(
                    f"cannot set up a client of master {self.master} with metadata server "
                    f"{self.metadata_server} (code {rc})"
                )
            self._client = client
            self._buffers = ReadBuffers(MAX_CONCURRENCY, client.register_buffer, client.unregister_buffer)
            return client

    async def _blocking(self, what: str, fn: Callable[[Any], T], abandon: bool = True) -> T:
        """`fn(client)` in a worker thread, its faults as StoreError and the reachability kept."""
        self.outage.check()
        try:
            async with self._limiter:
                out = await anyio.to_thread.run_sync(
                    lambda: fn(self._ready_client()), abandon_on_cancel=abandon
                )
        except MooncakeError as e:
            (self.outage.unreachable if e.code in UNREACHABLE else self.outage.refused)(e)
            raise
        except (ConnectionError, OSError) as e:
            self.outage.unreachable(e)
            raise StoreError(f"cannot {what} {self.name}: {e}") from e
        self.outage.answered()
        return out

    def _check(self, what: str, key: str, code: int) -> int:
        """`code` if it is a size or success (>= 0), else MooncakeError naming it."""
        if code >= 0:
            return code
        name = ERRORS.get(code, "error")
        hint = ""
        if code == -600 and what == "write":
            hint = f" (an object larger than local_buffer_size, {self.local_buffer_size} bytes, or empty?)"
        raise MooncakeError(f"cannot {what} {key[:12]} in {self.name}: {name} ({code}){hint}", code)

    def _fetch(self, client: Any, name: str, offset: int, nbytes: int, buf: np.ndarray) -> int | None:
        """Bytes [offset, offset + nbytes) of object `name` into the registered `buf`: the object's size,
        or None when absent. From byte 0 one `get_into`; an object larger than `nbytes` (or a read from
        further on) asks its size, then transfers the range alone."""
        if offset == 0:
            code = client.get_into(name, buf.ctypes.data, nbytes)
            if code != -600:  # -600: larger than `nbytes`
                return None if code == NOT_FOUND else self._check("read", name, code)
        size = client.get_size(name)
        if size == NOT_FOUND:
            return None
        self._check("read", name, size)
        n = min(nbytes, size - offset)
        if n > 0:
            got = client.get_into_ranges([buf.ctypes.data], [[name]], [[[0]]], [[[offset]]], [[[n]]])
            self._check("read", name, got[0][0][0])
        return int(size)

    async def _read(self, name: str, into: memoryview, offset: int = 0) -> int | None:
        """Object `name` from byte `offset` into `into` (as much as fits); its size, or None."""
        self.outage.check()
        if self._buffers is None:
            await self._blocking("reach", lambda c: None)
        assert self._buffers is not None
        lease = Lease(self._buffers, self._buffers.acquire(len(into)))

        def fetch(client: Any) -> int | None:
            try:
                return self._fetch(client, name, offset, len(into), lease.buf)
            finally:
                lease.finish()

        try:
            size = await self._blocking("read", fetch)
            if size is not None:
                got = min(len(into), max(size - offset, 0))
                await copy_object(into[:got], lease.buf.data[:got])
        finally:
            lease.settle()
        return size

    # -- ChunkStore ----------------------------------------------------------------------------------

    async def _size(self, name: str) -> int | None:
        size = await self._blocking("read", lambda c: c.get_size(name))
        return None if size == NOT_FOUND else self._check("read", name, size)

    async def get(self, key: str) -> bytes | None:
        name = self.object_key(key)
        size = await self._size(name)
        if size is None:
            return None
        out = bytearray(size)
        got = await self._read(name, memoryview(out))
        return None if got is None else bytes(out[: min(got, size)])

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        return await self._read(self.object_key(key), buffer)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        name = self.object_key(key)
        size = await self._size(name)
        if size is None:
            return None
        n = max(0, min(end, size) - start)
        if n == 0:
            return b""
        out = bytearray(n)
        got = await self._read(name, memoryview(out), offset=start)
        return None if got is None else bytes(out[: max(0, min(end, got) - start)])

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        names = [self.object_key(k) for k in keys]
        if not names:
            return []
        found = await self._blocking("look up keys in", lambda c: c.batch_is_exist(names))
        if any(f < 0 for f in found):
            raise MooncakeError(f"cannot look up keys in {self.name}: the master answered an error", -1)
        return [f == 1 for f in found]

    async def put(self, key: str, data: bytes) -> None:
        name = self.object_key(key)
        payload = data if isinstance(data, bytes) else bytes(data)
        await self._blocking("write", lambda c: self._check("write", name, c.upsert(name, payload)))

    async def delete(self, key: str) -> None:
        """Remove the object, even while a reader holds a lease on it (Mooncake leases each read for a
        few seconds; a chunk deleted as damaged must not stay): a reader mid-transfer then reads bytes
        that fail their checks, a miss."""
        name = self.object_key(key)

        def remove(c: Any) -> None:
            code = c.remove(name, True)
            if code != NOT_FOUND:
                self._check("delete", name, code)

        await self._blocking("delete from", remove)

    async def close(self) -> None:
        client, self._client = self._client, None
        self._buffers = None  # registered with the client that closes
        if client is not None:
            await anyio.to_thread.run_sync(client.close)

    def __repr__(self) -> str:
        return f"MooncakeStore({self.name!r})"


#: seconds a connection to the master or the metadata server may take before setting up a client
PROBE_TIMEOUT_S = 2.0


def _reachable(address: str, what: str) -> None:
    """ConnectionError unless something accepts TCP connections at `address` ("host:port")."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConnectionError(f"the {what} at {address} cannot be reached ({e})") from e


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "0.0.0.0"


__all__ = ["DEFAULT_PORT", "DEFAULT_PREFIX", "MooncakeError", "MooncakeStore"]
