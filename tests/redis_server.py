"""A real Redis server for tests: Debian's `redis-server` in a subprocess on 127.0.0.1, a free port.

Registered from conftest (`pytest_plugins`). Fixtures:

* `redis_server` (session): one server for the whole run; yields a `RedisServer` (`.url`).
* `redis_url` (function): a URL on it under a prefix of the test's own (no two tests share objects).

`RedisServer` is also usable on its own (a test that kills the server mid-restore starts a private
one). Without `redis-server` installed the tests that need it are skipped, unless
KVRESTORE_REQUIRE_SERVERS is set (CI), where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest

from .s3_server import free_port


def require(binary: str, package: str) -> str:
    """The path of `binary`, or skip (fail where KVRESTORE_REQUIRE_SERVERS is set) naming its package."""
    path = shutil.which(binary)
    if path is None:
        message = f"{binary} is not installed (Debian: apt-get install {package}; or `make install` as root)"
        if os.environ.get("KVRESTORE_REQUIRE_SERVERS"):
            pytest.fail(message + " but KVRESTORE_REQUIRE_SERVERS is set")
        pytest.skip(message)
    return path


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    """Wait until something accepts connections on 127.0.0.1:`port` (RuntimeError if `proc` exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    """Stop `proc` by its pid (`sig`, then SIGKILL after 5 s) and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RedisServer:
    """`redis-server` on 127.0.0.1:`port`, nothing persisted; `extra` are more `--name value` settings
    (e.g. `{"maxmemory": "2mb", "maxmemory-policy": "allkeys-lru"}`)."""

    def __init__(self, port: int | None = None, password: str | None = None, **extra: str) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix="kvrestore-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [require("redis-server", "redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        if self.password:
            args += ["--requirepass", self.password]
        for name, value in self.extra.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, self.proc, "redis-server")
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, its connections reset (a crash, not a shutdown)."""
        proc, self.proc = self.proc, None
        stop_process(proc, signal.SIGKILL)

    def client(self):
        """A blocking redis-py client of this server (to inspect or damage what tests stored)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    try:
        import redis  # noqa: F401 - the kvrestore[redis] extra
    except ImportError:
        message = "redis-py is not installed (pip install kvrestore[redis])"
        if os.environ.get("KVRESTORE_REQUIRE_SERVERS"):
            pytest.fail(message + " but KVRESTORE_REQUIRE_SERVERS is set")
        pytest.skip(message)
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return f"{redis_server.url}/t-{uuid.uuid4().hex[:12]}"
