"""TokenTwoPointer on a simulated clock (no model): the pointer invariants and the makespan bound."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvrestore.core.bandwidth import BandwidthTrace, Link, oracle_split, trace_suffix_times
from kvrestore.core.trace import TraceEvent
from kvrestore.costs.estimates import Priors
from kvrestore.policies import ChunkStatus, ComputeOnly, Decision, LoadOnly, Progress, TokenTwoPointer
from kvrestore.policies.meeting import GRACE
from kvrestore.runtime.bookkeeping import PolicyError, apply_event, begin
from kvrestore.sim.simulate import simulate

from .conftest import ask

CHUNK_BYTES = 1000


@st.composite
def scenarios(draw):
    """Chunk count, per-chunk compute costs rising with index plus a fixed per-unit overhead, a
    fluctuating compute share and a fluctuating link, lanes and the compute granularity."""
    n = draw(st.integers(1, 40))
    base = draw(st.floats(0.01, 1.0))
    growth = draw(st.floats(0.0, 0.2))
    overhead = draw(st.floats(0.0, 0.05))
    per_chunk = [base * (1 + growth * i) for i in range(n)]
    # the link: between 0.1x and 10x the speed that balances compute and load, changing every so often
    balance = n * CHUNK_BYTES / sum(per_chunk)
    step_s = draw(st.floats(0.05, 2.0))
    rates = draw(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=30))
    trace = BandwidthTrace(tuple((i * step_s, r * balance) for i, r in enumerate(rates)))
    # the compute lane's share of the device (Cake §5.7's compute budget), also changing
    share_step = draw(st.floats(0.05, 2.0))
    shares = draw(st.lists(st.floats(0.25, 1.0), min_size=1, max_size=30))
    lanes = draw(st.integers(1, 4))
    unit = draw(st.integers(1, 4))
    return n, per_chunk, overhead, trace, (share_step, shares), lanes, unit


def share_at(shares: tuple[float, list[float]], t: float) -> float:
    step, values = shares
    return values[min(int(t / step), len(values) - 1)]


def run(scenario, stored=None, failing=()):
    n, per_chunk, overhead, trace, shares, lanes, unit = scenario

    def cost(a: int, b: int, start: float) -> float:
        return (overhead + sum(per_chunk[a:b])) / share_at(shares, start)

    result = simulate(
        TokenTwoPointer(compute_chunks=unit),
        [256] * n,
        [True] * n if stored is None else stored,
        cost,
        [CHUNK_BYTES] * n,
        Link(trace),
        load_lanes=lanes,
        failing=failing,
    )
    return result


def applied_chunks(trace) -> list[int]:
    return trace.loaded() + trace.computed()


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_chunk_once_and_pointers_never_cross(scenario):
    result = run(scenario)
    n = scenario[0]
    assert sorted(applied_chunks(result.trace)) == list(range(n))  # all done, none twice
    computed = set(result.trace.computed())
    loaded = set(result.trace.loaded())
    # the compute pointer never passed the load pointer: computed chunks are a prefix, loaded a suffix
    assert computed == set(range(len(computed)))
    assert loaded == set(range(len(computed), n))


@settings(max_examples=300, deadline=None)
@given(scenarios())
# a link five or eight times faster after its first fetch: a unit cut short for the loads, or left at
# its length, is not grown over the stored chunks past it (they took 5.0 s and 3.5 s that way)
@example((6, [1.0] * 6, 0.0, BandwidthTrace(((0.0, 1000.0), (1.0, 5000.0))), (1.0, [1.0]), 1, 3))
@example((8, [0.25] * 8, 0.0, BandwidthTrace(((0.0, 1000.0), (0.5, 8000.0))), (1.0, [0.5]), 1, 4))
def test_makespan_within_one_chunk_of_the_best_split(scenario):
    n, per_chunk, overhead, trace, shares, lanes, unit = scenario
    result = run(scenario)
    # the oracle knows the whole future: each chunk's compute cost at the share it actually got, and
    # the link's delivery of chunks k.. back to back from time 0
    slowest_share = min(shares[1][: int(result.makespan / shares[0]) + 1])
    compute_s = [(c + overhead / unit) / slowest_share for c in per_chunk]
    compute_fast = list(per_chunk)  # a unit's overhead shared by no chunk: a bound whatever the units
    best_lo, _ = oracle_split(compute_fast, trace_suffix_times([CHUNK_BYTES] * n, trace))
    best_hi, _ = oracle_split(compute_s, trace_suffix_times([CHUNK_BYTES] * n, trace))
    # one chunk's time: a compute unit at the slowest share, or one chunk over the slowest link in use
    slowest_rate = min(r for t, r in trace.steps if t <= result.makespan)
    one_chunk = max(unit * max(compute_s) + overhead / slowest_share, CHUNK_BYTES / slowest_rate)
    assert result.makespan >= best_lo - 1e-9  # nothing beats the oracle
    assert result.makespan <= best_hi + one_chunk + 1e-9


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_misses_and_failed_loads_are_computed_in_order(scenario, data):
    n = scenario[0]
    stored = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    failing = data.draw(st.sets(st.sampled_from(range(n))))
    result = run(scenario, stored, failing)
    assert sorted(applied_chunks(result.trace)) == list(range(n))
    loaded = set(result.trace.loaded())
    assert all(stored[i] and i not in failing for i in loaded)
    computed = set(result.trace.computed())
    # within each run of loadable chunks, computed ones come before loaded ones
    loadable = [stored[i] and i not in failing for i in range(n)]
    start = 0
    while start < n:
        end = start + 1
        while end < n and loadable[end] == loadable[start]:
            end += 1
        if loadable[start]:
            run_computed = [i for i in range(start, end) if i in computed]
            run_loaded = [i for i in range(start, end) if i in loaded]
            assert not run_computed or not run_loaded or max(run_computed) < min(run_loaded)
        start = end


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 24),
    st.floats(0.0, 0.05),
    st.floats(0.001, 0.05),
    st.floats(0.0, 0.2),
    st.floats(0.1, 10.0),
    st.integers(1, 4),
)
@example(6, 0.0124, 0.0062, 0.05, 0.5, 4)  # a real profile's costs: two-chunk units were 1.035x
@example(8, 0.0, 0.01, 0.1, 1.0, 4)  # no fixed cost
def test_with_an_exact_cost_model_never_slower_than_the_better_single_resource(
    n, fixed_s, per_chunk_s, growth, speed, lanes
):
    """A cost model that knows the compute lane (every unit pays `fixed_s` once, and a chunk costs more
    the later it comes) and a constant link it knows, anywhere from a tenth of the balance bandwidth to
    ten times it: the two-pointer takes no longer than the better of computing the prompt in one unit
    and loading it all, within 2% (the race for the meeting chunk is decided by estimates)."""

    def cost(a: int, b: int, _t: float) -> float:
        return fixed_s + sum(per_chunk_s * (1 + growth * i) for i in range(a, b))

    whole_s = cost(0, n, 0.0)
    bytes_per_s = speed * n * CHUNK_BYTES / whole_s
    priors = ([cost(i, i + 1, 0.0) for i in range(n)], (CHUNK_BYTES / 128 / bytes_per_s, 0.0))

    def sim(policy):
        link = Link(BandwidthTrace.constant(bytes_per_s))
        return simulate(
            policy,
            [128] * n,
            [True] * n,
            cost,
            [CHUNK_BYTES] * n,
            link,
            lanes,
            priors=priors,
            unit_fixed_s=fixed_s,
        ).makespan

    best = min(whole_s, sim(LoadOnly()))
    assert sim(TokenTwoPointer()) <= 1.02 * best + 1e-9


def test_waits_for_a_fetch_that_lands_sooner_than_computing():
    p = Progress([256] * 4, [True] * 4)
    p.status = [ChunkStatus.COMPUTED, ChunkStatus.LOADING, ChunkStatus.LOADED, ChunkStatus.LOADED]
    p.compute_seconds[0] = 1.0
    p.load_seconds[2] = p.load_seconds[3] = 0.4
    p.load_started[3], p.load_started[2], p.load_started[1] = 0.0, 0.4, 0.8  # one link, back to back
    p.loads_in_flight = 1
    p.now = 1.0
    d = ask(TokenTwoPointer(), p)
    # lands at 1.2, sooner than computing (till 2.0): wait, and look again a little after it is due
    assert d.compute is None and d.wake_at == pytest.approx(1.2 + GRACE * 1.0)
    p.now = 1.35  # overdue: compute it now and drop the fetch
    assert ask(TokenTwoPointer(), p) == Decision(compute=(1, 2), drop=(1,))


def test_computes_and_drops_a_fetch_that_lands_later_than_computing():
    p = Progress([256] * 3, [True] * 3)
    p.status = [ChunkStatus.COMPUTED, ChunkStatus.LOADING, ChunkStatus.LOADED]
    p.compute_seconds[0] = 0.1
    p.load_seconds[2] = 2.0
    p.load_started[2], p.load_started[1] = 0.0, 0.5
    p.loads_in_flight = 1
    p.now = 0.6
    assert ask(TokenTwoPointer(), p) == Decision(compute=(1, 2), drop=(1,))


def test_fetches_that_cannot_land_in_time_go_to_whole_compute_units():
    """A link so slow that one chunk takes longer to fetch than the whole prompt to compute (0.1x the
    balance bandwidth): the compute lane takes every chunk in one unit (units of `compute_chunks` would
    each add their fixed cost), the fetches in flight are dropped, and the restore finishes before
    compute-only in units of `compute_chunks` does, as soon as compute-only in one unit."""
    n, unit_s, per_chunk_s = 8, 0.002, 0.01

    def cost(a: int, b: int, _t: float) -> float:
        return unit_s + per_chunk_s * (b - a)

    bytes_per_s = 0.1 * n * CHUNK_BYTES / (n * per_chunk_s)
    priors = ([cost(i, i + 1, 0.0) for i in range(n)], (CHUNK_BYTES / 128 / bytes_per_s, 0.0))
    link = Link(BandwidthTrace.constant(bytes_per_s))
    res = simulate(TokenTwoPointer(2), [128] * n, [True] * n, cost, [CHUNK_BYTES] * n, link, priors=priors)
    alone = simulate(ComputeOnly(2), [128] * n, [True] * n, cost, [CHUNK_BYTES] * n, link)
    assert res.trace.computed() == list(range(n))
    units = [(e.first_chunk, e.last_chunk) for e in res.trace.of_kind("compute")]
    assert units == [(0, n - 1)]
    whole = simulate(ComputeOnly(n), [128] * n, [True] * n, cost, [CHUNK_BYTES] * n, link)
    assert res.makespan < alone.makespan
    assert res.makespan == pytest.approx(whole.makespan)


def _slow_fresh_restore(sees_arrivals: bool) -> list[tuple[int, int]]:
    """The compute units of a restore of 8 chunks over a link at 0.1x the balance, nothing known."""
    n = 8

    def cost(a: int, b: int, _t: float) -> float:
        return 0.01 + 0.2 * (b - a)

    link = Link(BandwidthTrace.constant(0.1 * CHUNK_BYTES / 0.2))
    res = simulate(
        TokenTwoPointer(2), [128] * n, [True] * n, cost, [CHUNK_BYTES] * n, link, sees_arrivals=sees_arrivals
    )
    assert res.trace.computed() == list(range(n))
    return [(e.first_chunk, e.last_chunk) for e in res.trace.of_kind("compute")]


def test_without_priors_a_fetch_in_flight_is_guessed_to_need_as_long_again():
    """The same slow link with nothing known before the restore, from a store that shows a fetch only
    once it has landed: the first unit measures the lane (one chunk), and from then on the fetches that
    have delivered nothing are taken to need as long again as they have been in flight, so they go to
    units of `compute_chunks`, the last unit taking the runt left after it."""
    assert _slow_fresh_restore(sees_arrivals=False) == [(0, 0), (1, 2), (3, 4), (5, 7)]


def test_without_priors_the_bytes_seen_arriving_give_the_link_rate():
    """The same restore from a store that shows its bytes arriving: by the end of the second unit two
    looks have seen bytes arrive, their rate says no fetch can land before computing ends, and every
    chunk left is one unit."""
    assert _slow_fresh_restore(sees_arrivals=True) == [(0, 0), (1, 2), (3, 7)]


def test_a_unit_takes_the_fetches_it_would_finish_before_they_land():
    """Chunks 3 and 2 are fetched behind chunks 5 and 4 on a link that lands a chunk every 0.15 s (at
    0.24, 0.39, 0.545 and 0.695 s); computing a chunk takes 0.1 s. The unit from chunk 1 covers 1-3 and
    drops the fetches of 2 and 3, which computing finishes first (at 0.3 and 0.4 s), and stops before
    chunk 4, whose fetch lands first."""
    p = Progress([256] * 6, [True] * 6)
    p.status = [ChunkStatus.COMPUTED, ChunkStatus.PENDING] + [ChunkStatus.LOADING] * 4
    p.compute_seconds[0] = 0.1
    p.load_started[5], p.load_started[4], p.load_started[3], p.load_started[2] = 0.09, 0.09, 0.095, 0.095
    p.loads_in_flight, p.now = 4, 0.1
    slow = Priors(link=(0.15 / 256, 0.0))
    assert ask(TokenTwoPointer(compute_chunks=3), p, slow) == Decision(compute=(1, 4), drop=(2, 3))
    fast = Priors(link=(0.0015 / 256, 0.0))  # a link a hundred times faster: every fetch lands first
    p.stored[1] = False  # (and chunk 1 is not stored, so the lane does not wait for the loads instead)
    assert ask(TokenTwoPointer(compute_chunks=3), p, fast) == Decision(compute=(1, 2))


def test_loads_from_the_back_down_to_the_compute_frontier():
    p = Progress([256] * 6, [True, True, False, True, True, True])
    p.free_load_lanes = 10
    d = ask(TokenTwoPointer(compute_chunks=2), p)
    assert d.compute == (0, 1)  # the first unit is one chunk: the lane's speed is not known yet
    assert d.loads == (5, 4, 3, 1)  # from the back; chunk 2 is not stored, chunk 0 is being computed
    p.compute_seconds[0], p.status[0] = 0.1, ChunkStatus.COMPUTED
    p.stored = [True, False, False, False, False, False]
    assert ask(TokenTwoPointer(compute_chunks=2), p).compute == (1, 3)  # nothing to load: full units
    p.status[0], p.stored = ChunkStatus.PENDING, [True, True, False, True, True, True]
    p.free_load_lanes = 1
    assert ask(TokenTwoPointer(compute_chunks=2), p).loads == (5,)


def test_bookkeeping_refuses_double_application_and_bad_drops():
    p = Progress([256] * 2, [True, True])
    with pytest.raises(PolicyError, match="dropped"):
        begin(p, Decision(drop=(1,)))
    begin(p, Decision(loads=(1,)))
    apply_event(p, TraceEvent("load", 1, 1, 0.0, 1.0, 10))
    with pytest.raises(PolicyError, match="not loading"):
        apply_event(p, TraceEvent("load", 1, 1, 0.0, 1.0, 10))
    with pytest.raises(ValueError):
        TokenTwoPointer(compute_chunks=0)
