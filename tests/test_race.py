"""The contested chunk: a compute unit races its fetch, the first to finish wins, and the chunk is
applied once. A one-chunk restore is never slower than the faster of computing and loading it."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import Restorer, TokenTwoPointer
from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.policies import ComputeOnly, Decision, LoadOnly, Progress
from kvrestore.runtime.bookkeeping import PolicyError, apply_event, begin
from kvrestore.sim.simulate import simulate
from kvrestore.stores import ThrottledStore
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .test_overtake import HeldCompute
from .test_two_pointer import ATOL, full_prefill


def _sim(policy, n_chunks: int, compute_s: float, load_s: float):
    link = Link(BandwidthTrace.constant(1.0 / load_s))  # one chunk is one byte: a fetch takes load_s
    return simulate(
        policy,
        [256] * n_chunks,
        [True] * n_chunks,
        lambda a, b, _t: (b - a) * compute_s,
        [1] * n_chunks,
        link,
    )


@settings(max_examples=60, deadline=None)
@given(compute_s=st.floats(0.01, 1.0), load_s=st.floats(0.01, 1.0))
def test_a_one_chunk_restore_takes_the_faster_of_its_two_ways(compute_s, load_s):
    res = _sim(TokenTwoPointer(), 1, compute_s, load_s)
    alone = min(
        _sim(ComputeOnly(), 1, compute_s, load_s).makespan, _sim(LoadOnly(), 1, compute_s, load_s).makespan
    )
    assert res.makespan == pytest.approx(alone)
    kinds = sorted(e.kind for e in res.trace.events)
    assert kinds in (["compute", "load-dropped"], ["compute-dropped", "load"])  # applied once


@settings(max_examples=60, deadline=None)
@given(n_chunks=st.integers(2, 12), compute_s=st.floats(0.01, 1.0), load_s=st.floats(0.01, 1.0))
def test_racing_never_applies_a_chunk_twice(n_chunks, compute_s, load_s):
    res = _sim(TokenTwoPointer(), n_chunks, compute_s, load_s)
    done = res.trace.loaded() + res.trace.computed()
    assert sorted(done) == list(range(n_chunks))
    # a fetch is waited for at most a tenth of a chunk's compute past its estimated landing
    assert res.makespan <= (n_chunks + 0.1) * compute_s * 1.0001


def test_only_a_driver_that_can_race_takes_a_race():
    p = Progress([256], [True])
    race = Decision(compute=(0, 1), loads=(0,), race=True)
    with pytest.raises(PolicyError, match="cannot race"):
        begin(p, race)
    p = Progress([256, 256], [True, True])
    p.lanes.can_race = True
    with pytest.raises(PolicyError, match="one chunk"):
        begin(p, Decision(compute=(0, 2), loads=(0, 1), race=True))
    p = Progress([256], [True])
    p.lanes.can_race = True
    begin(p, race)
    assert p.running.racing == 0 and p.compute_busy and p.loads_in_flight == 1
    trace = Trace([TraceEvent("load", 0, 0, 0.0, 1.0, 10), TraceEvent("compute-dropped", 0, 0, 0.0, 1.1)])
    apply_event(p, trace.events[0])  # the fetch won
    assert p.finished and p.compute_busy  # the compute unit still has to stop
    apply_event(p, trace.events[1])
    assert not p.compute_busy and p.running.racing is None and trace.bytes_loaded() == 10


@pytest.mark.parametrize("fast", [True, False])
def test_a_raced_chunk_is_exact_whichever_wins(llama_backend, fast):
    """One chunk whose compute never ends until it is stopped (the fetch from memory wins, whatever
    the machine's speed), and one through a store that takes about 20 s to deliver it, against a tiny
    model's milliseconds (computing wins)."""
    tokens = random_tokens(48, llama_backend.spec.vocab_size)
    held = HeldCompute(llama_backend)  # never released: only the fetch can end the race

    async def main():
        inner = MemoryStore()
        await Restorer(llama_backend, inner, chunk_size=64, learn=False).save(tokens)
        store = inner if fast else ThrottledStore(inner, 2_000.0)  # a ~20 s fetch: computing wins
        r = Restorer(held if fast else llama_backend, store, chunk_size=64, learn=False)
        with anyio.fail_after(10):  # a lost fetch is stopped, not waited for
            return await r.restore(tokens, TokenTwoPointer())

    try:
        res = anyio.run(main)
    finally:
        held.release.set()  # (a unit that lost the race has stopped; this frees any that did not start)
    kinds = sorted(e.kind for e in res.trace.events)
    if fast:
        assert "load" in kinds and "compute" not in kinds and res.stats.loaded_chunks == 1
    else:
        assert kinds == ["compute", "load-dropped"] and res.stats.computed_chunks == 1
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)
