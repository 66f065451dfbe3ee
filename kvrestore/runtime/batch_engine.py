"""BatchEngine: one compute lane and N load lanes shared by many restores, under a batch scheduler.

A plain `Engine` runs each restore's policy as if it were alone and serves the lanes first come, first
served. A `BatchEngine` keeps every restore's own pointers but lets one `BatchScheduler`
(`policies.batch`) hand out the lanes: each compute step spends a token budget in priority order, and
each free load lane goes to the request the scheduler ranks first. A serving process makes one, enters
it for its lifetime and gives it to its `Restorer`::

    engine = BatchEngine(BatchAware())
    async with engine:
        restorer = Restorer(backend, store, engine=engine)
        ...  # any number of concurrent `await restorer.restore(tokens)` calls

One driver task (started by ``async with``) owns all decisions: a restore's `run` registers its job and
waits; the driver asks the scheduler, starts units, and applies their results with the same bookkeeping
as the `Engine` and the simulator (`simulate_batch` runs the very same scheduler objects). Decode steps
and other blocking model work go through `compute`, as the highest-priority class.

Cancellation: a cancelled restore is taken out of scheduling at once; its loads are cancelled and
`run` returns only after its compute unit in flight (if any) has finished, so no task writes into its
KV afterwards. A unit's own error fails only its restore.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.profile import ChunkCost
from kvrestore.policies.base import Policy, Progress
from kvrestore.policies.batch import BatchAware, BatchJob, BatchScheduler, ComputeStep, note_step
from kvrestore.policies.compute_only import ComputeOnly
from kvrestore.runtime.bookkeeping import apply_event, begin_loads, begin_step
from kvrestore.runtime.engine import ComputeFn, Engine, LoadFn, LoadNowFn, PolicyStalledError, timed_load

#: ranks chunks when no profile is given: tokens, each costing more the further along the prompt
#: (SmolLM2 on CPU: a token after 512 others costs about twice one at the start)
DEFAULT_COST = ChunkCost(fixed_s=0.0, per_token_s=1.0, per_token_past_s=1.0 / 512)


class EngineNotRunningError(RuntimeError):
    """A restore was handed to a `BatchEngine` that has not been entered (`async with engine:`)."""


@dataclass(eq=False)
class _Live:
    """A job and what the driver needs to run it."""

    job: BatchJob
    compute: ComputeFn
    load: LoadFn
    on_event: Callable[[TraceEvent], None] | None
    load_timeout_s: float | None
    trace: Trace = field(default_factory=Trace)
    busy: int = 0  # units started whose result the driver has not taken yet
    loads: dict[int, tuple[anyio.CancelScope, anyio.Event]] = field(default_factory=dict)
    cancelled: bool = False
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)

    @property
    def active(self) -> bool:
        return not self.cancelled and self.error is None and not self.done.is_set()


class BatchEngine(Engine):
    """Shared lanes for many concurrent restores, scheduled together by `scheduler`."""

    times_restores_alone = False
    #: each request keeps its own token-wise two-pointer; the scheduler shares the lanes out
    plans_by_default = False

    def __init__(
        self,
        scheduler: BatchScheduler | None = None,
        load_lanes: int = 4,
        cost: ChunkCost | None = None,
    ) -> None:
        super().__init__(load_lanes)
        self.scheduler = scheduler if scheduler is not None else BatchAware()
        self.cost = cost or DEFAULT_COST
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count()
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._send: Any = None
        self._t0 = time.perf_counter()
        self._computing = False

    def __repr__(self) -> str:
        return f"BatchEngine({self.scheduler!r}, load_lanes={self.load_lanes})"

    # -- lifetime ------------------------------------------------------------------------------------

    async def __aenter__(self) -> BatchEngine:
        if self._stack is not None:
            raise RuntimeError("this BatchEngine is already running")
        stack = contextlib.AsyncExitStack()
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._send, receive = anyio.create_memory_object_stream[tuple](math.inf)
        self._stack = stack
        self._tg.start_soon(self._drive, self._tg, receive)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop the driver; restores still waiting fail with `EngineNotRunningError`."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        for live in list(self._live.values()):
            live.error = live.error or EngineNotRunningError("the BatchEngine was closed during the restore")
            live.done.set()
        self._tg.cancel_scope.cancel()
        await stack.aclose()  # waits for compute units already in their thread
        self._live.clear()
        self._computing = False

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # -- what restores call --------------------------------------------------------------------------

    async def run(
        self,
        progress: Progress,
        policy: Policy,
        compute: ComputeFn,
        load: LoadFn,
        on_event: Callable[[TraceEvent], None] | None = None,
        load_timeout_s: float | None = None,
        load_now: LoadNowFn | None = None,
        compute_apart: Callable[[int, int], Callable[[], None]] | None = None,
    ) -> Trace:
        """Hand one restore to the scheduler and wait for it; returns its trace. Its loads run as tasks
        under the scheduler's grants (`load_now` is not used; nor is `compute_apart`: a batch step does
        not race its units against fetches)."""
        if policy.axis != "tokens":
            raise InvalidInputError(
                f"BatchEngine schedules restores along tokens; {policy!r} works along {policy.axis} "
                "(use TokenTwoPointer, ComputeOnly or LoadOnly)"
            )
        kind = "restore" if any(progress.stored) else "prefill"
        return await self._submit(kind, progress, policy, compute, load, on_event, load_timeout_s)

    async def compute(self, fn: Callable[..., object], *args: object) -> object:
        """Blocking model work (a decode step) as the scheduler's highest-priority class."""
        out: list[object] = []

        def unit(a: int, b: int) -> None:
            out.append(fn(*args))

        await self._submit("decode", Progress([1], [False]), ComputeOnly(), unit, _no_load, None, None)
        return out[0]

    async def _submit(
        self,
        kind: str,
        progress: Progress,
        policy: Policy,
        compute: ComputeFn,
        load: LoadFn,
        on_event: Callable[[TraceEvent], None] | None,
        load_timeout_s: float | None,
    ) -> Trace:
        if self._stack is None:
            raise EngineNotRunningError(
                "BatchEngine is not running: enter it first (`async with engine:`) for the lifetime of the "
                "process that restores with it"
            )
        costs, past = [], 0
        for n in progress.chunk_tokens:
            costs.append(self.cost.seconds(n, past))
            past += n
        job = BatchJob(next(self._ids), kind, progress, policy, self._now(), costs)
        self.scheduler.check(job)
        live = _Live(job, compute, load, on_event, load_timeout_s)
        if progress.finished:
            return live.trace
        self._live[job.id] = live
        self._send.send_nowait(("kick",))
        try:
            await live.done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                live.cancelled = True
                self._send.send_nowait(("cancel", job.id))
                await live.done.wait()  # set once none of its units is still running
            raise
        if live.error is not None:
            raise live.error
        return live.trace

    # -- the driver ----------------------------------------------------------------------------------

    async def _drive(self, tg: TaskGroup, receive: Any) -> None:
        while True:
            try:
                wake = self._schedule(tg)
            except Exception as exc:  # a scheduler or policy broke a rule: fail the restores, not the engine
                for live in list(self._live.values()):
                    if live.active:
                        live.error = exc
                        for scope, _ in live.loads.values():
                            scope.cancel()
                        self._retire(live)
                wake = None
            timeout = math.inf if wake is None else max(0.0, wake - self._now())
            with anyio.move_on_after(timeout):
                self._handle(await receive.receive())
            while True:
                try:
                    self._handle(receive.receive_nowait())
                except anyio.WouldBlock:
                    break

    def _loads_in_flight(self) -> int:
        """Loads started and not yet reported (a retired job has none: it retires once idle)."""
        return sum(len(live.loads) for live in self._live.values())

    def _active(self) -> list[BatchJob]:
        return [live.job for live in self._live.values() if live.active]

    def _schedule(self, tg: TaskGroup) -> float | None:
        """Start what the scheduler picks; returns when to look again (None: when something reports)."""
        now = self._now()
        jobs = {j.id: j for j in self._active()}
        wake = math.inf
        if not self._computing and jobs:
            step = self.scheduler.compute_step(list(jobs.values()), now)
            note_step(jobs, step)
            stopped = {}
            for j, i in step.drops:
                scope, event = self._live[j].loads[i]
                scope.cancel()
                stopped[(j, i)] = event
            begin_step(jobs, step)
            if step.units:
                self._computing = True
                for u in step.units:
                    self._live[u.job].busy += 1
                tg.start_soon(self._run_step, step, stopped)
            wake = min(wake, step.wake_at if step.wake_at is not None else math.inf)
        free = self.load_lanes - self._loads_in_flight()
        if free > 0 and jobs:
            grant = self.scheduler.load_grants(list(jobs.values()), free, now)
            begin_loads(jobs, grant)
            for j, i in grant.loads:
                live = self._live[j]
                live.loads[i] = (anyio.CancelScope(), anyio.Event())
                live.busy += 1
                tg.start_soon(self._load, live, i)
            wake = min(wake, grant.wake_at if grant.wake_at is not None else math.inf)
        if wake == math.inf and not self._computing and self._loads_in_flight() == 0:
            for live in list(self._live.values()):
                if live.active:  # nothing runs and nobody asked to be woken: it can never finish
                    live.error = PolicyStalledError(
                        f"{live.job.policy!r} under {self.scheduler!r} left chunks {live.job.progress.pending()}"
                        " with no unit running"
                    )
                    self._retire(live)
        return None if wake == math.inf else wake

    async def _run_step(self, step: ComputeStep, stopped: dict[tuple[int, int], anyio.Event]) -> None:
        try:
            for u in step.units:
                live = self._live.get(u.job)
                if live is None or not live.active:
                    self._send.send_nowait(("skipped", u.job))
                    continue
                for (j, i), event in stopped.items():  # a dropped load may be writing these rows
                    if j == u.job and u.a <= i < u.b:
                        await event.wait()
                t0 = live.job.arrival_s
                start = self._now()
                try:
                    await anyio.to_thread.run_sync(live.compute, u.a, u.b, abandon_on_cancel=False)
                except Exception as exc:  # the unit's own error fails its restore only
                    self._send.send_nowait(("failed", u.job, exc))
                    continue
                event = TraceEvent("compute", u.a, u.b - 1, start - t0, self._now() - t0)
                self._send.send_nowait(("event", u.job, event))
        finally:
            self._send.send_nowait(("step-done",))

    async def _load(self, live: _Live, i: int) -> None:
        scope, stopped = live.loads[i]
        t0 = live.job.arrival_s

        def now() -> float:  # the job's own clock
            return self._now() - t0

        start = now()
        event: TraceEvent | None = None
        try:
            with scope:
                event = await timed_load(live.load, i, live.load_timeout_s, now)
            if scope.cancel_called or event is None:  # dropped: whatever it read is not applied
                event = TraceEvent("load-dropped", i, i, start, now())
            self._send.send_nowait(("event", live.job.id, event))
        except BaseException as exc:
            self._send.send_nowait(("failed", live.job.id, exc))
            raise
        finally:
            stopped.set()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step-done":
            self._computing = False
            return
        if kind == "kick":
            return
        live = self._live.get(msg[1])
        if live is None:
            return
        if kind == "cancel":
            for scope, _ in live.loads.values():
                scope.cancel()
            self._retire(live)
            return
        live.busy -= 1
        if kind == "skipped":
            self._retire(live)
            return
        if kind == "failed":
            live.error = live.error or msg[2]
            for scope, _ in live.loads.values():
                scope.cancel()
            self._retire(live)
            return
        event: TraceEvent = msg[2]
        if event.kind != "compute":
            live.loads.pop(event.first_chunk, None)
        if not live.active:
            self._retire(live)
            return
        apply_event(live.job.progress, event)
        live.trace.add(event)
        if live.on_event is not None:
            live.on_event(event)
        if live.job.progress.finished:
            live.done.set()
            self._retire(live)

    def _retire(self, live: _Live) -> None:
        """Forget a job that finished, failed or was cancelled once none of its units runs any more."""
        if live.busy > 0:
            return
        self._live.pop(live.job.id, None)
        live.done.set()


async def _no_load(i: int) -> int:  # pragma: no cover - a decode step has nothing stored
    raise AssertionError("a decode step has nothing to load")
