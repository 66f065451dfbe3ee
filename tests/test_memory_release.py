"""A restore's memory goes back as soon as the caller drops its result, not at the next cyclic GC.

The KV of a long prompt is hundreds of MB. Held by a reference cycle (a decider keeping itself in a
tuple, a reader and its upload path pointing at each other, an idle lane thread keeping its last job)
it stays allocated until Python's cyclic collector happens to run: several restores' KV pile up, every
restore pays page faults on fresh memory, and a collection inside a restore frees them on its clock.
"""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from kvrestore import Auto, ComputeOnly, LayerTwoPointer, LoadOnly, Restorer, TokenTwoPointer
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .waiting import wait_until

POLICIES = [LoadOnly, TokenTwoPointer, LayerTwoPointer, ComputeOnly, Auto]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
def test_a_restore_leaves_no_reference_cycle(llama_backend, policy):
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=3)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32, learn=False, profile=False)
        await r.save(tokens[:160])  # part stored: both lanes have work
        await r.restore(tokens, policy())  # warm: lane threads started, costs seen
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            result = await r.restore(tokens, policy())
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
