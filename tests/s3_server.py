"""A real S3-compatible server for tests: `moto_server` in a subprocess on 127.0.0.1.

Registered from conftest (`pytest_plugins`). Fixtures:

* `s3_server` (session): one server for the whole run; yields a `MotoServer` (`.endpoint`).
* `s3_bucket` (function): a fresh, empty bucket on it; yields its name.
* `s3_options`: the `open_store(...)` options that reach the server (endpoint, credentials, path style).

`MotoServer` is also usable on its own (a test that stops the server mid-restore starts a private one).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CREDENTIALS = {"key": "testing", "secret": "testing"}


def free_port(containing: str | None = None) -> int:
    """A loopback port free when asked; with `containing`, the first whose number holds those digits."""
    if containing is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in range(1024, 65536):
        if containing in str(port):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free loopback port holds the digits {containing}")


def _moto_command() -> list[str]:
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not os.path.exists(exe):
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    return [exe]


class MotoServer:
    """`moto_server -H 127.0.0.1 -p <free port>`; `start()` waits until it answers HTTP."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> MotoServer:
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen(
            [*_moto_command(), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode} before answering")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1):
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout} s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:  # with clients' keep-alive connections open, werkzeug can wait on them: not for long
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def options(self, **extra: Any) -> dict[str, Any]:
        """Options for `open_store("s3://...")` that reach this server, the usual s3fs way."""
        return {
            **CREDENTIALS,
            "endpoint_url": self.endpoint,
            "config_kwargs": {"s3": {"addressing_style": "path"}},
            **extra,
        }

    def client(self):
        """A boto3 S3 client of this server (for setting up and inspecting buckets in tests)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"kv-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: MotoServer) -> str:
    return s3_server.make_bucket()


@pytest.fixture
def s3_options(s3_server: MotoServer) -> dict[str, Any]:
    return s3_server.options()
