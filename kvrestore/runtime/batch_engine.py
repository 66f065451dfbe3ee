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
waits; the driver (`driver.drive_batch`, the very loop `simulate_batch` runs on a simulated clock) asks
the scheduler, starts units on this engine's lanes (`_Lanes`) and applies their results. Restores along
either axis are scheduled: a layer-wise restore's units are layers, priced as shares of a prefill. Decode steps
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from kvrestore.core.errors import InvalidInputError, UsageError
from kvrestore.core.settings import check_instance
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.estimates import Estimates
from kvrestore.policies.base import Progress
from kvrestore.policies.batch import BatchAware, BatchJob, BatchScheduler, ComputeStep, LoadGrant
from kvrestore.policies.compute_only import ComputeOnly
from kvrestore.runtime.driver import drive_batch
from kvrestore.runtime.engine import Engine
from kvrestore.runtime.lanes import timed_load
from kvrestore.runtime.request import RunRequest

#: ranks chunks when no profile is given: tokens, each costing more the further along the prompt
#: (SmolLM2 on CPU: a token after 512 others costs about twice one at the start)
DEFAULT_COST = ChunkCost(fixed_s=0.0, per_token_s=1.0, per_token_past_s=1.0 / 512)


class EngineNotRunningError(UsageError):
    """A restore was handed to a `BatchEngine` that has not been entered (`async with engine:`), or was
    closed; a `UsageError` (a `KVRestoreError` and a `RuntimeError`)."""


@dataclass(eq=False)
class _Live:
    """A job and the request whose units the driver runs for it."""

    job: BatchJob
    request: RunRequest
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
    takes_fast_paths = False

    def __init__(
        self,
        scheduler: BatchScheduler | None = None,
        load_lanes: int = 4,
        cost: ChunkCost | None = None,
    ) -> None:
        super().__init__(load_lanes)
        if scheduler is not None:
            check_instance(
                "scheduler", scheduler, BatchScheduler, "a BatchScheduler (BatchAware(), FifoLanes()) or None"
            )
        if cost is not None:
            check_instance("cost", cost, ChunkCost, "a ChunkCost or None")
        self.scheduler = scheduler if scheduler is not None else BatchAware()
        self.cost = cost or DEFAULT_COST
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count()
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._send: Any = None
        self._t0 = time.perf_counter()

    def __repr__(self) -> str:
        return f"BatchEngine({self.scheduler!r}, load_lanes={self.load_lanes})"

    # -- lifetime ------------------------------------------------------------------------------------

    async def __aenter__(self) -> BatchEngine:
        if self._stack is not None:
            raise RuntimeError("this BatchEngine is already running")
        stack = contextlib.AsyncExitStack()
        self._send, receive = anyio.create_memory_object_stream[tuple](math.inf)
        stack.callback(receive.close)  # closed once the task group below has ended (the stack unwinds
        stack.callback(self._send.close)  # in reverse): no task is left to use them
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        self._tg.start_soon(drive_batch, self.scheduler, _Lanes(self, self._tg, receive))
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop the driver; restores still waiting fail with `EngineNotRunningError`."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        for live in list(self._live.values()):
            live.error = live.error or EngineNotRunningError("the BatchEngine was closed during the restore")
            live.done.set()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        await stack.aclose()  # waits for compute units already in their thread
        self._live.clear()

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # -- what restores call --------------------------------------------------------------------------

    async def run(self, request: RunRequest) -> Trace:
        """Hand one restore to the scheduler and wait for it; returns its trace. Its loads run as tasks
        under the scheduler's grants. A layer-axis restore (`LayerTwoPointer`) is scheduled like any
        other: its units are layers, each priced as its share of a prefill of the prefix. Raises
        InvalidInputError for a request with `fast_paths`: a batch step neither runs loads on lane
        threads, nor races its units against fetches, nor lets fetches overtake them."""
        if request.fast_paths is not None:
            raise InvalidInputError(
                "a BatchEngine runs no fast paths (lane-thread loads, races, fetches aside): "
                "hand it a RunRequest without `fast_paths` (see `Engine.takes_fast_paths`)"
            )
        kind = "restore" if any(request.progress.stored) else "prefill"
        return await self._submit(kind, request)

    async def compute(self, fn: Callable[..., object], *args: object) -> object:
        """Blocking model work (a decode step) as the scheduler's highest-priority class."""
        out: list[object] = []

        def unit(a: int, b: int) -> None:
            out.append(fn(*args))

        await self._submit("decode", RunRequest(Progress([1], [False]), ComputeOnly(), unit, _no_load))
        return out[0]

    def _unit_costs(self, progress: Progress, axis: str) -> tuple[list[float], list[int]]:
        """Each unit's compute cost and what it spends of a step's token budget.

        Along tokens a unit is a chunk: its own tokens, attending to every token before it. Along layers
        a unit is one layer over the whole prefix (`Progress.chunk_tokens` holds the prefix's length
        for each): 1/L of a prefill of the prefix, so it spends about prefix/L tokens of the budget and
        a prompt longer than the budget still fits one layer per step."""
        if axis == "layers":
            n_layers = progress.n_chunks
            prefix = progress.chunk_tokens[0] if n_layers else 0
            share = -(-prefix // max(1, n_layers))
            return [self.cost.seconds(prefix, 0) / n_layers] * n_layers, [share] * n_layers
        costs, past = [], 0
        for n in progress.chunk_tokens:
            costs.append(self.cost.seconds(n, past))
            past += n
        return costs, list(progress.chunk_tokens)

    async def _submit(self, kind: str, request: RunRequest) -> Trace:
        if self._stack is None:
            raise EngineNotRunningError(
                "BatchEngine is not running: enter it first (`async with engine:`) for the lifetime of the "
                "process that restores with it"
            )
        progress = request.progress
        costs, tokens = self._unit_costs(progress, request.policy.axis)
        job = BatchJob(next(self._ids), kind, progress, request.policy, self._now(), costs, tokens, Estimates)
        self.scheduler.check(job)
        live = _Live(job, request)
        if progress.finished:
            return live.trace
        self._live[job.id] = live
        self._send.send_nowait(("kick",))
        try:
            await live.done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                live.cancelled = True
                with contextlib.suppress(anyio.ClosedResourceError):  # the engine has closed meanwhile
                    self._send.send_nowait(("cancel", job.id))
                await live.done.wait()  # set once none of its units is still running
            raise
        if live.error is not None:
            raise live.error
        return live.trace


class _Lanes:
    """The engine's lanes as the batch driver sees them (`driver.BatchLanes` on a real clock)."""

    def __init__(self, engine: BatchEngine, tg: TaskGroup, receive: Any) -> None:
        self.engine, self.tg, self.receive = engine, tg, receive
        self.live = engine._live
        self.load_lanes = engine.load_lanes
        self.computing = False
        self.stopped: dict[tuple[int, int], anyio.Event] = {}  # dropped loads the next step waits for

    def now(self) -> float:
        return self.engine._now()

    def jobs(self) -> dict[int, BatchJob]:
        return {j: live.job for j, live in self.live.items() if live.active}

    def loads_in_flight(self) -> int:
        """Loads started and not yet reported (a retired job has none: it retires once idle)."""
        return sum(len(live.loads) for live in self.live.values())

    def busy(self) -> bool:
        return self.computing or self.loads_in_flight() > 0

    def stop(self, drops: Sequence[tuple[int, int]]) -> None:
        for j, i in drops:
            scope, event = self.live[j].loads[i]
            scope.cancel()
            self.stopped[(j, i)] = event

    def start_step(self, step: ComputeStep) -> None:
        self.computing = True
        for u in step.units:
            self.live[u.job].busy += 1
        self.tg.start_soon(self._run_step, step, self.stopped)
        self.stopped = {}

    def start_loads(self, grant: LoadGrant) -> None:
        for j, i in grant.loads:
            live = self.live[j]
            live.loads[i] = (anyio.CancelScope(), anyio.Event())
            live.busy += 1
            self.tg.start_soon(self._load, live, i)

    def fail(self, jobs: Sequence[BatchJob], error: Exception) -> None:
        for job in jobs:
            live = self.live[job.id]
            if live.active:
                live.error = error
                for scope, _ in live.loads.values():
                    scope.cancel()
                self._retire(live)

    async def wait(self, wake_at: float | None) -> list[tuple[BatchJob, TraceEvent]]:
        out: list[tuple[BatchJob, TraceEvent]] = []
        timeout = math.inf if wake_at is None else max(0.0, wake_at - self.now())
        with anyio.move_on_after(timeout):
            self._handle(await self.receive.receive(), out)
        while True:
            try:
                self._handle(self.receive.receive_nowait(), out)
            except anyio.WouldBlock:
                return out

    def record(self, job: BatchJob, event: TraceEvent) -> None:
        live = self.live.get(job.id)
        if live is None:
            return
        live.trace.add(event)
        if live.request.on_event is not None:
            live.request.on_event(event)
        if job.progress.finished:
            live.done.set()
            self._retire(live)

    async def _run_step(self, step: ComputeStep, stopped: dict[tuple[int, int], anyio.Event]) -> None:
        send = self.engine._send
        try:
            for u in step.units:
                live = self.live.get(u.job)
                if live is None or not live.active:
                    send.send_nowait(("skipped", u.job))
                    continue
                for (j, i), event in stopped.items():  # a dropped load may be writing these rows
                    if j == u.job and u.a <= i < u.b:
                        await event.wait()
                t0 = live.job.arrival_s
                start = self.now()
                try:
                    await anyio.to_thread.run_sync(live.request.compute, u.a, u.b, abandon_on_cancel=False)
                except Exception as exc:  # the unit's own error fails its restore only
                    send.send_nowait(("failed", u.job, exc))
                    continue
                done = TraceEvent("compute", u.a, u.b - 1, start - t0, self.now() - t0)
                send.send_nowait(("event", u.job, done))
        finally:
            send.send_nowait(("step-done",))

    async def _load(self, live: _Live, i: int) -> None:
        scope, stopped = live.loads[i]
        t0, send = live.job.arrival_s, self.engine._send

        def now() -> float:  # the job's own clock
            return self.now() - t0

        start = now()
        event: TraceEvent | None = None
        try:
            with scope:
                request = live.request
                event = await timed_load(
                    request.load, i, request.load_timeout_s, now, timed_out=request.timed_out
                )
            if scope.cancel_called or event is None:  # dropped: whatever it read is not applied
                event = TraceEvent("load-dropped", i, i, start, now())
            send.send_nowait(("event", live.job.id, event))
        except BaseException as exc:
            send.send_nowait(("failed", live.job.id, exc))
            raise
        finally:
            stopped.set()

    def _handle(self, msg: tuple, out: list[tuple[BatchJob, TraceEvent]]) -> None:
        """Take one message from the units; a finished unit of a live job goes to `out` to apply."""
        kind = msg[0]
        if kind == "step-done":
            self.computing = False
            return
        if kind == "kick":
            return
        live = self.live.get(msg[1])
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
        out.append((live.job, event))

    def _retire(self, live: _Live) -> None:
        """Forget a job that finished, failed or was cancelled once none of its units runs any more."""
        if live.busy > 0:
            return
        self.live.pop(live.job.id, None)
        live.done.set()


async def _no_load(i: int) -> int:  # pragma: no cover - a decode step has nothing stored
    raise AssertionError("a decode step has nothing to load")
