"""Stopping a compute unit part-way when its restore is cancelled.

A compute unit runs in a worker thread, and a thread cannot be interrupted: without a check inside the
unit, a restore cancelled by a deadline would return only once the unit it was computing had finished,
a whole prompt's prefill for `ComputeOnly`. So a unit runs under a `UnitCancel` token, and the model checks it between layers
(`checkpoint()`, called by `HFBackend` before each decoder layer): once the restore is cancelled, the unit
stops at the next layer boundary, and the restore returns within one layer's compute time, not one
unit's. The rows the unit had written are left part-way, which is fine: a cancelled restore's KV is
not used. A backend that never calls `checkpoint()` still works; it stops only at the unit's end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

_current = threading.local()


class UnitCancelled(Exception):  # noqa: N818 - a signal inside a unit, not an error a user sees
    """Raised inside a compute unit at a `checkpoint()` once its restore has been cancelled."""


def checkpoint() -> None:
    """Raise `UnitCancelled` if the compute unit running on this thread has been cancelled."""
    token = getattr(_current, "token", None)
    if token is not None and token.is_set():
        raise UnitCancelled


async def run_unit(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread, as a compute unit: if the calling task is cancelled meanwhile,
    the unit is told to stop at its next `checkpoint()` and this returns (raising the cancellation)
    only once the thread has left `fn`, so nothing of the unit still runs. A unit cancelled before its
    thread took it up never starts."""
    token = threading.Event()
    done = threading.Event()
    lock = threading.Lock()
    state = ["pending"]  # -> "running" -> "finished"; or "abandoned" before it ran

    def work() -> T:
        with lock:
            if state[0] == "abandoned":
                raise UnitCancelled
            state[0] = "running"
        _current.token = token
        try:
            return fn(*args)
        finally:
            _current.token = None
            with lock:
                state[0] = "finished"
            done.set()

    try:
        return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        with lock:
            started = state[0] != "pending"
            if not started:
                state[0] = "abandoned"
        if started:
            token.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(done.wait)
        raise
