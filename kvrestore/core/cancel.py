"""Stopping a compute unit part-way: when its restore is cancelled, or when fetches overtake it.

A compute unit runs in a worker thread, and a thread cannot be interrupted: without a check inside the
unit, a restore cancelled by a deadline would return only once the unit it was computing had finished,
a whole prompt's prefill for `ComputeOnly`. So a unit runs under a `UnitCancel` token, and the model checks it between layers
(`checkpoint()`, called by `HFBackend` before each decoder layer): once the restore is cancelled, the unit
stops at the next layer boundary, and the restore returns within one layer's compute time, not one
unit's. The rows the unit had written are left part-way, which is fine: a cancelled restore's KV is
not used. A backend that never calls `checkpoint()` still works; it stops only at the unit's end.

The engine stops a unit the same way once the load lanes have landed every chunk of it aside
(`Decision.overtake`): `Unit` is such a unit as the engine tracks it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

_current = threading.local()


class UnitCancelled(Exception):  # noqa: N818 - a signal inside a unit, not an error a user sees
    """Raised inside a compute unit at a `checkpoint()` once its restore has been cancelled."""


class Checkpoints:
    """How far a compute unit got: the `checkpoint()` calls it passed (with `HFBackend`, one before each
    decoder layer), when its thread took it up and when it stopped at a checkpoint
    (`time.perf_counter()`). A unit stopped at the checkpoint after `passed` ones ran `passed` whole
    layers in `stopped - began` seconds."""

    __slots__ = ("passed", "began", "stopped")

    def __init__(self) -> None:
        self.passed = 0
        self.began: float | None = None
        self.stopped: float | None = None

    def part(self) -> tuple[int, float] | None:
        """(checkpoints passed, seconds) of a unit stopped part-way; None if it did not stop so."""
        if self.began is None or self.stopped is None or self.passed == 0:
            return None
        return self.passed, self.stopped - self.began


class Unit:
    """A compute unit running in place, and the fetches aside that may overtake it (`Decision.overtake`):
    `scope` stops it (at its next layer boundary) once every chunk of it has `landed` aside."""

    __slots__ = ("a", "b", "checkpoints", "fetching", "landed", "scope")

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b
        self.scope = anyio.CancelScope()
        self.checkpoints = Checkpoints()  # how far it got, if it is stopped part-way
        self.fetching: dict[int, anyio.CancelScope] = {}
        self.landed: dict[int, tuple[int, Callable[[], None]]] = {}

    def overtaken(self) -> bool:
        return len(self.landed) == self.b - self.a


def checkpoint() -> None:
    """Raise `UnitCancelled` if the compute unit running on this thread has been cancelled."""
    token = getattr(_current, "token", None)
    count = getattr(_current, "checkpoints", None)
    if token is not None and token.is_set():
        if count is not None:
            count.stopped = time.perf_counter()
        raise UnitCancelled
    if count is not None:
        count.passed += 1


async def run_unit(fn: Callable[..., T], *args: object, checkpoints: Checkpoints | None = None) -> T:
    """`fn(*args)` in a worker thread, as a compute unit: if the calling task is cancelled meanwhile,
    the unit is told to stop at its next `checkpoint()` and this returns (raising the cancellation)
    only once the thread has left `fn`, so nothing of the unit still runs. A unit cancelled before its
    thread took it up never starts. `checkpoints`, if given, counts the checkpoints the unit passes:
    a unit stopped part-way says how much of it ran, and in how long."""
    token = threading.Event()
    done = threading.Event()
    lock = threading.Lock()
    state = ["pending"]  # -> "running" -> "finished"; or "abandoned" before it ran

    def work() -> T:
        with lock:
            if state[0] == "abandoned":
                raise UnitCancelled
            state[0] = "running"
        _current.token, _current.checkpoints = token, checkpoints
        if checkpoints is not None:
            checkpoints.began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _current.token = _current.checkpoints = None
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
