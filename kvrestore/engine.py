"""The async core: one compute lane and N load lanes, driven by a policy.

The engine knows concurrency and nothing else: a restore hands it a `Progress`, a policy, a `compute`
callable (blocking torch work: chunks [a, b) -> writes their KV) and a `load` coroutine (chunk i -> bytes
read, raising on any fault). Compute runs in a worker thread behind the engine's compute limiter (one
unit at a time across every restore sharing the engine); loads run as tasks behind the load-lane
limiter. After each finished unit the engine updates the progress and asks the policy again.

Cancellation: the task group cancels pending loads; a compute unit already in its thread is waited
for (torch work cannot be interrupted), and a unit is marked done only after its KV is fully written,
so a cancelled restore leaves no running task and no half-applied chunk.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import CapacityLimiter

from .errors import ChunkDecodeError, StoreError
from .policies.base import ChunkStatus, Policy, Progress
from .trace import Trace, TraceEvent

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

ComputeFn = Callable[[int, int], None]
LoadFn = Callable[[int], Awaitable[int]]

#: faults of a load that turn the chunk into a miss (recomputed) instead of failing the restore
LOAD_FAULTS = (ChunkDecodeError, StoreError, OSError, TimeoutError)


def _single(exc: BaseException) -> BaseException:
    """The one error inside nested exception groups (a failed unit, a policy error), else the group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class PolicyStalledError(RuntimeError):
    """The policy started nothing while nothing was running and chunks were left."""


class Engine:
    """Shared lanes for any number of concurrent restores in one event loop."""

    def __init__(self, load_lanes: int = 4) -> None:
        if load_lanes <= 0:
            raise ValueError(f"load_lanes must be positive, got {load_lanes}")
        self.load_lanes = load_lanes
        self._limiters: tuple[object, CapacityLimiter, CapacityLimiter] | None = None

    def _lanes(self) -> tuple[CapacityLimiter, CapacityLimiter]:
        """(compute, load) limiters, created in (and bound to) the running event loop."""
        token = anyio.lowlevel.current_token()
        if self._limiters is None or self._limiters[0] is not token:
            self._limiters = (token, anyio.CapacityLimiter(1), anyio.CapacityLimiter(self.load_lanes))
        return self._limiters[1], self._limiters[2]

    async def compute(self, fn: Callable[..., object], *args: object) -> object:
        """Run blocking torch work on the compute lane (shared with every restore on this engine)."""
        compute_lane, _ = self._lanes()
        async with compute_lane:
            return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=False)

    async def run(
        self,
        progress: Progress,
        policy: Policy,
        compute: ComputeFn,
        load: LoadFn,
        on_event: Callable[[TraceEvent], None] | None = None,
        load_timeout_s: float | None = None,
    ) -> Trace:
        """Drive one restore to the end; returns its trace. A unit's own error propagates as itself."""
        run = _Run(self, progress, policy, compute, load, on_event, load_timeout_s)
        try:
            await run.drive()
        except BaseExceptionGroup as group:
            raise _single(group) from None
        return run.trace


class _Run:
    """One restore on an engine: starts the units the policy picks and applies their results."""

    def __init__(
        self,
        engine: Engine,
        progress: Progress,
        policy: Policy,
        compute: ComputeFn,
        load: LoadFn,
        on_event: Callable[[TraceEvent], None] | None,
        load_timeout_s: float | None,
    ) -> None:
        self.engine = engine
        self.progress = progress
        self.policy = policy
        self.compute_fn = compute
        self.load_fn = load
        self.on_event = on_event
        self.load_timeout_s = load_timeout_s
        self.compute_lane, self.load_lane = engine._lanes()
        self.trace = Trace()
        self.t0 = time.perf_counter()
        self.send, self.receive = anyio.create_memory_object_stream[TraceEvent](math.inf)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    async def _compute(self, a: int, b: int) -> None:
        async with self.compute_lane:
            start = self._now()
            await anyio.to_thread.run_sync(self.compute_fn, a, b, abandon_on_cancel=False)
            await self.send.send(TraceEvent("compute", a, b - 1, start, self._now()))

    async def _load(self, i: int) -> None:
        async with self.load_lane:
            start = self._now()
            try:
                with anyio.fail_after(self.load_timeout_s):
                    nbytes = await self.load_fn(i)
            except LOAD_FAULTS as exc:
                error = f"{type(exc).__name__}: {exc}"
                await self.send.send(TraceEvent("load-failed", i, i, start, self._now(), error=error))
                return
            await self.send.send(TraceEvent("load", i, i, start, self._now(), nbytes))

    async def drive(self) -> None:
        progress, policy = self.progress, self.policy
        async with anyio.create_task_group() as tg:
            while not progress.finished:
                progress.free_load_lanes = max(0, self.engine.load_lanes - progress.loads_in_flight)
                decision = policy.decide(progress)
                if decision.compute is not None:
                    a, b = decision.compute
                    _check_compute(progress, a, b)
                    for j in range(a, b):
                        progress.status[j] = ChunkStatus.COMPUTING
                    progress.compute_busy = True
                    tg.start_soon(self._compute, a, b)
                for i in decision.loads:
                    if progress.status[i] is not ChunkStatus.PENDING or not progress.stored[i]:
                        raise RuntimeError(
                            f"{policy!r} asked to load chunk {i}, which is {progress.status[i].value}"
                        )
                    progress.status[i] = ChunkStatus.LOADING
                    progress.loads_in_flight += 1
                    tg.start_soon(self._load, i)
                if not progress.compute_busy and progress.loads_in_flight == 0:
                    raise PolicyStalledError(
                        f"{policy!r} left chunks {progress.pending()} with no unit running"
                    )
                event = await self.receive.receive()
                apply_event(progress, event)
                self.trace.add(event)
                if self.on_event is not None:
                    self.on_event(event)


def _check_compute(progress: Progress, a: int, b: int) -> None:
    """A policy may start a compute unit only on a free lane, at the end of the done prefix, over pending chunks."""
    if progress.compute_busy:
        raise RuntimeError("policy started a compute unit while the compute lane is busy")
    if not (0 <= a < b <= progress.n_chunks) or progress.done_prefix() != a:
        raise RuntimeError(f"compute of chunks [{a}, {b}) needs every chunk before {a} done")
    if any(progress.status[j] is not ChunkStatus.PENDING for j in range(a, b)):
        raise RuntimeError(f"compute of chunks [{a}, {b}) covers a chunk that is not pending")


def apply_event(progress: Progress, event: TraceEvent) -> None:
    """Update a restore's progress with a finished unit (kept apart from decisions, as in vLLM)."""
    if event.kind == "compute":
        progress.compute_busy = False
        n = event.last_chunk - event.first_chunk + 1
        for j in range(event.first_chunk, event.last_chunk + 1):
            progress.status[j] = ChunkStatus.COMPUTED
            progress.compute_seconds[j] = event.seconds / n
        return
    progress.loads_in_flight -= 1
    i = event.first_chunk
    if event.kind == "load":
        progress.status[i] = ChunkStatus.LOADED
        progress.load_seconds[i] = event.seconds
        progress.bytes_loaded += event.nbytes
    else:  # a fault: the chunk is a miss from now on
        progress.status[i] = ChunkStatus.PENDING
        progress.stored[i] = False
