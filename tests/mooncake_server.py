"""A real Mooncake store for tests: its HTTP metadata server, its master and one storage node lending
memory, each a subprocess on 127.0.0.1 (free ports), from PyPI's `mooncake-transfer-engine-non-cuda`.

Registered from conftest (`pytest_plugins`). Fixtures:

* `mooncake_server` (session): one store for the whole run; yields a `MooncakeServer` (`.url`).
* `mooncake_url` (function): a URL on it under a prefix of the test's own.

Mooncake's transfer engine advertises the address in MC_TCP_BIND_ADDRESS (set to 127.0.0.1 here, for
the servers and this process's clients alike). The master needs Debian's `libibverbs1` to load; without
it, or without the package, the tests are skipped (failed where KVRESTORE_REQUIRE_SERVERS is set).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .redis_server import stop_process, wait_for_port
from .s3_server import free_port

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def _missing(message: str) -> None:
    if os.environ.get("KVRESTORE_REQUIRE_SERVERS"):
        pytest.fail(message + " but KVRESTORE_REQUIRE_SERVERS is set")
    pytest.skip(message)


def mooncake_binaries() -> dict[str, str]:
    """The Mooncake executables beside this interpreter (skip, or fail under KVRESTORE_REQUIRE_SERVERS)."""
    try:
        import mooncake.store  # noqa: F401 - loads the native library (needs libibverbs1)
    except ImportError as e:
        _missing(
            f"Mooncake's store cannot be loaded ({e}; pip install kvrestore[mooncake], apt-get install libibverbs1)"
        )
    bindir = Path(sys.executable).parent
    out = {}
    for name in ("mooncake_master", "mooncake_client", "mooncake_http_metadata_server"):
        path = shutil.which(name) or str(bindir / name)
        if not os.path.exists(path):
            _missing(f"{name} is not installed (pip install kvrestore[mooncake])")
        out[name] = path
    return out


class MooncakeServer:
    """Metadata server, master and one storage node lending `segment_size` bytes, on loopback."""

    def __init__(self, segment_size: str = "512MB") -> None:
        self.segment_size = segment_size
        self.master_port, self.metadata_port = free_port(), free_port()
        self.metrics_port, self.node_port = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = tempfile.mkdtemp(prefix="kvrestore-mooncake-")

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.master_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def options(self, **extra: Any) -> dict[str, Any]:
        """`open_store(self.url, ...)` options that reach this store."""
        return {"metadata_server": self.metadata_server, "local_hostname": "127.0.0.1", **extra}

    def _spawn(self, name: str, args: list[str], port: int) -> None:
        log = open(os.path.join(self.logs, f"{name}.log"), "ab")  # noqa: SIM115 - the child keeps it
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = proc
        wait_for_port(port, proc, name)

    def start(self) -> MooncakeServer:
        exe = mooncake_binaries()
        self._spawn(
            "metadata",
            [exe["mooncake_http_metadata_server"], "--host", "127.0.0.1", "--port", str(self.metadata_port)],
            self.metadata_port,
        )
        self.start_master()
        self._spawn(
            "node",
            [
                exe["mooncake_client"],
                f"--global_segment_size={self.segment_size}",
                f"--master_server_address=127.0.0.1:{self.master_port}",
                f"--metadata_server={self.metadata_server}",
                "--host=127.0.0.1",
                f"--port={self.node_port}",
                "--protocol=tcp",
            ],
            self.node_port,
        )
        return self

    def start_master(self) -> None:
        exe = mooncake_binaries()
        self._spawn(
            "master",
            [
                exe["mooncake_master"],
                f"--rpc_port={self.master_port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1",
            ],
            self.master_port,
        )

    def kill_master(self) -> None:
        """SIGKILL the master (a crash): every object's whereabouts are lost with it."""
        import signal

        stop_process(self.procs.pop("master", None), signal.SIGKILL)

    def stop(self) -> None:
        for name in ("node", "master", "metadata"):
            stop_process(self.procs.pop(name, None))

    def __enter__(self) -> MooncakeServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.logs, ignore_errors=True)


@pytest.fixture(scope="session")
def mooncake_server() -> Iterator[MooncakeServer]:
    with MooncakeServer() as server:
        yield server


@pytest.fixture
def mooncake_url(mooncake_server: MooncakeServer) -> str:
    return f"{mooncake_server.url}/t-{uuid.uuid4().hex[:12]}"
