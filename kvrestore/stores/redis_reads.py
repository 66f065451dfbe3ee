"""Chunk reads from Redis that skip the reply parser: a chunk's bytes go from the socket into a buffer.

redis-py hands a 12 MB value over as bytes: read from the socket in pieces on the event loop, assembled
by its parser, then copied again into the caller's staging buffer, the GIL held for most of it. A load
lane needs none of that: `RawReads.read` sends one MULTI/EXEC (EXISTS, STRLEN, GETRANGE) on a blocking
connection of its own, parses the few short replies, and receives the range's bytes with `recv_into`
straight into a buffer (the GIL released while the kernel copies). It runs in a worker thread; the
buffer is the store's own (`bounce.Lease`), since a read abandoned at its deadline goes on writing.

One connection per read at a time, kept in a pool; a connection that failed or was abandoned mid-reply
is closed, never reused. Redis Cluster reads go through redis-py (which follows its redirects).
"""

from __future__ import annotations

import socket
import ssl
import threading
from contextlib import suppress
from typing import Any

CRLF = b"\r\n"


class RespError(Exception):
    """The server answered an error (`-ERR ...`, `-NOAUTH ...`): it was reached, and refused."""


def command(*parts: bytes | str | int) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Connection:
    """A blocking socket and what it has received but not yet handed out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while True:
            i = self.buf.find(CRLF)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                if out.startswith(b"-"):
                    raise RespError(out[1:].decode(errors="replace"))
                return out
            self._fill()

    def into(self, view: memoryview, skip: int = 0) -> None:
        """The next `len(view)` bytes of the stream into `view`, then `skip` bytes and a CRLF passed over."""
        have = min(len(view), len(self.buf))
        view[:have] = self.buf[:have]
        del self.buf[:have]
        got = have
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            got += n
        while len(self.buf) < skip + 2:
            self._fill()
        del self.buf[: skip + 2]

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()


class RawReads:
    """Range reads over connections of their own (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        db: int,
        *,
        username: str | None,
        password: str | None,
        tls: ssl.SSLContext | None,
        connect_timeout_s: float,
        timeout_s: float,
        keep: int,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password, self.tls = username, password, tls
        self.connect_timeout_s, self.timeout_s, self.keep = connect_timeout_s, timeout_s, keep
        self._free: list[_Connection] = []
        self._lock = threading.Lock()

    def _connect(self) -> _Connection:
        sock: Any = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self.timeout_s)
            conn = _Connection(sock)
            hello = []
            if self.password is not None:
                auth = (self.username, self.password) if self.username else (self.password,)
                hello.append(command("AUTH", *auth))
            if self.db:
                hello.append(command("SELECT", self.db))
            if hello:
                sock.sendall(b"".join(hello))
                for _ in hello:
                    conn.line()
            return conn
        except BaseException:
            sock.close()
            raise

    def read(self, name: bytes, nbytes: int, into: memoryview) -> int | None:
        """Bytes [0, nbytes) of key `name` into `into` (blocking): the object's size, or None when it
        does not exist. Raises OSError (or ConnectionError) when the server cannot be reached, RespError
        when it refuses."""
        with self._lock:
            conn = self._free.pop() if self._free else None
        if conn is None:
            conn = self._connect()
        try:
            conn.sock.sendall(
                command("MULTI")
                + command("EXISTS", name)
                + command("STRLEN", name)
                + command("GETRANGE", name, 0, max(nbytes - 1, 0))
                + command("EXEC")
            )
            for _ in range(4):  # +OK, then +QUEUED for each command
                conn.line()
            head = conn.line()
            if head != b"*3":
                raise RespError(f"the transaction was not run ({head!r})")
            exists, size, bulk = int(conn.line()[1:]), int(conn.line()[1:]), int(conn.line()[1:])
            n = min(bulk, nbytes, len(into))
            conn.into(into[:n], skip=bulk - n)  # GETRANGE 0 0 (nbytes 0) sends a byte not asked for
        except BaseException:
            conn.close()
            raise
        with self._lock:
            kept = len(self._free) < self.keep
            if kept:
                self._free.append(conn)
        if not kept:
            conn.close()
        return size if exists else None

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for conn in free:
            conn.close()


__all__ = ["RawReads", "RespError", "command"]
