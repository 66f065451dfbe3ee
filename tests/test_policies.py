"""ComputeOnly and LoadOnly decisions, driven without a model, plus the engine's invariants."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore.core.errors import CorruptChunkError
from kvrestore.policies import ChunkStatus, ComputeOnly, Decision, LoadOnly, Policy, Progress
from kvrestore.runtime.engine import Engine, PolicyStalledError
from kvrestore.runtime.request import RunRequest

from .conftest import ask


def simulate(policy: Policy, stored: list[bool], broken: set[int], lanes: int = 3):
    """Run the real engine with instant fake units; return (applied units, progress)."""
    applied: list[tuple[str, int]] = []
    progress = Progress([8] * len(stored), list(stored))

    def compute(a: int, b: int) -> None:
        # a compute unit may only start once every chunk before it is in place
        assert all(progress.status[j].done for j in range(a))
        applied.extend(("compute", j) for j in range(a, b))

    async def load(i: int) -> int:
        await anyio.sleep(0)
        if i in broken:
            raise CorruptChunkError("broken on purpose")
        applied.append(("load", i))
        return 100

    anyio.run(lambda: Engine(lanes).run(RunRequest(progress, policy, compute, load)))
    return applied, progress


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=24), st.data(), st.integers(1, 4))
def test_every_chunk_applied_exactly_once(stored, data, lanes):
    broken = set(data.draw(st.sets(st.sampled_from([i for i, s in enumerate(stored) if s] or [-1]))))
    for policy in (ComputeOnly(), ComputeOnly(unit_chunks=2), LoadOnly()):
        applied, progress = simulate(policy, stored, broken, lanes)
        chunks = sorted(j for _, j in applied)
        assert chunks == list(range(len(stored)))  # each chunk once, none missing
        assert progress.finished
        if isinstance(policy, ComputeOnly):
            assert all(kind == "compute" for kind, _ in applied)
        else:
            loaded = {j for kind, j in applied if kind == "load"}
            assert loaded == {i for i, s in enumerate(stored) if s} - broken


def test_compute_only_is_one_unit_by_default():
    p = Progress([4] * 5, [True] * 5)
    assert ask(ComputeOnly(), p) == Decision(compute=(0, 5))
    assert ask(ComputeOnly(unit_chunks=2), p) == Decision(compute=(0, 2))
    with pytest.raises(ValueError):
        ComputeOnly(unit_chunks=0)


def test_load_only_waits_for_a_loadable_chunk_instead_of_computing_it():
    p = Progress([4] * 3, [True, False, True])
    p.free_load_lanes = 1
    d = ask(LoadOnly(), p)
    assert d.loads == (0,) and d.compute is None
    p.status[0] = ChunkStatus.LOADED
    p.free_load_lanes = 0
    d = ask(LoadOnly(), p)
    assert d.compute == (1, 2)  # the miss, stopping before the stored chunk 2


def test_engine_refuses_a_policy_that_stalls():
    class Lazy(Policy):
        def decide(self, progress, estimates):
            return Decision()

    with pytest.raises(PolicyStalledError):
        anyio.run(lambda: Engine().run(RunRequest(Progress([1], [False]), Lazy(), lambda a, b: None, None)))


def test_engine_refuses_compute_without_prefix():
    class Skipper(Policy):
        def decide(self, progress, estimates):
            return Decision(compute=(1, 2))

    with pytest.raises(RuntimeError, match="needs every chunk before"):
        request = RunRequest(Progress([1, 1], [False, False]), Skipper(), lambda a, b: None, None)
        anyio.run(lambda: Engine().run(request))


def test_two_pointer_units_respect_the_lanes_floor():
    """A lane whose small units are launch-bound (a GPU) sets `min_unit_chunks`: the first unit and every
    unit away from the meeting covers at least that many chunks; near the meeting units still shrink."""
    from kvrestore.policies import TokenTwoPointer

    p = Progress([256] * 32, [False] * 4 + [True] * 28)
    p.lanes.min_unit_chunks = 8
    p.free_load_lanes = 4
    first = ask(TokenTwoPointer(), p)
    assert first.compute == (0, 8)  # not 1 chunk to measure with, nor the policy's 2
    assert Progress([256] * 4, [True] * 4).lanes.min_unit_chunks == 1  # the default floor changes nothing
    q = Progress([256] * 32, [False] * 32)  # nothing stored: compute runs alone, in floor-sized units
    q.lanes.min_unit_chunks = 8
    assert ask(TokenTwoPointer(compute_chunks=2), q).compute == (0, 8)
