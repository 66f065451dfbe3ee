"""The async core: one compute lane and N load lanes, driven by a policy.

The engine knows concurrency and nothing else: a restore hands it one `RunRequest` (`runtime.request`):
a `Progress`, a policy, a `compute` callable (blocking torch work: chunks [a, b) -> writes their KV)
and a `load` coroutine (chunk i -> bytes read, raising on any fault). Compute runs in a worker thread
behind the engine's compute limiter (one unit at a time across every restore sharing the engine; on
CUDA its kernels go to the compute lane's own stream, see `cuda_stream`); loads run as tasks behind the
load-lane limiter. A restore whose store reads without the event loop also hands over
`FastPaths.load_now` (the same load as one blocking call): those loads run on the engine's lane
threads (`lanes.LaneThreads`, at most `load_lanes` of them), and the loop only queues each one and
hears back once, so its Python per chunk stays small (it holds the GIL that a compute lane launching
kernels needs). `load_timeout_s` bounds the loads that wait on a remote
store; a blocking load from memory or a local file is not interrupted. The loop that asks the policy,
begins its decision and applies each finished unit is `driver.drive`, the simulator's too; this module
is its real-clock lanes (`_RealLanes`). After each finished unit the policy is asked again; a policy
may also drop a load in flight (its chunk goes to the compute lane once the load has stopped) or ask
to be woken at a time of its choosing (`Decision.wake_at`).

Cancellation: the task group cancels pending loads; a compute unit already in its thread is waited
for (torch work cannot be interrupted), and a unit is marked done only after its KV is fully written,
so a cancelled restore leaves no running task and no half-applied chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel
import torch
from anyio import CapacityLimiter
from anyio.abc import TaskGroup

from kvrestore.core.cancel import Unit, run_unit
from kvrestore.core.errors import LOAD_FAULTS
from kvrestore.core.settings import check_int
from kvrestore.core.streams import load_stream
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.policies.base import Decision
from kvrestore.runtime.bookkeeping import set_capabilities
from kvrestore.runtime.driver import PolicyStalledError, drive  # noqa: F401 - re-exported
from kvrestore.runtime.lanes import LaneThreads, Stoppable, ThreadLoad, past_deadline, timed_load
from kvrestore.runtime.request import (
    FastPaths,
    LoadFn,
    RunRequest,
)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


def _single(exc: BaseException) -> BaseException:
    """The one error inside nested exception groups (a failed unit, a policy error), else the group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _on_asyncio() -> bool:
    """Whether the running event loop is asyncio's (lane threads report back through it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Engine:
    """Shared lanes for any number of concurrent restores in one event loop."""

    #: whether a restore's time on this engine is its own work, so a restorer may learn from it how its
    #: predictions compare (`Planner.calibration`); under a batch scheduler it is mostly other requests'
    times_restores_alone = True
    #: whether a restore given no policy is planned (`Auto` predicts each strategy as if the restore had
    #: the lanes to itself, which on a plain engine it mostly has); else it runs the token-wise two-pointer
    plans_by_default = True
    #: whether `run` takes a request's `FastPaths` (lane-thread loads, races, fetches aside)
    takes_fast_paths = True

    def __init__(self, load_lanes: int = 4) -> None:
        self.load_lanes = check_int("load_lanes", load_lanes)
        self._limiters: tuple[object, CapacityLimiter, CapacityLimiter] | None = None
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self._lane_threads: LaneThreads | None = None

    def lane_threads(self) -> LaneThreads:
        """The threads `load_now` loads run on (started on demand; at most `load_lanes`)."""
        if self._lane_threads is None:
            self._lane_threads = LaneThreads(self.load_lanes)
        return self._lane_threads

    def close(self) -> None:
        """End the lane threads (the restorer that made this engine closes it with itself)."""
        threads, self._lane_threads = self._lane_threads, None
        if threads is not None:
            threads.close()

    def cuda_stream(self, lane: str, device: torch.device | str) -> torch.cuda.Stream | None:
        """The CUDA stream of a lane ("compute" or "load") on `device`, None off CUDA.

        Each lane queues its kernels and copies on its own stream, so a load's host-to-device copy
        overlaps the compute lane's kernels instead of waiting behind them on the default stream. The
        load stream runs at high priority (`core.streams.load_stream`).
        """
        device = torch.device(device)
        if device.type != "cuda":
            return None
        key = (lane, device.index if device.index is not None else torch.cuda.current_device())
        stream = self._streams.get(key)
        if stream is None:
            make = load_stream if lane == "load" else torch.cuda.Stream
            stream = self._streams[key] = make(device=key[1])
        return stream

    def lanes_after_current(self, device: torch.device | str) -> None:
        """Make the lanes' streams on `device` wait for what is queued on the caller's current stream
        (nothing to do off CUDA). A buffer the lanes are about to write was allocated on that stream,
        whose memory may have held tensors its queued kernels still use, or is the caller's own (`out`),
        with reads of it still queued there."""
        device = torch.device(device)
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        for lane in ("compute", "load"):
            stream = self.cuda_stream(lane, device)
            assert stream is not None
            stream.wait_stream(current)

    def _lanes(self) -> tuple[CapacityLimiter, CapacityLimiter]:
        """(compute, load) limiters, created in (and bound to) the running event loop."""
        token = anyio.lowlevel.current_token()
        if self._limiters is None or self._limiters[0] != token:
            self._limiters = (token, anyio.CapacityLimiter(1), anyio.CapacityLimiter(self.load_lanes))
        return self._limiters[1], self._limiters[2]

    async def compute(self, fn: Callable[..., object], *args: object) -> object:
        """Run blocking torch work on the compute lane (shared with every restore on this engine)."""
        compute_lane, _ = self._lanes()
        async with compute_lane:
            out = await run_unit(fn, *args)
        return out

    async def run(self, request: RunRequest) -> Trace:
        """Drive one restore to the end; returns its trace. A unit's own error propagates as itself.
        The request's fast paths (`FastPaths`) are taken where given: `load_now` on asyncio (elsewhere
        `load` is used), `compute_apart` lets the policy race, `load_aside` lets it overtake."""
        fast = request.fast_paths or FastPaths()
        if not _on_asyncio():
            fast = dataclasses.replace(fast, load_now=None)
        progress = request.progress
        set_capabilities(progress, fast.compute_apart is not None, fast.load_aside is not None)
        lanes = _RealLanes(self, request, fast)
        try:
            async with anyio.create_task_group() as tg:
                lanes.tg = tg
                try:
                    trace = await drive(
                        progress, request.policy, lanes, request.on_event, priors=request.priors
                    )
                finally:
                    if lanes.thread_loads:  # failed or cancelled: nothing may write into its KV after it
                        await lanes.stop_thread_loads()
        except BaseExceptionGroup as group:
            raise _single(group) from None
        finally:  # every task that could report has ended with the task group
            lanes.send.close()
            lanes.receive.close()
        return trace


class _RealLanes:
    """One restore's lanes on an engine (the driver's `Lanes` on a real clock): loads as tasks or on
    lane threads, compute units and races in the compute lane's worker thread."""

    tg: TaskGroup

    def __init__(self, engine: Engine, request: RunRequest, fast: FastPaths) -> None:
        self.engine = engine
        self.load_aside = fast.load_aside
        self.unit: Unit | None = None  # the compute unit running in place, while it may be overtaken
        self.load_lanes = engine.load_lanes
        self.compute_apart = fast.compute_apart
        self.race_scope: anyio.CancelScope | None = None  # the racing compute unit's, while it races
        self.outcomes: dict[int, str] = {}  # how each chunk's latest load ended ("load", "load-dropped"...)
        self.progress = request.progress
        self.compute_fn = request.compute
        self.load_fn = request.load
        self.load_timeout_s = request.load_timeout_s
        self.compute_lane, self.load_lane = engine._lanes()
        self.t0 = time.perf_counter()
        self.send, self.receive = anyio.create_memory_object_stream[TraceEvent | BaseException](math.inf)
        self.loads: dict[int, tuple[Stoppable, anyio.Event]] = {}  # in flight, by chunk
        self.dropped: list[anyio.Event] = []  # the loads the next compute unit waits for to stop
        self.load_now = fast.load_now
        self.thread_loads: dict[ThreadLoad, int] = {}  # on lane threads (their chunks), not yet over
        #: thread loads dropped while placing: whatever they report, their chunk went to the compute lane
        self.dropped_placing: set[ThreadLoad] = set()
        self.meter = request.delivered
        self.timed_out = request.timed_out

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def delivered(self) -> float | None:
        return None if self.meter is None else self.meter()

    async def _compute(self, unit: Unit, dropped: list[anyio.Event]) -> None:
        a, b = unit.a, unit.b
        start = self.now()
        try:
            with unit.scope:  # cancelled once fetches aside have landed every chunk of the unit
                for stopped in dropped:  # a dropped load may be writing these rows until it stops
                    await stopped.wait()
                async with self.compute_lane:
                    start = self.now()
                    # cancelled: stops at the next layer, then returns
                    await run_unit(self.compute_fn, a, b, checkpoints=unit.checkpoints)
        finally:
            if self.unit is unit:
                self.unit = None
            for scope in unit.fetching.values():  # the unit has ended: what is still in flight is moot
                scope.cancel()
        if unit.scope.cancelled_caught:  # overtaken: write what the fetches aside brought instead
            nbytes = 0
            for n, commit in unit.landed.values():
                await run_unit(commit)
                nbytes += n
            self.send.send_nowait(
                TraceEvent(
                    "compute-overtaken", a, b - 1, start, self.now(), nbytes, partial=unit.checkpoints.part()
                )
            )
            return
        self.send.send_nowait(TraceEvent("compute", a, b - 1, start, self.now()))

    async def _aside(self, i: int, unit: Unit, scope: anyio.CancelScope) -> None:
        """Fetch chunk `i` of the running `unit` into a buffer of its own; once every chunk of the unit
        has landed so, stop the unit."""
        assert self.load_aside is not None
        load_aside = self.load_aside

        async def fetch(i: int) -> int:
            nbytes, commit = await load_aside(i)
            unit.landed[i] = (nbytes, commit)
            return nbytes

        try:
            start, event = await self._on_load_lane(fetch, i, scope, "aside")
        finally:
            unit.fetching.pop(i, None)
        self.send.send_nowait(event or TraceEvent("aside-dropped", i, i, start, self.now()))
        if unit.overtaken():
            unit.scope.cancel()

    async def _race(self, a: int, scope: anyio.CancelScope) -> None:
        """Compute chunk `a` apart while its fetch runs (`Decision.race`). Whichever ends first wins;
        the compute unit's KV is written only once the fetch has stopped without landing."""
        assert self.compute_apart is not None
        async with self.compute_lane:
            start = self.now()
            commit = None
            with scope:
                commit = await run_unit(self.compute_apart, a, a + 1)
            entry = self.loads.get(a)
            if commit is not None and entry is not None:  # computed first: stop the fetch
                stoppable, stopped = entry
                stoppable.cancel()
                with anyio.CancelScope(shield=True):
                    await stopped.wait()
            if commit is None or self.outcomes.get(a) == "load":  # the fetch landed first: it won
                self.send.send_nowait(TraceEvent("compute-dropped", a, a, start, self.now()))
                return
            await run_unit(commit)
            self.send.send_nowait(TraceEvent("compute", a, a, start, self.now()))

    async def _on_load_lane(
        self, load: LoadFn, i: int, scope: anyio.CancelScope, kind: str
    ) -> tuple[float, TraceEvent | None]:
        """Run one load of chunk `i` on a load lane under `scope`: when it began, and its event (None:
        stopped by `scope` before it ended)."""
        start = self.now()
        event: TraceEvent | None = None
        with scope:
            async with self.load_lane:
                start = self.now()
                event = await timed_load(load, i, self.load_timeout_s, self.now, kind, self.timed_out)
        return start, event

    async def _load(self, i: int, scope: anyio.CancelScope, stopped: anyio.Event) -> None:
        try:
            start, event = await self._on_load_lane(self.load_fn, i, scope, "load")
            if scope.cancel_called:  # dropped: whatever it read is not applied
                event = TraceEvent("load-dropped", i, i, start, self.now())
            if event is not None:
                self.outcomes[i] = event.kind
                self.send.send_nowait(event)
        finally:
            stopped.set()

    def _submit_now(self, i: int) -> ThreadLoad:
        """Queue the load of chunk `i` on a lane thread; its outcome comes back through `_landed`, unless
        it was abandoned first (`_abandon`)."""
        assert self.load_now is not None
        load_now, now, job = self.load_now, self.now, ThreadLoad()
        call_soon = asyncio.get_running_loop().call_soon_threadsafe

        def run() -> None:  # on a lane thread
            outcome: TraceEvent | BaseException
            start = job.started_at = now()
            if job.cancelled:
                outcome = TraceEvent("load-dropped", i, i, start, start)
            else:
                try:
                    fetched = load_now(i)  # the store's read: it may stall, and writes nothing yet
                    if job.begin_placing():
                        outcome = TraceEvent("load", i, i, start, now(), fetched.place())
                    else:  # dropped or abandoned meanwhile: what it read is not applied
                        fetched.discard()
                        outcome = TraceEvent("load-dropped", i, i, start, now())
                except LOAD_FAULTS as exc:
                    outcome = TraceEvent(
                        "load-failed", i, i, start, now(), error=f"{type(exc).__name__}: {exc}"
                    )
                except BaseException as exc:  # a bug, not a store fault: the restore fails with it
                    outcome = exc
                if job.cancelled and isinstance(outcome, TraceEvent):  # dropped: what it read is not applied
                    outcome = TraceEvent("load-dropped", i, i, start, now())
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for it
                call_soon(self._landed, job, outcome)

        job.work = run
        self.thread_loads[job] = i
        self.engine.lane_threads().submit(run)
        return job

    def _landed(self, job: ThreadLoad, outcome: TraceEvent | BaseException) -> None:
        """A lane thread's load has finished (on the loop); one abandoned before is over already."""
        if self.thread_loads.pop(job, None) is None:
            return
        job.work = None  # its closure holds the job: no cycle outlives the load
        if job in self.dropped_placing and isinstance(outcome, TraceEvent):
            # dropped after its read (its report was on its way): the drop was begun, so it counts as one
            self.dropped_placing.discard(job)
            outcome = TraceEvent(
                "load-dropped", outcome.first_chunk, outcome.last_chunk, outcome.start_s, outcome.end_s
            )
        if isinstance(outcome, TraceEvent):
            self.outcomes[outcome.first_chunk] = outcome.kind
        job.stopped.set()
        self.send.send_nowait(outcome)

    def _abandon(self, job: ThreadLoad, outcome: TraceEvent | None) -> bool:
        """Drop a thread load; if it is still reading, it is over now: its lane thread leaves the lanes
        (`LaneThreads.detach`), `outcome` (if any) is reported for it, and whatever its read brings is
        discarded. Returns whether it was over so (False: it is placing, and reports when done)."""
        if not job.cancel():
            return False
        self.thread_loads.pop(job, None)
        if job.work is not None and job.started_at is not None:
            self.engine.lane_threads().detach(job.work)
        job.work = None
        job.stopped.set()
        if outcome is not None:
            self.outcomes[outcome.first_chunk] = outcome.kind
            self.send.send_nowait(outcome)
        return True

    def _deadline(self, job: ThreadLoad, now: float) -> float:
        """When a thread load runs past `load_timeout_s`: from its start, or from now for one not begun
        (a lane thread sets `started_at`, so an early wake-up only looks again); never for one placing."""
        assert self.load_timeout_s is not None
        if job.placing:  # its read is over: it reports once placed
            return math.inf
        return (job.started_at if job.started_at is not None else now) + self.load_timeout_s

    def _expire(self) -> None:
        """Abandon the thread loads whose read has run past `load_timeout_s`: each chunk a failed load
        (computed instead), and the store told (`RunRequest.timed_out`)."""
        if self.load_timeout_s is None or not self.thread_loads:
            return
        now = self.now()
        for job, i in list(self.thread_loads.items()):
            if job.placing or job.started_at is None or now < job.started_at + self.load_timeout_s:
                continue
            failed = TraceEvent(
                "load-failed", i, i, job.started_at, now, error=past_deadline(self.load_timeout_s)
            )
            if self.timed_out is not None:  # first: the loads its lane thread's successor starts see it
                self.timed_out(self.load_timeout_s)
            self._abandon(job, failed)

    async def stop_thread_loads(self) -> None:
        """Drop every load still on a lane thread and wait until none can write any more: a load still
        reading is abandoned at once, one placing its chunk is waited for (bounded work)."""
        with anyio.CancelScope(shield=True):
            for job in list(self.thread_loads):
                self._abandon(job, None)
            for job in list(self.thread_loads):
                await job.stopped.wait()

    def stop(self, drops: Sequence[int]) -> None:
        for i in drops:
            stoppable, stopped = self.loads[i]
            if isinstance(stoppable, ThreadLoad):  # a read abandoned now is over, reported as dropped
                t = self.now()
                if not self._abandon(stoppable, TraceEvent("load-dropped", i, i, t, t)):
                    self.dropped_placing.add(stoppable)  # placing: it reports when done, as dropped
            else:
                stoppable.cancel()
            self.dropped.append(stopped)

    def start(self, decision: Decision) -> None:
        if self.load_now is not None and decision.loads:
            self.engine.lane_threads().reserve(len(decision.loads))
        for i in decision.loads:
            self.outcomes.pop(i, None)
            if self.load_now is not None:
                job = self._submit_now(i)
                self.loads[i] = (job, job.stopped)
                continue
            scope, stopped = anyio.CancelScope(), anyio.Event()
            self.loads[i] = (scope, stopped)
            self.tg.start_soon(self._load, i, scope, stopped)
        if decision.race:
            self.race_scope = anyio.CancelScope()
            self.tg.start_soon(self._race, decision.compute[0], self.race_scope)  # type: ignore[index]
        elif decision.compute is not None:
            self.unit = Unit(*decision.compute)
            self.tg.start_soon(self._compute, self.unit, self.dropped)
        if decision.compute is not None:
            self.dropped = []
        for i in decision.overtake:
            assert self.unit is not None  # bookkeeping checked that a unit runs in place
            scope = self.unit.fetching[i] = anyio.CancelScope()
            self.tg.start_soon(self._aside, i, self.unit, scope)

    def _pending(self) -> bool:
        """Whether an outcome waits to be received (an abandoned load's, reported by `_expire`)."""
        return self.receive.statistics().current_buffer_used > 0

    def _take(self, item: TraceEvent | BaseException) -> TraceEvent | BaseException:
        if isinstance(item, BaseException):
            return item
        if item.kind.startswith("load"):
            self.loads.pop(item.first_chunk, None)
        if item.kind == "load" and item.first_chunk == self.progress.running.racing and self.race_scope:
            self.race_scope.cancel()  # the fetch won: the compute unit stops at its next layer
        return item

    async def wait(self, wake_at: float | None) -> list[TraceEvent | BaseException]:
        """What finished by `wake_at` (None: until something does), a thread load abandoned past its
        deadline included (`_expire`)."""
        out: list[TraceEvent | BaseException] = []
        while True:
            now = self.now()
            until = math.inf if wake_at is None else wake_at
            if self.load_timeout_s is not None and self.thread_loads:
                until = min(until, *(self._deadline(job, now) for job in self.thread_loads))
            with anyio.move_on_after(max(0.0, until - now)):
                out.append(self._take(await self.receive.receive()))
            self._expire()
            if out or (wake_at is not None and self.now() >= wake_at) or self._pending():
                break
        while True:  # everything else that finished meanwhile, so the policy sees it all
            try:
                out.append(self._take(self.receive.receive_nowait()))
            except anyio.WouldBlock:
                return out
