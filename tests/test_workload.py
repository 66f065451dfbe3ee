"""The seeded workload generator: properties (hypothesis) and the statistics of its Poisson process."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvrestore.sim.workload import (
    KINDS,
    LogNormalLengths,
    Request,
    Shapes,
    UniformLengths,
    burst,
    mix,
    poisson,
)

seeds = st.integers(min_value=0, max_value=2**63)
rates = st.floats(min_value=0.1, max_value=200.0)
durations = st.floats(min_value=0.0, max_value=20.0)
starts = st.floats(min_value=0.0, max_value=1e4)
weights = st.dictionaries(
    st.sampled_from(KINDS), st.floats(min_value=0.0, max_value=10.0), min_size=1
).filter(lambda w: any(v > 0 for v in w.values()))


def check_lengths(requests: list[Request], shapes: Shapes) -> None:
    for r in requests:
        if r.kind == "restore":
            assert shapes.restore_prefix.low <= r.prefix_tokens <= shapes.restore_prefix.high
            assert shapes.restore_new.low <= r.new_tokens <= shapes.restore_new.high
        elif r.kind == "prefill":
            assert r.prefix_tokens == 0
            assert shapes.prefill_new.low <= r.new_tokens <= shapes.prefill_new.high
        else:
            assert shapes.decode_context.low <= r.prefix_tokens <= shapes.decode_context.high
            assert r.new_tokens == 1


# -- properties ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rate=rates, duration=durations, start=starts, seed=seeds, w=weights)
def test_poisson_arrivals_sorted_within_duration_and_lengths_bounded(rate, duration, start, seed, w):
    requests = poisson(rate, duration, seed=seed, start_s=start, weights=w)
    times = [r.arrival_s for r in requests]
    assert times == sorted(times)
    assert all(start <= t < start + duration for t in times)
    assert [r.id for r in requests] == list(range(len(requests)))
    assert {r.kind for r in requests} <= {k for k, v in w.items() if v > 0}
    check_lengths(requests, Shapes())


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 300),
    at=starts,
    spread=st.floats(min_value=0.0, max_value=5.0),
    seed=seeds,
    w=weights,
)
def test_burst_arrives_within_its_window(n, at, spread, seed, w):
    requests = burst(n, at, seed=seed, spread_s=spread, weights=w)
    assert len(requests) == n
    times = [r.arrival_s for r in requests]
    assert times == sorted(times)
    assert all(at <= t <= at + spread for t in times)
    if spread == 0:
        assert set(times) <= {at}
    check_lengths(requests, Shapes())


@settings(max_examples=40, deadline=None)
@given(seed=seeds, rate=rates, duration=durations)
def test_same_seed_same_workload(seed, rate, duration):
    assert poisson(rate, duration, seed=seed) == poisson(rate, duration, seed=seed)
    assert burst(20, 1.0, seed=seed, spread_s=0.5) == burst(20, 1.0, seed=seed, spread_s=0.5)


@settings(max_examples=40, deadline=None)
@given(a=seeds, b=seeds, rate=st.floats(min_value=5.0, max_value=100.0), duration=st.floats(1.0, 10.0))
def test_different_seed_different_workload(a, b, rate, duration):
    assume(a != b)
    assert poisson(rate, duration, seed=a) != poisson(rate, duration, seed=b)
    assert burst(20, seed=a) != burst(20, seed=b)


def test_generators_leave_global_random_state_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    poisson(50.0, 10.0, seed=7)
    burst(100, seed=7, spread_s=1.0)
    assert random.random() == expected


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(
        st.tuples(seeds, st.floats(0.0, 5.0), st.floats(0.0, 3.0)),
        min_size=0,
        max_size=4,
    )
)
def test_mix_orders_by_arrival_renumbers_and_keeps_every_request(parts):
    workloads = [poisson(10.0, d, seed=s, start_s=t) for s, d, t in parts]
    workloads.append(burst(5, 1.0, seed=1))
    merged = mix(*workloads)
    times = [r.arrival_s for r in merged]
    assert times == sorted(times)
    assert [r.id for r in merged] == list(range(len(merged)))
    strip = lambda rs: sorted((r.arrival_s, r.kind, r.prefix_tokens, r.new_tokens) for r in rs)  # noqa: E731
    assert strip(merged) == strip([r for w in workloads for r in w])


def test_mix_keeps_argument_order_on_ties():
    head = [Request(0.0, "restore", 16384, 32)]  # Cake §5.8: a 16K restore, then a burst at the same time
    merged = mix(head, burst(22, 0.0, seed=3))
    assert merged[0].kind == "restore" and merged[0].prefix_tokens == 16384
    assert len(merged) == 23 and all(r.kind in ("prefill", "decode") for r in merged[1:])


@settings(max_examples=60, deadline=None)
@given(
    median=st.floats(10.0, 1e5),
    sigma=st.floats(0.05, 5.0),
    low=st.integers(1, 5000),
    span=st.integers(0, 10000),
    seed=seeds,
)
def test_lognormal_lengths_stay_in_bounds(median, sigma, low, span, seed):
    dist = LogNormalLengths(median, sigma, low, low + span)
    rng = random.Random(seed)
    assert all(low <= dist.sample(rng) <= low + span for _ in range(50))


# -- statistics ------------------------------------------------------------------------------------


def test_poisson_rate_count_and_dispersion():
    """Over a long run the count, mean gap, gap spread and per-second dispersion match a Poisson process."""
    rate, duration = 40.0, 2500.0
    requests = poisson(rate, duration, seed=2024)
    n = len(requests)
    expected = rate * duration
    assert abs(n - expected) < 4 * math.sqrt(expected)  # count ~ Poisson(100000): sd 316
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.02)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.02)  # exponential
    per_second = [0] * int(duration)
    for r in requests:
        per_second[int(r.arrival_s)] += 1
    dispersion = statistics.pvariance(per_second) / statistics.fmean(per_second)
    assert dispersion == pytest.approx(1.0, abs=0.1)  # variance == mean for Poisson counts


def test_kind_shares_follow_weights():
    requests = poisson(100.0, 300.0, seed=5, weights={"restore": 1, "prefill": 1, "decode": 2})
    share = {k: sum(r.kind == k for r in requests) / len(requests) for k in KINDS}
    assert share == pytest.approx({"restore": 0.25, "prefill": 0.25, "decode": 0.5}, abs=0.01)


def test_lognormal_matches_its_truncated_quantiles():
    dist = LogNormalLengths()  # median 1024, sigma 0.9, [256, 8192]
    rng = random.Random(11)
    xs = sorted(dist.sample(rng) for _ in range(100_000))
    for q in (0.1, 0.5, 0.9, 0.99):
        assert xs[int(q * len(xs))] == pytest.approx(dist.quantile(q), rel=0.03)
    assert dist.quantile(0.0) == pytest.approx(256) and dist.quantile(1.0) == pytest.approx(8192)
    assert 0.09 < sum(x > 3000 for x in xs) / len(xs) < 0.14  # the long tail the docstring promises


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: poisson(0.0, 1.0), "rate_per_s"),
        (lambda: poisson(-1.0, 1.0), "rate_per_s"),
        (lambda: poisson(float("nan"), 1.0), "rate_per_s"),
        (lambda: poisson(1.0, float("inf")), "duration_s"),
        (lambda: poisson(1.0, -1.0), "duration_s"),
        (lambda: poisson(1e6, 1e6), "expected requests"),
        (lambda: poisson(1.0, 1.0, seed=-1), "seed"),
        (lambda: poisson(1.0, 1.0, seed=1.5), "seed"),
        (lambda: poisson(1.0, 1.0, seed=True), "seed"),
        (lambda: poisson(1.0, 1.0, weights={}), "weights"),
        (lambda: poisson(1.0, 1.0, weights={"restore": 0}), "positive weight"),
        (lambda: poisson(1.0, 1.0, weights={"restor": 1}), "unknown kinds"),
        (lambda: poisson(1.0, 1.0, weights={"decode": -1}), "weight of 'decode'"),
        (lambda: burst(-1), "n must be"),
        (lambda: burst(3, spread_s=-0.5), "spread_s"),
        (lambda: burst(3, at_s=-2.0), "at_s"),
        (lambda: mix(Request(0.0, "decode", 10, 1)), "wrap a single request"),
        (lambda: mix([1, 2]), "not Request"),
        (lambda: LogNormalLengths(low=500, high=100), "low must be <= high"),
        (lambda: LogNormalLengths(median=0), "median"),
        (lambda: LogNormalLengths(sigma=-1), "sigma"),
        (lambda: UniformLengths(0, 10), "low must be"),
        (lambda: Request(-1.0, "decode", 10, 1), "arrival_s"),
        (lambda: Request(0.0, "chat", 10, 1), "kind"),
        (lambda: Request(0.0, "restore", 0, 8), "cached prefix"),
        (lambda: Request(0.0, "prefill", 5, 8), "nothing cached"),
        (lambda: Request(0.0, "decode", 5, 2), "one token"),
        (lambda: Request(0.0, "decode", 5.5, 1), "prefix_tokens"),
        (lambda: Request(0.0, "prefill", 0, 0), "new_tokens"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_request_is_frozen_and_knows_what_to_restore():
    r = Request(0.5, "restore", 2048, 32, 7)
    with pytest.raises(AttributeError):
        r.prefix_tokens = 1  # type: ignore[misc]
    assert r.restore_tokens == 2048
    assert Request(0.5, "decode", 2048, 1).restore_tokens == 0
