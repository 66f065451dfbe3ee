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
from kvrestore.planning.split import Follower, choose_split, choose_split_ahead, max_loadable, pass_end_s
from kvrestore.policies.batch import QueuedLoad, link_order

KV_PER_TOKEN = 46_080  # SmolLM2-135M, fp32
ENDS = [256 * (i + 1) for i in range(7)] + [2000]  # a stored 2,000-token prompt in 256-token chunks
COMPUTE = ChunkCost.per_pair(0.0, 2.5e-3, 1.0e-6)  # ~5 s for 2,000 tokens from scratch
SPEC = ModelSpec("m", 30, 3, 64, 100, torch.float32, "s" * 32)


def _args(
    link: LinkCost | None,
    compute: ChunkCost | None = COMPUTE,
    mode: str = "planned",
    ends=ENDS,
    loading: float | None = None,
    **more,
) -> dict:
    """`choose_split`'s arguments for a stored 2,000-token prompt."""
    return dict(
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
        **more,
    )


def _split(link: LinkCost | None, compute: ChunkCost | None = COMPUTE, **more):
    return choose_split(**_args(link, compute, **more))


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
    # a balanced split's step (lanes planned to end together): its compute ended it, 0.38 s after the
    # load: it computed 1.35 s where alone it takes 1 s (a served run's did so: 1.3x)
    assert loading_factor([[1000, 1000, 1.0, 1.35 + 1.0 / L, L]], compute) == pytest.approx(1.35)
    # the same step ending a layer's compute and its fixed costs after its load: the load ended it
    assert loading_factor([[1000, 1000, 1.0, 1.0 + 1.0 / L + 0.05, L]], compute) is None
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


def test_compute_planned_ahead_in_the_step_moves_the_split_toward_loading():
    """The requests of one scheduling pass share the engine's step: compute planned for those before
    this one is served before the step ends, as bytes queued ahead are."""
    free = _split(BALANCE)
    busy = _split(BALANCE, compute_ahead_s=COMPUTE.seconds(2000))  # another prompt computed whole first
    assert busy.k > free.k and busy.compute_ahead_s == COMPUTE.seconds(2000)
    assert busy.compute_all_s == pytest.approx(2 * COMPUTE.seconds(2000))
    assert "of the step's compute ahead" in busy.explain()
    for bad in ({"compute_ahead_s": -1.0}, {"bytes_ahead": float("nan")}, {"compute_ahead_s": float("inf")}):
        with pytest.raises(InvalidInputError):
            _split(BALANCE, **bad)


def _step_s(choices) -> float:
    """When a step of these splits ends: both lanes pipelined over the model's 30 layers."""
    ld = sum(c.load_s for c in choices)
    cc = sum(c.compute_s for c in choices)
    return max(ld + cc / 30, cc + ld / 30)


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_a_pass_of_alike_requests_ends_its_lanes_together(factor):
    """Three alike prompts planned in one pass, each counting what the ones before it put on both lanes,
    end their step no later than three planned as if alone (which all split alike, leaving a lane
    idle), and no later than loading or computing them all."""
    link = LinkCost(BALANCE.bytes_per_s * factor)
    batch: list = []
    for _ in range(3):
        batch.append(
            _split(
                link,
                bytes_ahead=sum(c.nbytes for c in batch),
                compute_ahead_s=sum(c.compute_s for c in batch),
            )
        )
    alone = [_split(link)] * 3
    assert _step_s(batch) <= _step_s(alone) + 1e-9
    for m in ("load_all", "compute_all"):
        assert _step_s(batch) <= _step_s([_split(link, mode=m)] * 3) + 1e-9
    assert len({c.k for c in batch}) > 1 or _step_s(batch) == pytest.approx(_step_s(alone))


STEP_TOKENS = 2048  # vLLM's token budget: what one step computes at most under chunked prefill


def test_what_a_step_cannot_compute_is_computed_after_it():
    """A step with room for fewer tokens than the suffix computes the rest in the steps after it, once
    this one has ended: the first token comes after both, and a step with room for the whole suffix
    plans as an unbounded one."""
    free = _split(BALANCE)
    assert _split(BALANCE, step_tokens=STEP_TOKENS) == free
    assert free.later_s == 0 and free.step_new_tokens == 2000 - free.k
    tight = _split(BALANCE, step_tokens=100)
    assert tight.step_new_tokens == 100 and tight.later_s > 0
    rest = 2000 - tight.k - 100
    assert tight.later_s == pytest.approx(COMPUTE.seconds(rest, 2000 - rest))
    assert tight.compute_s == pytest.approx(COMPUTE.seconds(100, tight.k))
    step_end = max(tight.load_s + tight.compute_s / 30, tight.compute_s + tight.load_s / 30)
    assert tight.predicted_s == pytest.approx(step_end + tight.later_s)
    assert "computed in later steps" in tight.explain()
    assert _split(BALANCE, step_tokens=0).step_new_tokens == 1  # vLLM asks only while a step has room
    for bad in (-1, 2.5):
        with pytest.raises(InvalidInputError):
            _split(BALANCE, step_tokens=bad)


def _pass(link: LinkCost, bounded: bool, count: int = 3, may_wait: bool = False) -> list:
    """`count` alike prompts planned in one pass of a step that computes `STEP_TOKENS` at most, each
    counting what the ones before it hold; `bounded`: each also knows the room the step has left;
    `may_wait`: each may wait for the next step instead (left out of the pass: `SplitChoice.waits`)."""
    batch: list = []
    used = 0
    for _ in range(count):
        room = max(0, STEP_TOKENS - used)
        c = _split(
            link,
            bytes_ahead=sum(c.nbytes for c in batch),
            compute_ahead_s=sum(c.compute_s for c in batch),
            step_tokens=room if bounded else None,
            may_wait=may_wait,
            next_step_tokens=STEP_TOKENS,
        )
        if c.waits:
            assert c.wait_s is not None and c.wait_s < c.predicted_s
            continue
        batch.append(c)
        used += min(2000 - c.k, max(1, room))
    return batch


def _first_tokens(batch: list) -> list[float]:
    """When each request of a pass gets its first token, as vLLM runs it: the step computes
    `STEP_TOKENS` at most, in the order planned, while the link serves every load of the pass; what did
    not fit is computed after the step, request after request."""
    room, loads, compute, rests = STEP_TOKENS, 0.0, 0.0, []
    for c in batch:
        now = min(2000 - c.k, max(1, room))
        room -= now
        loads += c.load_s
        compute += COMPUTE.seconds(now, c.k)
        rests.append((2000 - c.k - now, c.k + now))
    t = end = max(loads + compute / 30, compute + loads / 30)
    firsts = []
    for rest, past in rests:
        t += COMPUTE.seconds(rest, past) if rest else 0.0
        firsts.append(t if rest else end)
    return firsts


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_a_pass_that_knows_the_step_s_room_ends_no_later(factor):
    """Three alike prompts whose suffixes do not all fit one step: planned knowing the room each has
    left, the last first token of the pass comes no later than planned as if the step had no bound
    (which loads as much for a request whose compute spills past the step as for one whose compute
    overlaps the link); at 0.5x the balance, strictly sooner."""
    link = LinkCost(BALANCE.bytes_per_s * factor)
    bounded, unbounded = max(_first_tokens(_pass(link, True))), max(_first_tokens(_pass(link, False)))
    assert bounded <= unbounded + 1e-9
    if factor == 0.5:
        assert bounded < 0.9 * unbounded


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


def _pass_that_may_wait(link: LinkCost) -> list[float]:
    """The same three prompts, each of which may wait for the next step instead of joining this one:
    the first tokens as vLLM runs it, the step without the ones that waited, then a next step in which
    they are planned anew (after whatever the first pass left to compute)."""
    batch = _pass(link, True, may_wait=True)
    firsts = _first_tokens(batch)
    waiting = 3 - len(batch)
    if not waiting:
        return firsts
    return firsts + [max(firsts) + t for t in _first_tokens(_pass(link, True, count=waiting))]


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_a_request_that_would_join_a_full_step_waits_for_the_next(factor):
    """At the balance, the third prompt finds 48 tokens of room: joining, it would load most of its
    prompt and make the whole step wait for the link. Waiting a step, it splits alone in the next one,
    and the pass's last first token comes sooner, as do the others'; at 0.5x and 2x the balance, never
    later than joining."""
    link = LinkCost(BALANCE.bytes_per_s * factor)
    joined, waited = _first_tokens(_pass(link, True)), _pass_that_may_wait(link)
    assert len(waited) == 3
    assert max(waited) <= max(joined) + 1e-9
    if factor == 1.0:
        assert max(waited) < 0.9 * max(joined) and sorted(waited)[1] < sorted(joined)[1]


def test_only_a_planned_split_behind_others_weighs_waiting():
    assert _split(BALANCE, may_wait=True, next_step_tokens=STEP_TOKENS).wait_s is None  # nothing ahead
    behind = dict(bytes_ahead=40e6, compute_ahead_s=3.0, step_tokens=10, may_wait=True)
    assert _split(BALANCE, **behind, next_step_tokens=STEP_TOKENS).waits
    assert _split(BALANCE, mode="load_all", **behind).wait_s is None
    assert "waits for the next step" in _split(BALANCE, **behind).explain()
    with pytest.raises(InvalidInputError):
        _split(BALANCE, **behind, next_step_tokens=-1)


def test_a_next_step_that_starts_with_what_this_one_spills_is_not_free():
    """Waiting is weighed against a next step that first computes what the requests of this one spill
    into it, with the room they leave: behind a whole prompt's spill, waiting no longer pays."""
    behind = dict(bytes_ahead=40e6, compute_ahead_s=3.0, step_tokens=10, may_wait=True)
    free = _split(BALANCE, **behind, next_step_tokens=STEP_TOKENS)
    spill = COMPUTE.seconds(2000)
    full = _split(BALANCE, **behind, next_step_tokens=STEP_TOKENS - 2000, next_compute_ahead_s=spill)
    assert free.waits and not full.waits
    assert full.wait_s is not None and free.wait_s is not None and full.wait_s > free.wait_s + 1.0
    assert full.later_tokens == 2000 - full.k - full.step_new_tokens
    with pytest.raises(InvalidInputError):
        _split(BALANCE, **behind, next_compute_ahead_s=-1.0)


def _ahead_args(link: LinkCost) -> dict:
    return _args(link, step_tokens=STEP_TOKENS, next_step_tokens=STEP_TOKENS, may_wait=True)


def test_a_split_that_knows_the_requests_after_it_in_the_pass_plans_the_pass():
    """Two alike prompts at the balance, the second asked after the first in the same pass. Each
    planned alone-best loads about half of its prompt, so the step serves two halves on the link and two
    suffixes on the model; the first planned knowing the second (`choose_split_ahead`) loads most of
    its prompt, the second then computes most of its own, and the step ends sooner (7.5 s against
    8.1 s)."""
    balance = LinkCost(2000 * KV_PER_TOKEN / COMPUTE.seconds(2000))
    args = _ahead_args(balance)
    follower = [Follower(2000, ENDS)]
    greedy, ahead = choose_split(**args), choose_split_ahead(follower, **args)
    assert 0 < greedy.k < greedy.loadable_tokens
    assert ahead.k >= greedy.k + 512 and "1 request after it" in ahead.reason
    assert pass_end_s(ahead, follower, **args) < 0.95 * pass_end_s(greedy, follower, **args)
    # the second, planned behind the first's choice, computes most of its prompt and ends the pass
    # when the first was planned to
    second = choose_split(
        **{
            **args,
            "bytes_ahead": ahead.nbytes,
            "compute_ahead_s": ahead.compute_s,
            "step_tokens": STEP_TOKENS - ahead.step_new_tokens,
        }
    )
    assert second.k <= greedy.k - 512 and not second.waits
    assert second.predicted_s == pytest.approx(pass_end_s(ahead, follower, **args))
    # nothing after it, or a split that is not planned: the split alone
    assert choose_split_ahead([], **args) == greedy
    for mode in ("load_all", "compute_all"):
        assert choose_split_ahead(follower, **{**args, "mode": mode}) == choose_split(
            **{**args, "mode": mode}
        )
    assert choose_split_ahead(follower, **{**args, "link": None}).k == greedy.loadable_tokens  # no costs yet
    with pytest.raises(InvalidInputError):
        choose_split(**args, k=100)  # not an aligned split
