"""Starting the stage processes: `spawn` (S local processes over loopback) or `init_stages` (torchrun)."""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvrestore.core.errors import StageFailedError
from kvrestore.core.settings import check_int, check_seconds
from kvrestore.distributed.pipe import world

log = logging.getLogger("kvrestore.distributed")

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def init_stages(timeout_s: float = 60.0, backend: str | None = None) -> dist.ProcessGroup:
    """Join the process group torchrun (or the environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set
    up, if not joined yet (with `backend`, by default NCCL where there is a GPU, gloo on the CPU), and
    return a gloo group over every rank with `timeout_s` for kvrestore's own messages (plans, outcomes,
    hidden states: small, and gloo works beside NCCL)."""
    timeout = timedelta(seconds=check_seconds("timeout_s", timeout_s) or 60.0)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout=timeout)
    if dist.get_backend() == "gloo":
        return world()
    return dist.new_group(backend="gloo", timeout=timeout)


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    timeout_s: float,
    threads: int | None,
) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        try:
            outcome = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which raises
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
    results.put((rank, pickle.dumps(outcome)))


def spawn(
    fn: Callable[..., Any], n_procs: int, *args: Any, timeout_s: float = 120.0, threads: int | None = 1
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `n_procs` fresh processes joined in a gloo process group over
    loopback (a free port on 127.0.0.1); returns their return values by rank.

    `fn` and `args` must be picklable (a module-level function). Each process uses `threads` torch threads
    (None: torch's default). The group's timeout is `timeout_s`; the whole run gets a few times that. If a
    process raises, dies, or the run times out, the others are stopped and `StageFailedError` says which
    (`failures` by rank, `results` with what the others returned).
    """
    check_int("n_procs", n_procs)
    limit = check_seconds("timeout_s", timeout_s) or 120.0
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, n_procs, port, fn, args, results, limit, threads), daemon=True)
        for r in range(n_procs)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + 3 * limit + 60  # start-up (imports) and the work itself
    try:
        while len(got) < n_procs and time.monotonic() < deadline:
            try:
                rank, blob = results.get(timeout=0.5)
                got[rank] = pickle.loads(blob)
            except queue.Empty:
                # a process that died without reporting will never report: stop waiting for it
                if all(r in got or not p.is_alive() for r, p in enumerate(procs)) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: got[r][1] for r in got if got[r][0] == "error"}
    for r, p in enumerate(procs):
        if r not in got:
            failures[r] = f"process exited with code {p.exitcode}" if p.exitcode is not None else "timed out"
    if failures:
        error = StageFailedError(
            f"{len(failures)} of {n_procs} stage processes failed: "
            + "; ".join(f"rank {r}: {m.splitlines()[0]}" for r, m in sorted(failures.items())),
            failures,
        )
        error.results = {r: v for r, (kind, v) in got.items() if kind == "ok"}  # type: ignore[attr-defined]
        raise error
    return [got[r][1] for r in range(n_procs)]


__all__ = ["free_port", "init_stages", "spawn"]
