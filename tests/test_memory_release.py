"""A restore's memory goes back as soon as the caller drops its result, not at the next cyclic GC.

The KV of a long prompt is hundreds of MB. Held by a reference cycle (a decider keeping itself in a
tuple, a reader and its upload path pointing at each other, an idle lane thread keeping its last job)
it stays allocated until Python's cyclic collector happens to run: several restores' KV pile up, every
restore pays page faults on fresh memory, and a collection inside a restore frees them on its clock.

The policies here decide the same whatever the timings (no race, no unit overtaken: a cancelled task's
exception holds its frames in a cycle of asyncio's own), so each run takes the same path.
"""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from kvrestore import ComputeOnly, LoadOnly, Restorer
from kvrestore.policies import Decision, Policy, Progress
from kvrestore.policies.base import Estimates, next_compute_run
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .test_kv_encoding import ComputeFirstLayer
from .waiting import wait_until


class FrontComputed(Policy):
    """Along tokens: the first half of the chunks computed in one unit, the rest loaded."""

    name = "front-computed"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        half = progress.n_chunks // 2
        loads = tuple(i for i in progress.pending() if i >= half)[: progress.free_load_lanes]
        run = next_compute_run(progress, max_chunks=half)
        return Decision(compute=run if run is not None and run[1] <= half else None, loads=loads)


#: along layers, ComputeFirstLayer: layer 0 computed, every other layer loaded (a `LayerReader` reads them)
POLICIES = [LoadOnly, ComputeOnly, FrontComputed, ComputeFirstLayer]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
def test_a_restore_leaves_no_reference_cycle(llama_backend, policy):
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=3)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32, learn=False, profile=False)
        await r.save(tokens)
        await r.restore(tokens, policy())  # warm: lane threads started
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            result = await r.restore(tokens, policy())
            assert result.stats.loaded_chunks + result.stats.loaded_layers > 0 or policy is ComputeOnly
            kv = weakref.ref(result.kv)
            del result
            gc.collect()
            cyclic = sorted({type(o).__name__ for o in gc.garbage})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert cyclic == []
        # nothing else keeps it either: a lane thread drops its last job before it waits for another
        await wait_until(lambda: kv() is None)

    anyio.run(main)
