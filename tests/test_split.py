"""The pipelined split of a stored prefix (`planning.split`), as vLLM's connector plans with it, and
CacheFlow's batch rule in it and in the link's order (`policies.batch`): a split counts what the lanes
hold before it, and the link serves the load that saves the most compute per byte first. Pure functions
over bytes and costs: no engine, no clock."""

from __future__ import annotations

import pytest
import torch

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.spec import ModelSpec
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.learned import CostLearner, loading_factor
from kvrestore.costs.links import LinkCost
from kvrestore.planning.split import choose_split, max_loadable
from kvrestore.policies.batch import QueuedLoad, link_order

KV_PER_TOKEN = 46_080  # SmolLM2-135M, fp32
ENDS = [256 * (i + 1) for i in range(7)] + [2000]  # a stored 2,000-token prompt in 256-token chunks
COMPUTE = ChunkCost.per_pair(0.0, 2.5e-3, 1.0e-6)  # ~5 s for 2,000 tokens from scratch
SPEC = ModelSpec("m", 30, 3, 64, 100, torch.float32, "s" * 32)


def _split(
    link: LinkCost | None,
    compute: ChunkCost | None = COMPUTE,
    mode: str = "planned",
    ends=ENDS,
    loading: float | None = None,
    **queued: float,
):
    return choose_split(
        n_tokens=2000,
        chunk_ends=ends,
        chunk_size=256,
        block_size=128,
        bytes_per_token=KV_PER_TOKEN,
        num_layers=30,
        link=link,
        compute=compute,
        loading=loading,
        mode=mode,
        **queued,
    )


def test_the_split_is_block_aligned_leaves_a_token_to_compute_and_stays_in_the_stored_prefix():
    assert max_loadable(2000, 2000, 128) == 1920
    assert max_loadable(2048, 2048, 128) == 1920  # the last token is always computed
    assert max_loadable(2000, 700, 128) == 640
    assert _split(None).k == 1920  # no costs measured yet: load what is stored
    assert "no measured cost of the link" in _split(None).reason
    assert _split(LinkCost(1e12), mode="compute_all").k == 0
    assert _split(LinkCost(1e3), mode="load_all").k == 1920
    assert _split(LinkCost(1e9), ends=ENDS[:3]).k == 768
    assert _split(LinkCost(1e9), ends=[]).k == 0


def test_the_planned_split_follows_the_link():
    fast, slow = _split(LinkCost(1e12)), _split(LinkCost(1e5))
    assert fast.k == 1920 and slow.k == 0
    balance_bw = 2000 * KV_PER_TOKEN / COMPUTE.seconds(2000)  # loading all = computing all
    mid = _split(LinkCost(balance_bw))
    assert 0 < mid.k < 1920 and mid.k % 256 == 0
    assert mid.predicted_s < 0.8 * min(mid.load_all_s, mid.compute_all_s)
    assert abs(mid.load_s - mid.compute_s) < 0.25 * mid.predicted_s  # they finish nearly together
    assert "predicted" in mid.explain() and str(mid.k) in mid.explain()
    with pytest.raises(InvalidInputError):
        _split(LinkCost(1e9), mode="half")


def test_how_much_slower_steps_that_load_compute_is_learned_and_slows_a_split(tmp_path):
    """A step that loaded computed beside the load: how much slower than alone is learned from such
    steps, and a split then predicts its suffix that much slower (compute-all does not change)."""
    L = 30
    compute = ChunkCost.per_pair(0.0, 1e-3, 0.0)  # 1 s for 1,000 tokens
    # computed 1,000 tokens after a past of 1,000 loaded in 0.6 s: 3 s where alone it takes 1 s
    samples = [[1000, 1000, 0.6, 3.0 + 0.6 / L, L], [1000, 500, 0.3, 3.0 + 0.3 / L, L]]
    assert loading_factor(samples, compute) == pytest.approx(3.0)
    # a load-all step (a few tokens computed after the load) says nothing about the compute
    assert loading_factor([[32, 1968, 2.0, 2.05, L]], compute) is None
    # nor does one after a quick load: its step is mostly a step's fixed costs
    assert loading_factor([[32, 3968, 0.1, 0.9, L]], compute) is None
    assert loading_factor([[80, 1920, 0.1, 0.2, L]], ChunkCost.per_pair(0.0, 1e-3, 0.0)) is None
    book = CostLearner(SPEC, path=tmp_path / "c.json")
    assert book.loading_factor() is None  # no compute cost yet
    book.observe_step(2000, 0, 2.0)
    for row in samples:
        book.observe_loading(*row[:4], num_layers=L)  # type: ignore[call-arg]
    book.flush()  # written behind the step; here, for another process to read
    assert CostLearner(SPEC, path=tmp_path / "c.json").loading_factor() == pytest.approx(3.0)
    balance_bw = 2000 * KV_PER_TOKEN / COMPUTE.seconds(2000)
    alone, beside = _split(LinkCost(balance_bw)), _split(LinkCost(balance_bw), loading=3.0)
    assert beside.compute_all_s == alone.compute_all_s
    assert beside.k > alone.k  # computing beside a load is dearer: load more of the prompt
    c = COMPUTE.seconds(2000 - beside.k, beside.k)
    assert beside.compute_s == pytest.approx(3.0 * c)


BALANCE = LinkCost(2000 * KV_PER_TOKEN / COMPUTE.seconds(2000))  # loading all = computing all


def test_a_split_behind_queued_loads_loads_fewer_tokens_than_on_a_free_link():
    free = _split(BALANCE)
    assert 0 < free.k < 1920 and free.bytes_ahead == 0
    first = free.queued("a")
    assert first is not None and first.nbytes == free.nbytes > 0 and first.saved_s == free.saved_s > 0
    behind = _split(BALANCE, bytes_ahead=first.nbytes)  # a second prompt, while the first's load is queued
    assert behind.k < free.k and behind.bytes_ahead == first.nbytes
    assert behind.predicted_s > free.predicted_s  # the wait is predicted, not ignored
    assert f"{first.nbytes / 1e6:.1f} MB queued ahead" in behind.explain()
    third = _split(BALANCE, bytes_ahead=first.nbytes + behind.nbytes)
    assert third.k <= behind.k
    assert _split(BALANCE, bytes_ahead=1e12).k == 0  # a link busy for hours: compute it all
    assert _split(BALANCE, mode="compute_all").queued("a") is None


def test_only_the_link_is_a_queue_a_request_computes_its_own_tokens():
    """Bytes ahead delay the load, never the compute: compute-all is predicted alike on a busy link
    (the engine computes the step's requests together; no compute is owed ahead of a request's)."""
    free = _split(BALANCE)
    busy = _split(BALANCE, bytes_ahead=free.nbytes)
    assert busy.compute_all_s == free.compute_all_s
    assert busy.load_all_s > free.load_all_s
    assert busy.compute_s >= free.compute_s  # it computes more of its prompt, not someone else's
    with pytest.raises(TypeError):
        _split(BALANCE, compute_ahead_s=1.0)  # no such input: compute is not a queue
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidInputError):
            _split(BALANCE, bytes_ahead=bad)


def test_the_modes_keep_their_k_on_a_busy_link():
    assert _split(BALANCE, mode="load_all", bytes_ahead=80e6).k == 1920
    assert _split(BALANCE, mode="compute_all", bytes_ahead=80e6).k == 0


def test_the_link_serves_the_most_compute_saved_per_byte_first():
    a = QueuedLoad("a", 100.0, 1.0)  # 0.01 s per byte
    b = QueuedLoad("b", 100.0, 3.0)  # 0.03
    c = QueuedLoad("c", 50.0, 1.0)  # 0.02
    tie = QueuedLoad("t", 200.0, 2.0)  # 0.01, after `a`, which came first
    assert [q.key for q in link_order([a, b, c, tie])] == ["b", "c", "a", "t"]
    assert QueuedLoad("z", 0.0, 1.0).value == 0.0
    # a far prefix saves more per byte than a near one (attention grows along the prompt)
    far = _split(BALANCE, mode="load_all").queued("far")
    near = _split(BALANCE, mode="load_all", ends=ENDS[:2]).queued("near")
    assert [q.key for q in link_order([near, far])] == ["far", "near"]  # type: ignore[list-item]
