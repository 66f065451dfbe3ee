"""Cancellation is bounded by one layer: a restore cancelled by a deadline stops its compute unit at the
next layer boundary (`kvrestore.core.cancel`) and returns once nothing of it runs."""

from __future__ import annotations

import threading
import time

import anyio
import anyio.to_thread
import pytest
import torch

from kvrestore import ComputeOnly, Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.core.cancel import UnitCancelled, checkpoint, run_unit
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens, tiny_model
from .waiting import wait_until

LAYER_S = 0.08
LAYERS = 12


class SlowLayers(HFBackend):
    """Each decoder layer of every prefill takes at least LAYER_S (the slowness is the subject: a unit long
    enough to be cancelled part-way); counts the layers it ran and those running now."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers_run = 0
        self.in_layer = 0
        self._lock = threading.Lock()

    def _project(self, *args, **kwargs):
        with self._lock:
            self.in_layer += 1
        try:
            time.sleep(LAYER_S)
            with self._lock:
                self.layers_run += 1
            return super()._project(*args, **kwargs)
        finally:
            with self._lock:
                self.in_layer -= 1


@pytest.fixture(scope="module")
def slow_backend() -> SlowLayers:
    return SlowLayers(tiny_model("llama", layers=LAYERS), name="tiny-slow")


@pytest.mark.parametrize("policy", [ComputeOnly(), TokenTwoPointer(compute_chunks=64)])
def test_a_deadline_stops_the_unit_at_the_next_layer(slow_backend, policy):
    """One unit of the whole prompt takes LAYERS x LAYER_S (~1 s); after a 0.2 s deadline it stops at the
    next layer (counted, not timed), no layer runs after the restore returned, and the engine restores
    exactly after."""
    tokens = random_tokens(128, slow_backend.spec.vocab_size)
    deadline = 0.2

    async def main():
        r = Restorer(slow_backend, MemoryStore(), chunk_size=32)
        before = slow_backend.layers_run
        with anyio.move_on_after(deadline) as scope:
            await r.restore(tokens, policy)
        assert scope.cancelled_caught
        ran = slow_backend.layers_run
        assert slow_backend.in_layer == 0  # the restore returned with no layer of its unit running
        res = await r.restore(tokens, ComputeOnly())  # the compute lane is free again and exact
        # nothing of the cancelled unit ran meanwhile: exactly the new restore's layers were added
        units = len(res.trace.of_kind("compute"))
        assert slow_backend.layers_run - ran == units * LAYERS, (slow_backend.layers_run - ran, units)
        return ran - before, res

    layers, res = anyio.run(main)
    # the first unit has all LAYERS layers: run to its end it would count them all; stopped at the next
    # layer after the deadline it counts about deadline / LAYER_S + 1 of them
    assert layers < LAYERS // 2, layers
    full = slow_backend.prefill_chunk(tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=1e-5, rtol=0)


def test_run_unit_returns_the_result_and_raises_the_units_error():
    async def main():
        assert await run_unit(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await run_unit(lambda: 1 / 0)

    anyio.run(main)


def test_checkpoint_outside_a_unit_does_nothing_and_inside_a_cancelled_one_raises():
    checkpoint()  # no unit on this thread
    seen: list[str] = []
    started = threading.Event()

    def unit():
        for _ in range(200):
            try:
                checkpoint()
            except UnitCancelled:
                seen.append("stopped")
                raise
            started.set()
            time.sleep(0.01)
        seen.append("ran to the end")

    async def main():
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await run_unit(unit)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.to_thread.run_sync(started.wait)  # cancelled once it runs, not after a time
            scope.cancel()

    anyio.run(main)
    assert seen == ["stopped"]  # it did not run its 200 steps to the end


def test_a_unit_cancelled_before_its_thread_starts_never_runs_and_does_not_hang():
    """Cancelled while waiting for a worker thread (all of anyio's are busy): it returns at once and the
    unit never runs, even if the thread takes it up later."""
    ran: list[int] = []
    release = threading.Event()

    async def main():
        limiter = anyio.to_thread.current_default_thread_limiter()
        old, limiter.total_tokens = limiter.total_tokens, 1
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, release.wait)  # holds the only worker token
                await wait_until(lambda: limiter.borrowed_tokens == 1)
                with anyio.fail_after(5):
                    with anyio.move_on_after(0.05):  # the cancellation (the subject), while it waits
                        await run_unit(lambda: ran.append(1))
                release.set()
            # the worker is free again: had the cancelled unit been queued for it, it would run now
            await wait_until(lambda: limiter.borrowed_tokens == 0)
            await anyio.to_thread.run_sync(lambda: None)
        finally:
            limiter.total_tokens = old

    anyio.run(main)
    assert ran == []
