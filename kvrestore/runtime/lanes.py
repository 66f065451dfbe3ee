"""The load lanes: a load as an event-loop task (`timed_load`), or on a lane thread, where it never
touches the event loop while it runs (`LaneThreads`, `ThreadLoad`).

A load from a store that can read without the event loop (`ChunkStore.reads_sync`: in-process memory, a
local directory) is one blocking call: read, verify, place. Run as an event-loop task, each such load
costs the loop a task, a cancel scope, a lane limiter and a thread hop, a few hundred microseconds of
Python holding the GIL per chunk, which is what a compute lane launching kernels starves on (measured:
a launching thread kept 0.5-0.6 of its rate during one lane's loads). Here a restore hands the job to
one of the engine's lane threads and hears back once, when it has finished: the loop's share of a load
is a queue put and one wake-up.

Threads are started on demand, at most `lanes` of them, and exit after `idle_s` without work, so an
idle engine holds none; `close()` ends them at once, once the jobs queued before it have run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio

from kvrestore.core.errors import LOAD_FAULTS, InvalidInputError
from kvrestore.core.trace import TraceEvent

Job = Callable[[], None]

#: queued by `close()`: the thread that takes it ends
_STOP = object()


class LaneThreads:
    """Up to `lanes` daemon threads running submitted jobs in submission order (FIFO)."""

    def __init__(self, lanes: int, idle_s: float = 10.0, name: str = "kvrestore-load") -> None:
        if lanes <= 0:
            raise InvalidInputError(f"lanes must be positive, got {lanes}")
        self.lanes = lanes
        self.idle_s = idle_s
        self.name = name
        self._jobs: queue.SimpleQueue[Job | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # alive
        self._busy = 0  # running a job
        self._queued = 0  # submitted, not yet taken
        self._running: dict[int, Job] = {}  # by thread id: the job each lane thread runs
        self._detached: set[int] = set()  # threads whose job was abandoned: they end with it

    @property
    def threads(self) -> int:
        """Lane threads alive now."""
        return self._threads

    def reserve(self, jobs: int) -> None:
        """Start the threads that `jobs` submissions about to be made will need, before any of them is
        queued. A thread's start waits until the new thread holds the GIL; started while the jobs of the
        same batch already run on the other lanes, each start waits behind them (milliseconds apiece on
        a busy machine, measured: 9 ms for four lanes beside a compute unit), started first it does not."""
        with self._lock:
            idle = self._threads - self._busy - self._queued
            start = max(0, min(jobs - idle, self.lanes - self._threads))
            first = self._threads
            self._threads += start
        for k in range(start):
            threading.Thread(target=self._work, name=f"{self.name}-{first + k + 1}", daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue `job` (it must not raise: report results and errors from inside it)."""
        self._jobs.put(job)
        with self._lock:
            self._queued += 1
            if self._threads - self._busy >= self._queued or self._threads >= self.lanes:
                return  # a waiting thread takes it, or every lane is busy and it waits its turn
            self._threads += 1
            name = f"{self.name}-{self._threads}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queued == 0:  # nothing arrived meanwhile: this lane ends
                        self._threads -= 1
                        return
                continue
            if job is _STOP:
                with self._lock:
                    self._threads -= 1
                return
            me = threading.get_ident()
            with self._lock:
                self._queued -= 1
                self._busy += 1
                self._running[me] = job  # type: ignore[assignment]
            try:
                job()  # type: ignore[operator]
            finally:
                # an idle lane must not keep its last job (and the restore it closes over) alive
                job = None
                with self._lock:
                    del self._running[me]
                    detached = me in self._detached  # it left the lanes while its job ran (`detach`)
                    self._detached.discard(me)
                    if not detached:
                        self._busy -= 1
            if detached:
                return

    def detach(self, job: Job) -> None:
        """`job` was abandoned while it runs (a read stalled past its deadline): its thread leaves the
        lanes, to end once the job returns, and a new thread starts for the jobs queued meanwhile, so a
        stalled read never holds up the loads behind it. Nothing to do if `job` is not running."""
        with self._lock:
            me = next((t for t, running in self._running.items() if running is job), None)
            if me is None or me in self._detached:
                return
            self._detached.add(me)
            self._threads -= 1
            self._busy -= 1
            if self._queued == 0 or self._threads - self._busy >= self._queued:
                return
            self._threads += 1
            name = f"{self.name}-{self._threads}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def close(self) -> None:
        """End every lane thread once the jobs queued so far have run (without waiting for it). A
        later `submit` starts threads again."""
        with self._lock:
            alive = self._threads
        for _ in range(alive):
            self._jobs.put(_STOP)


class Stoppable(Protocol):
    def cancel(self) -> object: ...


class ThreadLoad:
    """A load on a lane thread: its read (which may stall), then its placing into the KV. `cancel()`
    drops it: skipped if it has not started; abandoned if it is reading (what the read brings is
    discarded, never placed), and then it writes no more at once; let finish if it is placing (bounded
    work). `stopped` is set once it will write no more; `started_at` (the restore's clock) once a lane
    thread has begun it; `work` is what the lane thread runs."""

    __slots__ = ("cancelled", "lock", "placing", "started_at", "stopped", "work")

    def __init__(self) -> None:
        self.cancelled = False
        self.placing = False
        self.started_at: float | None = None
        self.stopped = anyio.Event()
        self.lock = threading.Lock()
        self.work: Callable[[], None] | None = None

    def cancel(self) -> bool:
        """Drop the load; True if it can write no more from now on (it is not placing)."""
        with self.lock:
            self.cancelled = True
            return not self.placing

    def begin_placing(self) -> bool:
        """On the lane thread, once the read has ended: whether to place (False: dropped meanwhile)."""
        with self.lock:
            self.placing = not self.cancelled
            return self.placing


async def timed_load(
    load: Callable[[int], Awaitable[int]],
    i: int,
    timeout_s: float | None,
    now: Callable[[], float],
    kind: str = "load",
    timed_out: Callable[[float], None] | None = None,
) -> TraceEvent:
    """Run one load; its event on the `now` clock: `kind` ("load", or "aside" for a fetch aside), or
    `kind`-failed for a fault that makes the chunk a miss (cancellation passes through). A load past
    `timeout_s` is cancelled (a blocking read in it abandoned) and `timed_out` told the seconds, unless
    the store itself timed it out (`StoreTimeoutError`: it counts itself down)."""
    start = now()
    deadline: anyio.CancelScope | None = None
    try:
        with anyio.fail_after(timeout_s) as deadline:
            nbytes = await load(i)
    except LOAD_FAULTS as exc:
        error = f"{type(exc).__name__}: {exc}"
        if deadline is not None and deadline.cancelled_caught and timeout_s is not None:
            error = past_deadline(timeout_s)
            if timed_out is not None:
                timed_out(timeout_s)
        return TraceEvent(f"{kind}-failed", i, i, start, now(), error=error)
    return TraceEvent(kind, i, i, start, now(), nbytes)


def past_deadline(timeout_s: float) -> str:
    """The error of a load abandoned past its deadline, as a trace reports it."""
    return f"TimeoutError: the load did not finish within {timeout_s:g} s (load_timeout_s): abandoned"
