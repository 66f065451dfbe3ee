"""The cost model: fitting, the profile file, measuring a real (tiny) model and store, the live link."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import Restorer
from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.compute import ChunkCost, LayerCost, fit_chunk_cost, fit_layer_cost
from kvrestore.costs.fit import fit_nonnegative
from kvrestore.costs.links import LinkCost, LinkEstimate, _busy_seconds, fit_link
from kvrestore.costs.measure import profile
from kvrestore.costs.profile import Profile, machine_id
from kvrestore.stores.memory import MemoryStore

from .conftest import tiny_model


def make_profile(backend: HFBackend | None = None, **kw) -> Profile:
    base = dict(
        machine="m",
        model=backend.spec.name if backend else "model",
        fingerprint=backend.spec.fingerprint if backend else "f" * 32,
        dtype="float32",
        device="cpu",
        chunk=ChunkCost(1e-3, 1e-5, 1e-9, 1e-9),
        layer=LayerCost(1e-4, 1e-6, 1e-10),
        link=LinkCost(1e8, 1e-3),
    )
    base.update(kw)
    return Profile(**base)


def test_fits_recover_the_costs_that_made_the_samples():
    truth = ChunkCost(2e-3, 3e-5, 4e-9, 1e-9)
    samples = [[n, p, truth.seconds(n, p)] for n in (64, 256, 512, 2048) for p in (0, 256, 1024)]
    fitted = fit_chunk_cost(samples)
    for n, p, s in samples:
        assert fitted.seconds(n, p) == pytest.approx(s, rel=1e-6)
    layer = LayerCost(1e-3, 2e-6, 3e-10)
    fitted_layer = fit_layer_cost([[n, layer.seconds(n)] for n in (128, 256, 1024, 4096)])
    assert fitted_layer.seconds(3000) == pytest.approx(layer.seconds(3000), rel=1e-6)
    link = fit_link([[b, 0.002 + b / 5e7] for b in (4096, 1 << 20, 8 << 20)])
    assert link.bytes_per_s == pytest.approx(5e7, rel=1e-6) and link.latency_s == pytest.approx(
        0.002, rel=1e-6
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1, 1e4), st.floats(0, 1e4), st.floats(1e-6, 10.0)), min_size=1, max_size=30)
)
def test_fitted_costs_are_never_negative(rows):
    coef = fit_nonnegative([[1.0, a, b] for a, b, _ in rows], [s for _, _, s in rows])
    assert all(c >= 0 for c in coef)


def test_profile_file_round_trip_and_clear_errors(tmp_path, llama_backend):
    p = make_profile(llama_backend, samples={"layer": [[128.0, 0.01]]})
    path = p.save(tmp_path / "p.json")
    assert Profile.load(path) == p
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="bad.json"):
        Profile.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(InvalidInputError, match="not a kvrestore profile"):
        Profile.load(tmp_path / "other.json")
    old = msgspec.structs.replace(p, version=0)
    old.save(tmp_path / "old.json")
    with pytest.raises(InvalidInputError, match="kvrestore profile` again"):
        Profile.load(tmp_path / "old.json")
    with pytest.raises(InvalidInputError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")


def test_restorer_finds_the_saved_profile_and_refuses_another_models(tmp_path, monkeypatch, llama_backend):
    monkeypatch.setenv("KVRESTORE_CACHE_DIR", str(tmp_path))
    assert Restorer(llama_backend, MemoryStore()).planner.profile is None
    p = make_profile(llama_backend)
    p = msgspec.structs.replace(p, machine=machine_id())
    p.save()
    assert Restorer(llama_backend, MemoryStore()).planner.profile == p
    other = HFBackend(tiny_model("qwen2"), name="tiny-qwen2")
    with pytest.raises(InvalidInputError, match="profile is of"):
        Restorer(other, MemoryStore(), profile=p)
    with pytest.raises(InvalidInputError, match="cannot read profile"):
        Restorer(llama_backend, MemoryStore(), profile=tmp_path / "nope.json")


def test_profile_measures_a_real_model_and_store(llama_backend):
    store = MemoryStore()
    ticks: list[str] = []
    p = anyio.run(
        lambda: profile(llama_backend, store, max_tokens=256, chunk_size=64, repeats=1, tick=ticks.append)
    )
    # every measurement of a long step is told as it ends, counted against the step's whole
    for step, kind in (("prefill cost", "chunk"), ("layer cost", "layer")):
        n = len(p.samples[kind])
        told = [t for t in ticks if t.startswith(step)]
        assert told == [f"{step}: {i} of {n} measurements" for i in range(1, n + 1)]
    assert p.matches(llama_backend.spec, "cpu")
    assert {len(s) for s in p.samples["chunk"]} == {3} and len(p.samples["layer"]) >= 3
    assert p.chunk.seconds(256) > p.chunk.seconds(64) > 0
    assert p.layer.seconds(256) > 0 and p.link is not None and p.link.bytes_per_s > 0
    assert anyio.run(store.scan) == []  # its test objects are gone
    assert "prefill n tokens" in p.summary()


def test_profile_rejects_bad_sizes(llama_backend):
    with pytest.raises(InvalidInputError, match="chunk_size"):
        anyio.run(lambda: profile(llama_backend, max_tokens=32, chunk_size=64))


def test_link_estimate_follows_the_loads():
    """Loads within `CHANGE_FACTOR` of the estimate move it (noise); loads further off replace it (the
    link changed speed), and it stays unconfirmed until a later restore's loads agree."""
    trace = Trace()
    for i in range(4):  # 1 MB every 0.1 s on one lane, back to back: 10 MB/s
        trace.add(TraceEvent("load", i, i, 0.1 * i, 0.1 * (i + 1), 1_000_000))
    est = LinkEstimate(LinkCost(6e6, 0.0), weight=0.5)
    est.observe(trace)
    assert est.current.bytes_per_s == pytest.approx((6e6 + 1e7) / 2) and est.changes == 0
    est.observe(Trace())  # nothing loaded: nothing learned
    assert est.observations == 1
    changed = LinkEstimate(LinkCost(1e6, 0.0), weight=0.5)  # ten times too slow: a change, not noise
    changed.observe(trace)
    assert changed.current.bytes_per_s == pytest.approx(1e7) and changed.changes == 1 and changed.unconfirmed
    changed.observe(trace)
    assert changed.current.bytes_per_s == pytest.approx(1e7) and not changed.unconfirmed
    assert changed.at_most(0.6e7) and changed.changes == 1  # a bound within the factor: no change
    assert changed.current.bytes_per_s == pytest.approx(1e7)
    assert changed.at_most(1e6) and changed.current.bytes_per_s == 1e6 and changed.changes == 2
    assert not changed.unconfirmed and changed.observations == 4  # a bound: nothing left to confirm
    assert not LinkEstimate().at_most(1e6)  # no estimate to set it against
    fresh = LinkEstimate()
    fresh.observe(trace)
    assert fresh.current.bytes_per_s == pytest.approx(1e7) and fresh.changes == 0


def test_busy_time_is_the_union_of_intervals():
    assert _busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert _busy_seconds([]) == 0.0
