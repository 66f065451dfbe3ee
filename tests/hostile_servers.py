"""Servers that misbehave, on 127.0.0.1 only: one that accepts connections and never answers (a black
hole), and a proxy in front of a real server that holds every answer back for a while (a slow one)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class _LoopbackServer:
    """A listening socket on 127.0.0.1 whose accept loop hands each connection to `_take`."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self._take(conn)

    def _take(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self.sock.close()

    def __enter__(self) -> _LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlackHole(_LoopbackServer):
    """Accepts TCP connections on 127.0.0.1, reads whatever comes, never writes a byte. `accepted`
    counts the connections it took."""

    def __init__(self) -> None:
        self.accepted = 0
        self._conns: list[socket.socket] = []
        super().__init__()

    def _take(self, conn: socket.socket) -> None:
        self.accepted += 1
        self._conns.append(conn)
        threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    def _swallow(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        while not self._stop.is_set():
            try:
                if not conn.recv(65536):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        for c in [*self._conns, self.sock]:
            with contextlib.suppress(OSError):
                c.close()


class SlowProxy(_LoopbackServer):
    """Forwards TCP connections on 127.0.0.1 to `target_port` (on 127.0.0.1), holding each answer back
    `delay_s` before its first byte goes to the client (every request on a connection waits)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        super().__init__()

    def _take(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        held = threading.Event()  # set when the client sent a request whose answer is due
        threading.Thread(target=self._pipe, args=(client, upstream, held, False), daemon=True).start()
        threading.Thread(target=self._pipe, args=(upstream, client, held, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, held: threading.Event, answers: bool) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if answers and held.is_set():  # the first bytes of an answer: hold them back
                    held.clear()
                    time.sleep(self.delay_s)
                elif not answers:
                    held.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
