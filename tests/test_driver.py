"""The one driver loop: the same rules, and the same errors, on a real and on a simulated clock."""

from __future__ import annotations

import anyio
import pytest

from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.costs.compute import ChunkCost
from kvrestore.policies import Decision, Policy, Progress, TokenTwoPointer
from kvrestore.policies.base import Estimates, next_compute_run
from kvrestore.policies.batch import BatchAware
from kvrestore.runtime.bookkeeping import PolicyError
from kvrestore.runtime.driver import PolicyStalledError, run_sync
from kvrestore.runtime.engine import Engine
from kvrestore.runtime.request import RunRequest
from kvrestore.sim.batch import sim_requests, simulate_batch, simulate_independent
from kvrestore.sim.simulate import simulate
from kvrestore.sim.workload import Request

COST = ChunkCost(fixed_s=0.002, per_token_s=1e-4, per_token_past_s=2e-7, per_token2_s=1e-8)


class Lazy(Policy):
    """Starts nothing and asks to be woken by nothing: a restore that can never finish."""

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        return Decision()


class OneByOne(Policy):
    """Computes one chunk at a time."""

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        return Decision(compute=next_compute_run(progress, max_chunks=1))


def _link() -> Link:
    return Link(BandwidthTrace.constant(1e6))


def test_a_stalled_policy_fails_alike_on_every_clock():
    with pytest.raises(PolicyStalledError):
        anyio.run(lambda: Engine().run(RunRequest(Progress([1], [False]), Lazy(), lambda a, b: None, None)))
    with pytest.raises(PolicyStalledError, match="left chunks"):
        simulate(Lazy(), [16] * 3, [True] * 3, lambda a, b, t: 0.01, [100] * 3, _link())
    reqs = sim_requests([Request(0.0, "restore", 512, 16)], COST, 1000, 256, Lazy)
    with pytest.raises(PolicyStalledError):
        simulate_independent(reqs, _link())
    with pytest.raises(PolicyStalledError):
        simulate_batch(BatchAware(), reqs, _link())


def test_a_step_limit_bounds_a_simulation():
    with pytest.raises(PolicyError, match="within 2 steps"):
        simulate(OneByOne(), [16] * 8, [False] * 8, lambda a, b, t: 0.01, [100] * 8, _link(), max_steps=2)
    reqs = sim_requests([Request(0.0, "restore", 2048, 16)], COST, 1000, 256, TokenTwoPointer)
    with pytest.raises(PolicyError, match="within 3 steps"):
        simulate_batch(BatchAware(), reqs, _link(), max_steps=3)


def test_run_sync_refuses_a_coroutine_that_suspends():
    class Yield:
        def __await__(self):
            yield  # what an event loop's sleep does

    async def suspends() -> None:
        await Yield()

    with pytest.raises(RuntimeError, match="suspended"):
        run_sync(suspends())


def test_independent_restores_keep_their_own_clocks():
    """Each request's trace starts at 0 on its own clock, whenever it arrived."""
    workload = [Request(0.0, "restore", 1024, 16), Request(0.5, "prefill", 0, 300)]
    res = simulate_independent(sim_requests(workload, COST, 1000, 256, TokenTwoPointer), _link())
    for trace, ttft in zip(res.traces, res.ttft_s, strict=True):
        assert min(e.start_s for e in trace.events) == 0.0
        assert max(e.end_s for e in trace.events) == pytest.approx(ttft)
