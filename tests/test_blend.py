"""CacheBlend: re-rotation, selective recompute, HKVD selection, the fusor pipeline, the loading controller."""

from __future__ import annotations

import collections
import functools
import gc
import threading
import weakref
from pathlib import Path

import anyio
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvrestore import InvalidInputError, Restorer, UnsupportedModelError, codec, open_store
from kvrestore.backends.attention import attention_lse, merge_attention, row_groups, without_cudnn_attention
from kvrestore.backends.hf import HFBackend
from kvrestore.backends.hf_blend import MASK_ALIGNMENT, selected_rows_mask
from kvrestore.blend import (
    Blend,
    StoreCandidate,
    StoreOption,
    choose_blend_store,
    choose_ratio,
    choose_store,
    chunk_key,
    fuse,
    load_seconds_per_layer,
    ratio_schedule,
    recompute_seconds_per_layer,
    select_hkvd,
    selection_sizes,
)
from kvrestore.blend.chunks import StoreChunkSource, save_chunk
from kvrestore.blend.select import SelectionBounds, kv_deviation, stacked_kv_deviation
from kvrestore.chunkio.deferred import DeferredChecks
from kvrestore.chunkio.layers import ChunkLoadFailed
from kvrestore.core.kv import KVCache
from kvrestore.costs.compute import LayerCost
from kvrestore.stores.memory import MemoryStore
from kvrestore.stores.throttled import ThrottledStore
from kvrestore.tools.text import reference_tokens

from .conftest import random_tokens, tiny_model
from .waiting import wait_until

ATOL = 1e-4
FAMILIES = ["llama", "qwen2"]


@pytest.fixture(scope="module", params=FAMILIES)
def backend(request) -> HFBackend:
    return HFBackend(tiny_model(request.param, layers=4), name=f"tiny-{request.param}")


def _rope_model(rope_parameters: dict) -> HFBackend:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=rope_parameters,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return HFBackend(transformers.LlamaForCausalLM(config).eval(), name="rope-test")


def _chunks(lengths, seed=0, vocab=256) -> list[torch.Tensor]:
    return [random_tokens(n, vocab, seed=seed + i) for i, n in enumerate(lengths)]


async def _blend(backend, store, saved, chunks, suffix, policy):
    async with Restorer(backend, store) as r:
        for c in saved:
            await r.save_chunk(c)
        return await r.restore_blend(chunks, suffix, policy)


def run_blend(backend, chunks, suffix, policy=None, store=None, saved=None):
    store = MemoryStore() if store is None else store  # an empty store is falsy (it has a length)
    saved = chunks if saved is None else saved
    return anyio.run(_blend, backend, store, saved, chunks, suffix, policy)


# -- re-rotation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3"])
def test_rerotated_keys_equal_keys_at_new_position_on_layer0(family):
    """Layer 0 has no cross-attention: a chunk's keys moved by re-rotation equal keys computed there."""
    b = HFBackend(tiny_model(family, layers=2), name=family)
    before, chunk = random_tokens(37, 256, seed=1), random_tokens(23, 256, seed=2)
    alone = b.prefill_chunk(chunk, None, 0).data
    together = b.prefill_chunk(torch.cat([before, chunk]), None, 0).data[:, :, :, len(before) :]
    moved = b.rerotate_keys(alone[0, 0], 0, len(before))
    torch.testing.assert_close(moved, together[0, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(alone[0, 1], together[0, 1], atol=ATOL, rtol=0)
    assert (alone[0, 0] - together[0, 0]).abs().max() > 1e-2  # the rotation was needed
    # moving back and forth, and per-token positions, are rotations too
    back = b.rerotate_keys(moved, torch.arange(37, 60), torch.arange(23))
    torch.testing.assert_close(back, alone[0, 0], atol=ATOL, rtol=0)


def test_rerotation_with_llama3_scaled_rope():
    b = _rope_model(
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    before, chunk = random_tokens(300, 256, seed=3), random_tokens(20, 256, seed=4)
    alone = b.prefill_chunk(chunk, None, 0).data
    together = b.prefill_chunk(torch.cat([before, chunk]), None, 0).data[:, :, :, 300:]
    torch.testing.assert_close(b.rerotate_keys(alone[0, 0], 0, 300), together[0, 0], atol=ATOL, rtol=0)


def test_dynamic_rope_cannot_be_rerotated():
    b = _rope_model({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        b.rerotate_keys(torch.zeros(2, 3, 16), 0, 5)
    with pytest.raises(UnsupportedModelError):
        run_blend(b, _chunks([5, 6]), random_tokens(3, 256))


# -- selective layer -------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(picks=st.lists(st.booleans(), min_size=40, max_size=40), layer=st.integers(0, 2))
def test_selective_layer_equals_full_layer_on_its_rows(picks, layer):
    """Any subset of tokens, run over the full layer KV, gets exactly the full layer's outputs."""
    b = _shared_llama()
    tokens = random_tokens(40, 256, seed=7)
    positions = torch.arange(40)
    hidden = b.embed(tokens)
    for i in range(layer):
        hidden, _, _ = b.run_layer(i, hidden, None, None, positions)
    out, k, v = b.run_layer(layer, hidden, None, None, positions)
    index = torch.tensor([i for i, p in enumerate(picks) if p] or [0])
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)  # unselected rows: the full layer's KV
    rest = torch.tensor([i for i in range(40) if i not in set(index.tolist())], dtype=torch.long)
    k2[:, rest], v2[:, rest] = k[:, rest], v[:, rest]
    sel_out, kr, vr = b.run_layer_selective(layer, hidden[:, index], index, k2, v2)
    torch.testing.assert_close(sel_out, out[:, index], atol=1e-5, rtol=0)
    torch.testing.assert_close(k2, k, atol=1e-5, rtol=0)  # selected rows written in place
    torch.testing.assert_close(vr, v[:, index], atol=1e-5, rtol=0)


@settings(max_examples=15, deadline=None)
@given(
    picks=st.lists(st.booleans(), min_size=40, max_size=40),
    groups=st.integers(1, 8),
    rows=st.integers(1, 6),
    slack=st.integers(0, 7),
)
def test_grouped_attention_equals_one_masked_call(picks, groups, rows, slack):
    """Selected rows split over key prefixes, by the exact positions or any looser upper bounds of
    them, compute the same layer as one masked call over all keys."""
    b = HFBackend(tiny_model("llama", layers=1), name="tiny-llama")
    tokens = random_tokens(40, 256, seed=8)
    hidden = b.embed(tokens)
    _, k, v = b.run_layer(0, hidden, None, None, torch.arange(40))
    index = torch.tensor([i for i, p in enumerate(picks) if p] or [39])
    upper = [min(39, p + slack) for p in index.tolist()]
    one = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone())
    b.blend.attention_groups, b.blend.group_rows = groups, rows
    grouped = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=upper)
    for x, y in zip(grouped, one, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


@settings(max_examples=30, deadline=None)
@given(
    picks=st.lists(st.booleans(), min_size=1, max_size=70), extra=st.integers(0, 20), cut=st.integers(0, 70)
)
def test_the_additive_mask_is_the_boolean_one_in_aligned_rows(picks, extra, cut):
    """CUDA's additive mask of the selected rows sees exactly what the boolean one sees, gives the
    same attention, and every slice of it the groups take keeps an aligned row stride (so SDPA's
    memory-efficient kernel takes it without a padded copy)."""
    index = torch.tensor([i for i, p in enumerate(picks) if p] or [len(picks) - 1])
    n_keys = len(picks) + extra
    seen = selected_rows_mask(index, n_keys, torch.float32, additive=False)
    bias = selected_rows_mask(index, n_keys, torch.float32, additive=True)
    assert bias.shape == seen.shape == (index.numel(), n_keys)
    assert torch.equal(bias == 0, seen) and torch.equal(bias == float("-inf"), ~seen)
    kl = max(int(index[-1]) + 1, min(cut, n_keys))  # a group's key prefix: its rows see no key past it
    part = bias[index.numel() // 2 :, :kl]
    assert part.stride(0) % MASK_ALIGNMENT == 0 and part.stride(1) == 1
    g = torch.Generator().manual_seed(len(picks))
    q, k, v = (torch.randn(1, 4, n, 8, generator=g) for n in (index.numel(), n_keys, n_keys))
    with_bias = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(
        with_bias, F.scaled_dot_product_attention(q, k, v, attn_mask=seen), atol=1e-6, rtol=0
    )


@settings(max_examples=40, deadline=None)
@given(
    upper=st.lists(st.integers(0, 500), min_size=1, max_size=300).map(sorted),
    extra=st.integers(0, 40),
    max_groups=st.integers(1, 9),
    min_rows=st.integers(1, 80),
)
def test_row_groups_cover_the_rows_with_every_key_a_row_may_see(upper, extra, max_groups, min_rows):
    n_keys = upper[-1] + 1 + extra
    groups = row_groups(upper, n_keys, max_groups, min_rows)
    assert 1 <= len(groups) <= max_groups
    assert groups[0][0] == 0 and groups[-1][1] == len(upper)
    for (a, b, kl), nxt in zip(groups, [*groups[1:], None], strict=True):
        assert a < b and kl <= n_keys and all(p < kl for p in upper[a:b])
        if nxt is not None:
            assert nxt[0] == b and nxt[2] >= kl
    if len(groups) > 1:
        assert all(b - a >= min_rows for a, b, _ in groups)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 200), seed=st.integers(0, 10**6), layers=st.integers(1, 8), exact=st.booleans())
def test_selection_bounds_hold_for_nested_selections(n, seed, layers, exact):
    """The host-side bounds from earlier (superset) selections are never below a selected position."""
    gen = torch.Generator().manual_seed(seed)
    bounds = SelectionBounds(n, torch.device("cpu"), exact=exact)
    current = torch.arange(n)
    for _ in range(layers):
        keep = torch.rand(current.numel(), generator=gen) < 0.8
        keep[-1] = True
        current = current[keep]
        upper = bounds.upper(current)
        bounds.record(current)
        assert len(upper) == current.numel()
        assert all(p <= u for p, u in zip(current.tolist(), upper, strict=True))
        assert list(upper) == sorted(upper)
        if exact:
            assert list(upper) == current.tolist()
    everything = torch.arange(n)  # not a subset of the last selection: still a valid bound per row
    assert all(p <= u for p, u in zip(everything.tolist(), bounds.upper(everything), strict=True))


def test_attention_probs_match_transformers_eager(llama_backend):
    b = llama_backend
    tokens = random_tokens(25, 256, seed=8)
    b.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            ref = b.model(tokens[None], output_attentions=True, output_hidden_states=True)
    finally:
        b.model.set_attn_implementation("sdpa")
    kv = b.prefill_chunk(tokens, None, 0).data
    index = torch.arange(25)
    for layer in range(b.spec.num_layers):
        probs = b.blend.attention_probs(layer, ref.hidden_states[layer], kv[layer, 0], index)
        torch.testing.assert_close(probs, ref.attentions[layer][0].float(), atol=1e-5, rtol=0)


_SHARED: dict[str, HFBackend] = {}


def _shared_llama() -> HFBackend:
    if "llama" not in _SHARED:
        _SHARED["llama"] = HFBackend(tiny_model("llama", layers=3), name="tiny-llama")
    return _SHARED["llama"]


# -- the fusor --------------------------------------------------------------------------------------


def test_ratio_one_equals_full_prefill(backend):
    chunks = _chunks([30, 17, 25])
    suffix = random_tokens(9, 256, seed=9)
    res = run_blend(backend, [chunks[2], chunks[0], chunks[1]], suffix, Blend(recompute_ratio=1.0))
    full, logits = backend.forward(res.tokens, None, 0, logits=True)
    torch.testing.assert_close(res.kv.data, full.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(res.logits, logits, atol=ATOL, rtol=0)
    assert res.stats.loaded_chunks == 3 and res.stats.recomputed == [81] * backend.spec.num_layers
    assert backend.generate(res.tokens, res.kv, 8) == backend.generate(res.tokens, None, 8)


def test_ratio_zero_reuses_rerotated_chunk_kv(backend):
    """Full reuse: every chunk row on layers >= 1 is the stored KV moved to its new position."""
    chunks = _chunks([12, 20], seed=20)
    suffix = random_tokens(5, 256, seed=21)
    res = run_blend(backend, chunks, suffix, Blend(recompute_ratio=0.0))
    second = backend.prefill_chunk(chunks[1], None, 0).data
    rows = res.kv.data[1:, :, :, 12:32]
    torch.testing.assert_close(rows[:, 1], second[1:, 1], atol=1e-6, rtol=0)
    torch.testing.assert_close(rows[:, 0], backend.rerotate_keys(second[1:, 0], 0, 12), atol=1e-6, rtol=0)
    # the first chunk is a true prefix, so its stored KV is exact; the suffix is recomputed on top
    full = backend.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data[:, :, :, :12], full[:, :, :, :12], atol=ATOL, rtol=0)
    assert (rows - full[1:, :, :, 12:32]).abs().max() > 1e-3  # reuse really differs from recompute
    assert res.stats.recomputed[1:] == [5] * (backend.spec.num_layers - 1)


def test_candidates_keep_their_fresh_kv(backend):
    """update_candidates: layer 1's candidates are all tokens, whose inputs (layer 0's outputs) are
    exact, so even at ratio 0 layer 1's KV is a full prefill's; deeper layers still reuse."""
    chunks = _chunks([12, 20], seed=20)
    suffix = random_tokens(5, 256, seed=21)
    res = run_blend(backend, chunks, suffix, Blend(recompute_ratio=0.0, update_candidates=True))
    reuse = run_blend(backend, chunks, suffix, Blend(recompute_ratio=0.0))
    full = backend.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data[:2], full[:2], atol=ATOL, rtol=0)
    assert (reuse.kv.data[1] - full[1]).abs().max() > 1e-3
    assert (res.kv.data[2:, :, :, 12:32] - full[2:, :, :, 12:32]).abs().max() > 1e-3
    assert res.stats.recomputed == reuse.stats.recomputed  # no extra layer compute


def _record_selections(backend, monkeypatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    original = backend.run_layer_selective

    def spy(layer, hidden, index, *args, **kwargs):
        seen.append(index.clone())
        return original(layer, hidden, index, *args, **kwargs)

    monkeypatch.setattr(backend, "run_layer_selective", spy)
    return seen


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    n_suffix=st.integers(0, 6),
    ratio=st.sampled_from([0.0, 0.1, 0.15, 0.3, 0.6, 1.0]),
    spread=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_pipeline_selection_properties(backend, monkeypatch, lengths, n_suffix, ratio, spread):
    """Sizes per layer follow the schedule, sets only narrow, the suffix is always recomputed."""
    chunks = _chunks(lengths, seed=sum(lengths))
    suffix = random_tokens(n_suffix, 256, seed=5)
    seen = _record_selections(backend, monkeypatch)
    policy = Blend(recompute_ratio=ratio, spread=spread)
    res = run_blend(backend, chunks, suffix, policy)
    monkeypatch.undo()
    n, n_layers = res.tokens.numel(), backend.spec.num_layers
    forced = set(range(n - n_suffix, n)) | {n - 1}
    n_reused = n - len(forced)
    sizes = selection_sizes(policy.schedule(ratio, n_layers), n_reused)
    assert len(seen) == n_layers - 1
    prev = set(range(n))
    for i, index in enumerate(seen):
        sel = set(index.tolist())
        assert index.tolist() == sorted(sel)
        assert forced <= sel
        assert sel <= prev
        assert len(sel - forced) == sizes[i]
        prev = sel
    assert res.stats.hkvd == sizes


@pytest.mark.parametrize("exact", [True, False])
def test_grouped_attention_in_the_pipeline_changes_nothing(backend, monkeypatch, exact):
    """The fusor's grouped attention, with exact positions (CPU) or the bounds from earlier layers'
    selections that CUDA uses, gives the blend of one masked call: exact at ratio 1, the same at 0.3."""
    chunks = _chunks([40, 33, 51], seed=30)
    suffix = random_tokens(7, 256, seed=31)
    one = {}
    monkeypatch.setattr(backend.blend, "attention_groups", 1)
    for ratio in (1.0, 0.3):
        one[ratio] = run_blend(backend, chunks, suffix, Blend(recompute_ratio=ratio))
    monkeypatch.setattr(backend.blend, "attention_groups", 6)
    monkeypatch.setattr(backend.blend, "group_rows", 4)
    monkeypatch.setattr(fuse, "SelectionBounds", functools.partial(SelectionBounds, exact=exact))
    calls = _record_groups(monkeypatch)
    for ratio in (1.0, 0.3):
        res = run_blend(backend, chunks, suffix, Blend(recompute_ratio=ratio))
        torch.testing.assert_close(res.kv.data, one[ratio].kv.data, atol=1e-5, rtol=0)
        torch.testing.assert_close(res.logits, one[ratio].logits, atol=1e-5, rtol=0)
    full, _ = backend.forward(res.tokens, None, 0, logits=True)
    torch.testing.assert_close(one[1.0].kv.data, full.data, atol=ATOL, rtol=0)
    n = res.tokens.numel()
    assert max(len(g) for g in calls) == 6  # the attention did run in groups
    # and the early groups skipped keys none of their rows could see
    assert all(g[0][2] < n for g in calls if len(g) > 1)


def _record_groups(monkeypatch) -> list[list[tuple[int, int, int]]]:
    import kvrestore.backends.hf_blend as hf_blend

    calls: list[list[tuple[int, int, int]]] = []

    def spy(*args, **kwargs):
        calls.append(row_groups(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(hf_blend, "row_groups", spy)
    return calls


def test_shared_prefix(backend):
    """Chunks saved after a shared prefix: ratio 1.0 is exact, ratio 0.0 reuses the after-prefix KV."""
    prefix = random_tokens(6, 256, seed=90)
    chunks = _chunks([11, 13], seed=91)
    suffix = random_tokens(4, 256, seed=92)

    async def go(ratio):
        async with Restorer(backend, MemoryStore()) as r:
            keys = [await r.save_chunk(c, prefix=prefix) for c in chunks]
            assert keys[0] != await r.save_chunk(chunks[0])  # the prefix is part of the key
            return await r.restore_blend(chunks[::-1], suffix, Blend(recompute_ratio=ratio), prefix=prefix)

    exact, reuse = anyio.run(go, 1.0), anyio.run(go, 0.0)
    assert exact.tokens[:6].tolist() == prefix.tolist() and exact.stats.loaded_chunks == 2
    full = backend.prefill_chunk(exact.tokens, None, 0).data
    torch.testing.assert_close(exact.kv.data, full, atol=ATOL, rtol=0)
    after_prefix = backend.prefill_chunk(torch.cat([prefix, chunks[0]]), None, 0).data[:, :, :, 6:]
    moved = reuse.kv.data[1:, :, :, 6 + 13 : 6 + 13 + 11]  # chunk 0 now comes second
    torch.testing.assert_close(moved[:, 1], after_prefix[1:, 1], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        moved[:, 0], backend.rerotate_keys(after_prefix[1:, 0], 6, 19), atol=1e-5, rtol=0
    )


def test_missing_chunk_is_recomputed(backend):
    """A chunk not in the store is forced: here the blend is then exact (the other is the prefix)."""
    chunks = _chunks([14, 18], seed=30)
    suffix = random_tokens(4, 256, seed=31)
    res = run_blend(backend, chunks, suffix, Blend(recompute_ratio=0.0), saved=[chunks[0]])
    assert res.stats.missing_chunks == [1] and res.stats.loaded_chunks == 1
    full = backend.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)


def _defer_checks(monkeypatch, **options) -> None:
    """Blend with the loader's device path, as on CUDA: sections checked by device checksums compared
    on the device, every layer placed at once, the flags read back once at the end (`verify`).
    `options`: the reader's others (`ahead`, `layers_per_read`)."""
    part = functools.partial(StoreChunkSource, defer_checks=True, **options)
    monkeypatch.setattr(fuse, "StoreChunkSource", part)


@pytest.mark.parametrize("deferred", [False, True], ids=["checked-per-layer", "deferred-checks"])
def test_corrupt_layer_restarts_without_the_chunk(llama_backend, tmp_path: Path, deferred, monkeypatch):
    if deferred:
        _defer_checks(monkeypatch)
    b = llama_backend
    chunks = _chunks([10, 16], seed=40)
    suffix = random_tokens(3, 256, seed=41)
    store_url = f"file://{tmp_path}"

    async def save():
        async with Restorer(b, open_store(store_url)) as r:
            for c in chunks:
                await r.save_chunk(c)

    anyio.run(save)
    key = chunk_key(b, chunks[1])
    path = next(p for p in tmp_path.rglob("*") if p.is_file() and key in p.name)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF  # the last layer's section: found only after the blend started
    path.write_bytes(bytes(blob))
    res = run_blend(b, chunks, suffix, Blend(recompute_ratio=0.0), store=open_store(store_url), saved=[])
    assert res.stats.missing_chunks == [1] and res.stats.restarts == 1
    assert any("checksum" in e for e in res.stats.errors)
    assert not path.exists()  # never served again
    full = b.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)
    if deferred:  # found by the device checksum of the last layer, once the whole blend was queued
        assert any(f"layer {b.spec.num_layers - 1}: device checksum mismatch" in e for e in res.stats.errors)


class DropsOutStore(MemoryStore):
    """A store whose server drops out part-way through a blend: after `ok_reads` range reads of chunk
    `key`'s layer sections, every read of it fails with a connection error (a fault only a wrapper
    around a real store can time this precisely)."""

    reads_sync = False  # type: ignore[assignment]  # read by async get_range, as a remote store is

    def __init__(self, ok_reads: int) -> None:
        super().__init__()
        self.key = ""
        self.ok_reads = ok_reads

    async def get_range(self, key, start, end):
        if key == self.key and start > 4096:  # a layer section, not the header probe
            if self.ok_reads <= 0:
                raise ConnectionResetError("server dropped the connection")
            self.ok_reads -= 1
        return await super().get_range(key, start, end)


@pytest.mark.parametrize("deferred", [False, True], ids=["checked-per-layer", "deferred-checks"])
def test_a_store_that_drops_out_mid_blend_degrades_to_recompute(llama_backend, deferred, monkeypatch):
    """Chunk 1's reads fail from its third layer on: the blend restarts with that chunk's tokens
    recomputed (never a half-loaded chunk), and the fault is logged in the stats."""
    if deferred:
        _defer_checks(monkeypatch)
    b = llama_backend
    chunks = _chunks([300, 300], seed=56)  # sections past the header probe
    suffix = random_tokens(3, 256, seed=57)
    store = DropsOutStore(ok_reads=1)
    store.key = chunk_key(b, chunks[1])
    res = run_blend(b, chunks, suffix, Blend(recompute_ratio=0.0), store=store)
    assert res.stats.missing_chunks == [1] and res.stats.restarts == 1 and res.stats.loaded_chunks == 1
    assert any("ConnectionResetError" in e for e in res.stats.errors)
    full = b.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["memory", "file", "async-store"])
@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_deferred_checks_give_the_same_blend(llama_backend, kind, ratio, tmp_path: Path, monkeypatch):
    """The loader's device path (deferred checks) places the same KV as the per-layer host path."""
    chunks = _chunks([40, 17, 64], seed=52)
    suffix = random_tokens(6, 256, seed=53)
    order = [chunks[2], chunks[0], chunks[1]]
    want = run_blend(llama_backend, order, suffix, Blend(recompute_ratio=ratio), saved=chunks)
    _defer_checks(monkeypatch)
    got = run_blend(
        llama_backend,
        order,
        suffix,
        Blend(recompute_ratio=ratio),
        store=_cuda_store(kind, tmp_path),
        saved=chunks,
    )
    assert got.stats.loaded_chunks == 3 and not got.stats.errors and got.stats.restarts == 0
    torch.testing.assert_close(got.kv.data, want.kv.data, atol=ATOL, rtol=0)
    assert got.stats.recomputed == want.stats.recomputed
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)


def test_a_deferred_check_reports_damage_only_at_verify(llama_backend):
    """With deferred checks a damaged section is placed like any other (nothing waits for its sum);
    `verify` then names the chunk and its first damaged layer, deletes the object, and is clear after."""
    b = llama_backend
    store = MemoryStore()
    chunks = _chunks([12, 20], seed=54)

    async def go():
        keys = [(await save_chunk(b, store, c))[0] for c in chunks]
        blob = bytearray(await store.get(keys[1]))
        blob[-5] ^= 0xFF  # in the last layer's section
        await store.put(keys[1], bytes(blob))
        source = StoreChunkSource(b, store, keys, [0, 12], [12, 20], defer_checks=True)
        assert await source.open() == [True, True]
        kv = KVCache(b.spec, torch.zeros((b.spec.num_layers, 2, b.spec.num_kv_heads, 32, b.spec.head_dim)))
        for layer in range(1, b.spec.num_layers):
            await source.load_layer(layer, kv)  # the damaged layer too: no error yet
        with pytest.raises(ChunkLoadFailed) as caught:
            await source.verify()
        await source.verify()  # the flags were read and cleared; chunk 1 is dropped
        return caught.value, source, await store.contains(keys)

    failed, source, present = anyio.run(go)
    assert failed.indices == [1] and f"layer {b.spec.num_layers - 1}" in failed.error
    assert source.unusable == [1] and present == [True, False]


def test_deferred_checks_keep_at_most_ahead_layers_in_flight(llama_backend):
    checks = DeferredChecks({}, 2, 12, torch.device("cpu"))
    for layers in [range(1, 2), range(2, 5), range(5, 8), range(8, 11)]:
        checks.throttle(5, len(layers))
        checks.start()
        checks.placed(layers)
        assert checks.in_flight <= 5
    assert checks.in_flight == 3  # the read of 3 layers waited for the two before it
    checks.throttle(2, 3)  # a read larger than `ahead` waits for everything, then goes alone
    assert checks.in_flight == 0
    assert checks.seconds(10) == 0.0 and checks.seconds(11) is None  # placed by the loader's own thread


def test_deferred_checks_hold_a_read_s_unowned_host_memory_until_it_is_placed():
    """A pinned store's object is uploaded from as it lies, and the host does not wait for the copy:
    the checks keep it alive until the read is known to be placed (the store may drop it meanwhile)."""
    checks = DeferredChecks({}, 1, 4, torch.device("cpu"))
    host = torch.zeros(64, dtype=torch.uint8)
    alive = weakref.ref(host)
    checks.start()
    checks.hold(host)
    checks.placed(range(1, 3))
    del host
    gc.collect()
    assert alive() is not None  # the read is in flight
    checks.throttle(1)  # waits for it
    gc.collect()
    assert alive() is None


CUDA_STORES = ["memory", "pinned-memory", "file", "async-store"]


def _cuda_store(kind: str, tmp_path: Path):
    if kind == "file":
        return open_store(f"file://{tmp_path}")
    if kind == "async-store":  # read by async get_range, not on lane threads
        return ThrottledStore(MemoryStore(), 1e10)
    return MemoryStore(pinned=kind == "pinned-memory")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", CUDA_STORES)
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_blend_on_cuda_equals_the_cpu_blend(kind, ratio, tmp_path: Path):
    """On CUDA the layers go up through pinned staging on the load stream, are checked there and
    re-rotated: the same KV as the CPU blend (full reuse) and as a full prefill (full recompute)."""
    cpu, got = _gpu_blend_checked("cuda", _cuda_store(kind, tmp_path), ratio)
    if ratio == 1.0:
        full = cpu.prefill_chunk(got.tokens, None, 0).data
        torch.testing.assert_close(got.kv.data.cpu(), full, atol=ATOL, rtol=0)


def _gpu_blend_checked(device: str, store, ratio: float):
    """A blend on `device` from `store`, checked against the same blend on the CPU: (CPU backend, result)."""
    cpu = HFBackend(tiny_model("llama", layers=4), name="tiny-llama-cuda")
    gpu = HFBackend(tiny_model("llama", layers=4).to(device), name="tiny-llama-cuda")
    chunks = _chunks([40, 17, 64], seed=50)
    suffix = random_tokens(6, 256, seed=51)
    order = [chunks[2], chunks[0], chunks[1]]
    want = run_blend(cpu, order, suffix, Blend(recompute_ratio=ratio), saved=chunks)
    got = run_blend(gpu, order, suffix, Blend(recompute_ratio=ratio), store=store, saved=chunks)
    assert got.kv.data.device == torch.empty(0, device=device).device  # "cuda" is cuda:0 here
    assert got.stats.loaded_chunks == 3 and not got.stats.errors
    torch.testing.assert_close(got.kv.data.cpu(), want.kv.data, atol=ATOL, rtol=0)
    assert got.stats.recomputed == want.stats.recomputed
    return cpu, got


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("ratio", [0.15, 1.0])
def test_blend_on_a_second_gpu_equals_the_cpu_blend(ratio, tmp_path: Path):
    """A model on cuda:1 while the calling thread's current device is cuda:0: the compute lane's events
    and waits must order cuda:1's streams (a worker thread starts on device 0)."""
    torch.cuda.set_device(0)
    _gpu_blend_checked("cuda:1", _cuda_store("file", tmp_path), ratio)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["file", "memory"])
def test_corrupt_layer_on_cuda_is_caught_by_the_device_checksum(kind, tmp_path: Path):
    b = HFBackend(tiny_model("llama", layers=4).to("cuda"), name="tiny-llama-cuda")
    chunks = _chunks([10, 16], seed=40)
    suffix = random_tokens(3, 256, seed=41)
    store = _cuda_store(kind, tmp_path)

    async def save():
        r = Restorer(b, store)
        for c in chunks:
            await r.save_chunk(c)
        key = chunk_key(b, chunks[1])
        blob = bytearray(await store.get(key))
        blob[-5] ^= 0xFF  # the last layer's section: found only after the blend started
        await store.put(key, bytes(blob))

    anyio.run(save)
    res = run_blend(b, chunks, suffix, Blend(recompute_ratio=0.0), store=store, saved=[])
    assert res.stats.missing_chunks == [1] and res.stats.restarts == 1
    assert any("checksum" in e for e in res.stats.errors)
    full = b.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)


def test_blend_with_recompute_is_closer_to_full_than_reuse(llama_backend):
    b = llama_backend
    chunks = _chunks([40, 40, 40], seed=50)
    suffix = random_tokens(6, 256, seed=51)
    full = b.prefill_chunk(torch.cat([*chunks, suffix]), None, 0).data

    def err(ratio, update):
        policy = Blend(recompute_ratio=ratio, update_candidates=update)
        return (run_blend(b, chunks, suffix, policy).kv.data - full).norm().item()

    errs = [err(r, False) for r in (0.0, 0.1, 0.5, 0.9)]
    assert errs[0] > errs[1] > errs[2] > errs[3]
    fresh = [err(r, True) for r in (0.0, 0.1, 0.5)]
    assert all(f < e for f, e in zip(fresh, errs, strict=False))  # the candidates' fresh K/V help


class HandshakeStore(MemoryStore):
    """Once `armed`, a read of layer L's section (L >= 2) records that it began (`loading[L]`), then
    waits until the compute of layer L-1 has begun (`computing[L-1]`): the read and that compute are
    then in flight together. A loader that read layer L only after layer L-1's compute would never
    start it while that compute waits for it (see the test), which the compute's bounded wait catches."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.section_layer: dict[int, int] = {}  # a section's offset in a chunk object -> its layer
        self.loading: collections.defaultdict[int, threading.Event] = collections.defaultdict(threading.Event)
        self.computing: collections.defaultdict[int, threading.Event] = collections.defaultdict(
            threading.Event
        )

    async def get_range(self, key, start, end):
        layer = self.section_layer.get(start) if self.armed else None
        if layer is not None and layer >= 2:
            self.loading[layer].set()
            await wait_until(self.computing[layer - 1].is_set)
        return await super().get_range(key, start, end)


def test_loading_next_layer_overlaps_recompute(monkeypatch):
    """While layer i is recomputed, layer i+1 is being loaded: each compute waits (bounded) until the
    next layer's read has begun, and that read waits until the compute has begun, so both are in
    flight at once; no clock is involved."""
    b = HFBackend(tiny_model("llama", layers=5), name="tiny-llama-5")
    chunks = _chunks([20, 20], seed=60)
    store = HandshakeStore()
    no_suffix = torch.zeros(0, dtype=torch.int64)
    anyio.run(_blend, b, store, chunks, chunks, no_suffix, Blend(recompute_ratio=1.0))
    blob = anyio.run(store.get, anyio.run(store.scan)[0].key)
    header, _ = codec.read_header(blob)
    store.section_layer = {section.offset: i for i, section in enumerate(header.layers)}
    overlapped: list[tuple[int, bool]] = []
    original = b.run_layer_selective

    def spy(layer, *args, **kwargs):
        store.computing[layer].set()
        if layer + 1 < b.spec.num_layers:
            overlapped.append((layer, store.loading[layer + 1].wait(timeout=10)))
        return original(layer, *args, **kwargs)

    monkeypatch.setattr(b, "run_layer_selective", spy)
    store.armed = True
    anyio.run(_blend, b, store, [], chunks, no_suffix, Blend(recompute_ratio=1.0))
    assert [layer for layer, _ in overlapped] == list(range(1, b.spec.num_layers - 1))
    assert all(ok for _, ok in overlapped), (
        f"a layer's load did not start during the layer before: {overlapped}"
    )


class HangingLayers(MemoryStore):
    """Headers read normally; every layer section after the first `free` hangs until cancelled."""

    def __init__(self, free: int) -> None:
        super().__init__()
        self.free = free
        self.section_reads = 0

    async def get_range(self, key, start, end):
        if end - start > 4096:  # a layer section, not a header probe
            self.section_reads += 1
            if self.section_reads > self.free:
                await anyio.sleep_forever()
        return await super().get_range(key, start, end)


def test_a_cancelled_blend_stops_its_compute_lane(monkeypatch):
    """Cancelled while the compute lane waits for a layer that never lands, the blend returns at the
    deadline and its worker thread stops at that layer instead of waiting, or computing, on."""
    b = HFBackend(tiny_model("llama", layers=6), name="tiny-llama-6")
    chunks = _chunks([20, 20], seed=61)
    store = HangingLayers(free=2 * 2)  # layers 1 and 2 of both chunks load, layer 3 never does
    computed: list[int] = []
    original = b.run_layer_selective

    def spy(layer, *args, **kwargs):
        computed.append(layer)
        return original(layer, *args, **kwargs)

    monkeypatch.setattr(b, "run_layer_selective", spy)

    async def main() -> bool:
        async with Restorer(b, store) as r:
            for c in chunks:
                await r.save_chunk(c)
            with anyio.move_on_after(1.0) as scope:
                await r.restore_blend(chunks, random_tokens(4, 256, seed=62), Blend(recompute_ratio=0.5))
            return scope.cancelled_caught

    outcome: list[bool] = []
    runner = threading.Thread(target=lambda: outcome.append(anyio.run(main)), daemon=True)
    runner.start()
    runner.join(timeout=60)  # a compute lane left waiting would hang the blend: fail, not hang, here
    assert not runner.is_alive(), "the cancelled blend never returned"
    assert outcome == [True]
    assert computed == [1, 2]  # nothing after the layer that never loaded, and the lane has returned


# ops that make the host wait for the device on CUDA (a scalar read, or a result whose size is data)
_SYNCING_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "unique_consecutive",
}


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.bool_indexing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name.startswith("index") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool
            for a in args
            if isinstance(a, list | tuple)
            for t in a
        ):
            self.bool_indexing += 1  # indexing with a boolean mask is a nonzero inside
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("split_min_work", [1 << 21, 1], ids=["groups", "block-causal-split"])
def test_selective_layers_never_wait_for_the_device(backend, monkeypatch, split_min_work):
    """Every op of the selective layers, run as on CUDA (bounds from earlier selections, grouped
    attention, split block-causally where enough keys allow), is one the host can queue without reading
    a result back: nothing like `.item()`, `int(t)`, `nonzero` or boolean-mask indexing between layer 1
    and the logits."""
    logs: list[_OpLog] = []
    monkeypatch.setattr(backend.blend, "split_min_work", split_min_work)
    monkeypatch.setattr(backend.blend, "attention_split", True)

    class SpyTimer(fuse.LayerTimer):
        def start(self):
            logs.append(_OpLog())
            logs[-1].__enter__()
            return super().start()

        def stop(self, i, mark, wait=False):
            super().stop(i, mark, wait)
            logs[-1].__exit__(None, None, None)

    monkeypatch.setattr(fuse, "LayerTimer", SpyTimer)
    monkeypatch.setattr(fuse, "SelectionBounds", functools.partial(SelectionBounds, exact=False))
    monkeypatch.setattr(backend.blend, "group_rows", 4)
    res = run_blend(backend, _chunks([40, 33, 51], seed=32), random_tokens(7, 256, seed=33), Blend())
    assert len(logs) == backend.spec.num_layers and res.stats.hkvd[0] > 0
    for i, log in enumerate(logs[1:], start=1):
        assert "sdpa" in " ".join(log.ops) or "scaled_dot_product" in " ".join(log.ops)
        assert not _SYNCING_OPS & set(log.ops), (
            f"layer {i} waits for the device: {_SYNCING_OPS & set(log.ops)}"
        )
        assert log.bool_indexing == 0, f"layer {i} indexes with a boolean mask"
    merged = any("lerp" in log.ops for log in logs[1:])  # merge_attention: a split group ran
    assert merged == (split_min_work == 1)


class _PlainBackend:
    """A `ComputeBackend` that prefills like the HF one but cannot re-rotate keys or recompute selected
    tokens (it forwards everything else to `inner`)."""

    def __init__(self, inner: HFBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_backend_that_cannot_blend_is_refused_before_any_work(backend):
    store = MemoryStore()
    restorer = Restorer(_PlainBackend(backend), store, learn=False)
    chunk = random_tokens(5, 16)
    with pytest.raises(InvalidInputError, match="CacheBlend needs a backend"):
        anyio.run(restorer.save_chunk, chunk)
    with pytest.raises(InvalidInputError, match="CacheBlend needs a backend"):
        anyio.run(restorer.restore_blend, [chunk], [1, 2])
    assert anyio.run(store.scan) == []  # nothing was computed or written


def test_auto_ratio_stays_within_bounds(backend):
    chunks = _chunks([16, 16], seed=70)
    res = run_blend(backend, chunks, random_tokens(3, 256), Blend(recompute_ratio=None, min_ratio=0.2))
    assert 0.2 <= res.stats.ratio <= 1.0


def test_bad_input_is_refused(backend):
    with pytest.raises(InvalidInputError):
        Blend(recompute_ratio=1.5)
    with pytest.raises(InvalidInputError):
        Blend(min_ratio=0.5, max_ratio=0.2)
    with pytest.raises(InvalidInputError, match="nothing to blend"):
        run_blend(backend, [], [])
    with pytest.raises(InvalidInputError, match="chunks must be a list"):
        run_blend(backend, "some text", [1, 2], saved=[])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        run_blend(backend, [[1, 2, 999]], [1], saved=[])


def test_save_chunk_uses_a_content_key(llama_backend):
    store = MemoryStore()
    chunk = random_tokens(9, 256, seed=80)

    async def go():
        async with Restorer(llama_backend, store) as r:
            k1 = await r.save_chunk(chunk)
            k2 = await r.save_chunk(chunk.tolist())
            return k1, k2

    k1, k2 = anyio.run(go)
    assert k1 == k2 == chunk_key(llama_backend, chunk) and len(store) == 1


# -- selection and schedule properties ----------------------------------------------------------------


@given(
    ratio=st.floats(0.0, 1.0),
    n_layers=st.integers(1, 64),
    spread=st.floats(0.0, 1.0),
)
def test_schedule_falls_and_averages_the_ratio(ratio, n_layers, spread):
    s = ratio_schedule(ratio, n_layers, spread)
    assert len(s) == n_layers - 1
    assert all(0.0 <= r <= 1.0 + 1e-12 for r in s)
    assert all(a >= b - 1e-12 for a, b in zip(s, s[1:], strict=False))
    if s:
        assert abs(sum(s) / len(s) - ratio) < 1e-9
    if len(s) > 1 and 1e-9 < ratio < 1.0 and spread > 0.01:  # (not a subnormal ratio: r x 1.25 == r)
        assert s[0] > s[-1]  # gradual filtering: r1 > ... > r_last


@given(
    dev=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=60),
    forced_bits=st.lists(st.booleans(), min_size=60, max_size=60),
    size=st.integers(0, 70),
)
def test_select_hkvd_keeps_forced_and_the_highest_deviation(dev, forced_bits, size):
    d = torch.tensor(dev)
    forced = torch.tensor(forced_bits[: len(dev)])
    keep = select_hkvd(d, forced, size)
    kept = set(keep.tolist())
    n_forced = int(forced.sum())
    assert select_hkvd(d, forced, size, n_forced=n_forced).tolist() == keep.tolist()  # no sync, same set
    assert keep.tolist() == sorted(kept)
    assert set(forced.nonzero().flatten().tolist()) <= kept
    free_kept = [i for i in kept if not forced[i]]
    n_free = int((~forced).sum())
    assert len(free_kept) == min(size, n_free)
    dropped = [i for i in range(len(dev)) if i not in kept]
    if free_kept and dropped:
        assert max(d[dropped].tolist()) <= min(d[free_kept].tolist())


@pytest.mark.parametrize("kind", ["kv", "k", "v"])
def test_stacked_deviation_is_the_squared_distance_of_the_parts(kind):
    g = torch.Generator().manual_seed(3)
    new, old = (
        torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64).to(torch.bfloat16) for _ in range(2)
    )
    diff = (new - old).double().square().sum(dim=(1, 3))  # [2, T]: K's, then V's (differenced in bf16)
    want = {"kv": diff[0] + diff[1], "k": diff[0], "v": diff[1]}[kind]
    got = stacked_kv_deviation(new, old, kind)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_deviation(new[0], new[1], old[0], old[1], kind), got, rtol=0, atol=0)
    with pytest.raises(InvalidInputError, match="deviation kind"):
        stacked_kv_deviation(new, old, "q")


def test_select_hkvd_never_lets_an_infinite_or_nan_deviation_displace_a_forced_token():
    d = torch.tensor([float("inf"), 1.0, float("nan"), 0.5, float("inf")])
    forced = torch.tensor([False, True, False, False, True])
    assert select_hkvd(d, forced, 1, n_forced=2).tolist() == [0, 1, 4]
    assert select_hkvd(d, forced, 0, n_forced=2).tolist() == [1, 4]


@given(st.lists(st.floats(0.0, 1.0), max_size=40).map(sorted).map(lambda x: x[::-1]), st.integers(0, 5000))
def test_selection_sizes_are_monotone_and_bounded(schedule, n_reused):
    sizes = selection_sizes(schedule, n_reused)
    assert len(sizes) == len(schedule)
    assert all(0 <= s <= n_reused for s in sizes)
    assert all(a >= b for a, b in zip(sizes, sizes[1:], strict=False))


# -- the loading controller ---------------------------------------------------------------------------


@given(
    load=st.floats(0.0, 10.0, allow_subnormal=False), prefill=st.floats(1e-6, 10.0), floor=st.floats(0.0, 1.0)
)
def test_choose_ratio_hides_recompute_behind_loading_above_the_floor(load, prefill, floor):
    r = choose_ratio(load, prefill, floor=floor)
    assert floor <= r <= 1.0
    if r > floor:  # above the floor, recompute never exceeds loading
        assert recompute_seconds_per_layer(r, prefill) <= load * (1 + 1e-9)
    if floor < r < 1.0:
        assert recompute_seconds_per_layer(r, prefill) == pytest.approx(load)


def test_choose_ratio_examples():
    # the paper's Llama-7B example: 15% takes 3 ms, a layer loads in 16 ms from NVMe -> recompute more
    assert choose_ratio(0.016, 0.020) == pytest.approx(0.8)
    # Llama-70B: 15% takes 7 ms but loading only 4 ms -> stay at the floor
    assert choose_ratio(0.004, 0.7 / 15, floor=0.15) == 0.15
    assert choose_ratio(1.0, 0.1) == 1.0


def test_choose_store_picks_the_cheapest_that_adds_no_delay():
    per_token = 46_080 / 30  # SmolLM2 KV bytes per token per layer
    options = [
        StoreOption("ram", 20e9, 5.0),
        StoreOption("nvme", 2e9, 0.1),
        StoreOption("s3", 0.05e9, 0.02),
    ]
    budget = recompute_seconds_per_layer(0.15, 0.030)  # 4.5 ms per layer
    nvme_load = load_seconds_per_layer(per_token, 4096, 2e9)
    s3_load = load_seconds_per_layer(per_token, 4096, 0.05e9)
    assert nvme_load <= budget < s3_load
    assert choose_store(options, 0.15, 4096, per_token, 0.030).name == "nvme"
    # nothing is fast enough: the fastest
    assert choose_store(options, 0.15, 4096, per_token, 1e-6).name == "ram"
    with pytest.raises(InvalidInputError):
        choose_store([], 0.15, 4096, per_token, 0.01)

    # a round trip counts: a store with the bandwidth but a slow round trip adds delay
    laggy = StoreOption("laggy", 20e9, 0.01, latency_s=0.010)
    assert choose_store([*options, laggy], 0.15, 4096, per_token, 0.030).name == "nvme"


def _placement(be, candidates, **kw):
    return anyio.run(lambda: choose_blend_store(be, candidates, **kw))


def test_choose_blend_store_measures_the_stores_and_picks_the_cheapest_that_hides():
    be = HFBackend(tiny_model("llama", layers=2), name="tiny")
    n = 1024  # one layer of KV: 256 KB
    ram, remote = MemoryStore(), MemoryStore()
    candidates = [
        StoreCandidate("ram", ram, 5.0),
        StoreCandidate("remote", ThrottledStore(remote, bytes_per_s=2e6), 0.02),  # ~0.13 s a layer
    ]
    # recomputing 15% of a 4 s layer hides a 0.13 s load: the cheap, slow store
    slow_model = _placement(be, candidates, n_tokens=n, layer_cost=LayerCost(4.0, 0.0, 0.0))
    assert slow_model.candidate.name == "remote" and not slow_model.adds_delay
    assert 1e6 < slow_model.options[1].bandwidth_bytes_per_s < 3e6  # the throttle, measured
    assert slow_model.options[0].bandwidth_bytes_per_s > 20e6
    # 15% of a 0.1 s layer is 15 ms: only RAM hides
    fast_model = _placement(be, candidates, n_tokens=n, layer_cost=LayerCost(0.1, 0.0, 0.0))
    assert fast_model.candidate.name == "ram" and not fast_model.adds_delay
    # nothing to hide behind: the fastest, and it says so
    instant = _placement(be, candidates, n_tokens=n, ratio=0.0, layer_cost=LayerCost(0.1, 0.0, 0.0))
    assert instant.candidate.name == "ram" and instant.adds_delay
    text = slow_model.explain()
    assert "remote" in text and "<- chosen" in text and "hides" in text
    # the test objects are gone
    assert anyio.run(ram.scan) == [] and anyio.run(remote.scan) == []


def test_restorer_choose_blend_store_times_the_model_without_a_profile(tmp_path):
    be = HFBackend(tiny_model("llama", layers=2), name="tiny")
    disk = open_store(f"file://{tmp_path}")

    async def choose():
        async with Restorer(be, MemoryStore()) as r:
            assert r.planner.profile is None
            return await r.choose_blend_store([StoreCandidate("disk", disk, 0.1)], n_tokens=256)

    placement = anyio.run(choose)
    assert placement.candidate.name == "disk"
    assert placement.recompute_s_per_layer > 0  # 15% of a layer the model was timed running


def test_choose_blend_store_rejects_bad_input():
    be = HFBackend(tiny_model("llama", layers=2), name="tiny")
    store = MemoryStore()
    with pytest.raises(InvalidInputError, match="no candidate"):
        _placement(be, [], n_tokens=100)
    with pytest.raises(InvalidInputError, match="names must differ"):
        _placement(be, [StoreCandidate("a", store, 1.0), StoreCandidate("a", store, 2.0)], n_tokens=100)
    with pytest.raises(InvalidInputError, match="n_tokens"):
        _placement(be, [StoreCandidate("a", store, 1.0)], n_tokens=0)
    with pytest.raises(InvalidInputError, match="ratio"):
        _placement(be, [StoreCandidate("a", store, 1.0)], n_tokens=10, ratio=1.5)


# -- the real model -----------------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_ratio_one_equals_full_prefill(smollm2):
    ids = reference_tokens(smollm2.tokenizer, 240)
    chunks = [torch.tensor(ids[i : i + 80]) for i in (80, 0, 160)]
    suffix = smollm2.tokenizer("\nWhat is this about?\n")["input_ids"]
    res = run_blend(smollm2, chunks, suffix, Blend(recompute_ratio=1.0))
    full, logits = smollm2.forward(res.tokens, None, 0, logits=True)
    torch.testing.assert_close(res.kv.data, full.data, atol=2e-3, rtol=0)
    torch.testing.assert_close(res.logits, logits, atol=2e-3, rtol=0)
    assert smollm2.generate(res.tokens, res.kv, 8) == smollm2.generate(res.tokens, None, 8)
    partial = run_blend(smollm2, chunks, suffix, Blend(recompute_ratio=0.15))
    assert partial.stats.loaded_chunks == 3 and partial.stats.hkvd[0] > partial.stats.hkvd[-1] > 0


# -- block-causal split of the selected rows' attention ------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    picks=st.lists(st.booleans(), min_size=80, max_size=80),
    groups=st.integers(1, 6),
    slack=st.integers(0, 20),
)
def test_block_causal_split_equals_one_masked_call(picks, groups, slack):
    """Each group of selected rows split into the keys all its rows see (no mask) and the rest (masked),
    joined by their log-sum-exps, computes the layer of one masked call over all keys, with the exact
    positions or any looser bounds of them; and with bounds that allow it, groups do split."""
    b = HFBackend(tiny_model("llama", layers=1), name="tiny-llama")
    n = len(picks)
    tokens = random_tokens(n, 256, seed=9)
    hidden = b.embed(tokens)
    _, k, v = b.run_layer(0, hidden, None, None, torch.arange(n))
    index = torch.tensor([i for i, p in enumerate(picks) if p] or [n - 1])
    upper = [min(n - 1, p + slack) for p in index.tolist()]
    lower = [max(0, p - slack) for p in index.tolist()]
    one = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone())
    b.blend.attention_groups, b.blend.group_rows, b.blend.split_min_work = groups, 2, 1
    b.blend.attention_split = True  # on a CPU too (by default it splits on CUDA only)
    splits = []
    real = b.blend._attention_split
    b.blend._attention_split = lambda *a: splits.append(a[-1]) or real(*a)  # type: ignore[method-assign]
    got = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=upper, lower=lower)
    for x, y in zip(got, one, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    assert all(c > 0 and c % MASK_ALIGNMENT == 0 for c in splits)
    if lower[0] >= MASK_ALIGNMENT:  # the first group's rows all see a whole aligned block: it splits
        assert splits and splits[0] == lower[0] // MASK_ALIGNMENT * MASK_ALIGNMENT


def test_split_without_lower_bounds_or_below_the_minimum_is_the_grouped_call():
    """No lower bounds, the split turned off (or left to its default on a CPU), or fewer unmasked
    (row, key) pairs than `split_min_work`: every group takes the masked call, bit for bit the
    grouped attention as it was; at the minimum exactly, the group that reaches it splits."""
    b = HFBackend(tiny_model("llama", layers=1), name="tiny-llama")
    n = 96
    hidden = b.embed(random_tokens(n, 256, seed=10))
    _, k, v = b.run_layer(0, hidden, None, None, torch.arange(n))
    index = torch.arange(40, n, 3)
    pos = index.tolist()
    b.blend.attention_groups, b.blend.group_rows = 2, 2
    called = []
    real = b.blend._attention_split
    b.blend._attention_split = lambda *a: called.append(a[-1]) or real(*a)  # type: ignore[method-assign]
    b.blend.attention_split = True
    grouped = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=pos)
    b.blend.attention_split = None  # the default: CUDA only
    default = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=pos, lower=pos)
    b.blend.split_min_work = 1  # the groups' unmasked parts: 10 rows x 32 keys, 9 rows x 64 keys
    b.blend.attention_split = False
    off = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=pos, lower=pos)
    b.blend.attention_split = True
    b.blend.split_min_work = 577
    below = b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=pos, lower=pos)
    assert not called
    for x, y, z, w in zip(grouped, off, below, default, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z) and torch.equal(x, w)
    b.blend.split_min_work = 576
    b.run_layer_selective(0, hidden[:, index], index, k.clone(), v.clone(), upper=pos, lower=pos)
    assert called == [64]  # the second group only


@pytest.mark.parametrize("exact", [True, False])
def test_split_attention_in_the_pipeline_is_exact(backend, monkeypatch, exact):
    """The fusor with the block-causal split (lower bounds from the exact positions on a CPU, or from
    earlier layers' selections as on CUDA) gives the blend of the unsplit grouped attention, and at
    100% recompute the full prefill's KV and logits."""
    chunks = _chunks([48, 40, 56], seed=40)
    suffix = random_tokens(9, 256, seed=41)
    monkeypatch.setattr(backend.blend, "attention_groups", 4)
    monkeypatch.setattr(backend.blend, "group_rows", 4)
    monkeypatch.setattr(fuse, "SelectionBounds", functools.partial(SelectionBounds, exact=exact))
    monkeypatch.setattr(backend.blend, "attention_split", False)
    unsplit = {r: run_blend(backend, chunks, suffix, Blend(recompute_ratio=r)) for r in (1.0, 0.3)}
    monkeypatch.setattr(backend.blend, "attention_split", True)
    monkeypatch.setattr(backend.blend, "split_min_work", 1)
    splits = []
    real = backend.blend._attention_split
    monkeypatch.setattr(backend.blend, "_attention_split", lambda *a: splits.append(a[-1]) or real(*a))
    for ratio in (1.0, 0.3):
        res = run_blend(backend, chunks, suffix, Blend(recompute_ratio=ratio))
        torch.testing.assert_close(res.kv.data, unsplit[ratio].kv.data, atol=1e-5, rtol=0)
        torch.testing.assert_close(res.logits, unsplit[ratio].logits, atol=1e-5, rtol=0)
    assert splits and all(c > 0 and c % MASK_ALIGNMENT == 0 for c in splits)
    full, logits = backend.forward(res.tokens, None, 0, logits=True)
    whole = run_blend(backend, chunks, suffix, Blend(recompute_ratio=1.0))
    torch.testing.assert_close(whole.kv.data, full.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(whole.logits, logits, atol=ATOL, rtol=0)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 60), seed=st.integers(0, 1000), layers=st.integers(1, 5), exact=st.booleans())
def test_selection_lower_bounds_hold_for_nested_selections(n, seed, layers, exact):
    """The host-side lower bounds from earlier (superset) selections are never above a selected
    position, and never decrease."""
    gen = torch.Generator().manual_seed(seed)
    bounds = SelectionBounds(n, torch.device("cpu"), exact=exact)
    current = torch.arange(n)
    for _ in range(layers):
        keep = torch.rand(current.numel(), generator=gen) < 0.7
        keep[-1] = True
        current = current[keep]
        bounds.upper(current)
        lower = bounds.lower(current)
        bounds.record(current)
        assert len(lower) == current.numel()
        assert all(lo <= p for p, lo in zip(current.tolist(), lower, strict=True))
        assert list(lower) == sorted(lower)
        if exact:
            assert list(lower) == current.tolist()


def test_merge_attention_joins_two_key_sets():
    """Attention over keys [0, c) and [c, n) with their log-sum-exps merges into attention over all n,
    an additive mask on the second part included."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, m, 8, generator=gen) for m in (5, 20, 20))
    seen = torch.rand(5, 20, generator=gen) < 0.6
    seen[:, 12] = True
    bias = torch.zeros(5, 20).masked_fill_(~seen, float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=0.3)
    out_a, lse_a = attention_lse(q, k[:, :, :12], v[:, :, :12], bias[:, :12], 0.3)
    out_b, lse_b = attention_lse(q, k[:, :, 12:], v[:, :, 12:], bias[:, 12:], 0.3)
    ref_lse = (q @ k[:, :, :12].transpose(-1, -2) * 0.3 + bias[:, :12]).logsumexp(-1)
    torch.testing.assert_close(lse_a, ref_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(merge_attention(out_a, lse_a, out_b, lse_b), want, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_attention_on_cuda_equals_the_masked_call(dtype):
    """On CUDA the split's kernels (flash without a mask, the memory-efficient one with it, SDPA's
    internal ops) pass the backend's own check and give the masked call's attention on a group of
    Llama-sized heads."""
    b = HFBackend(tiny_model("llama", layers=1), name="tiny-llama")
    b.blend._n_heads, b.blend._n_kv, b.blend._head_dim, b.blend._scaling = 8, 8, 128, 128**-0.5
    device = torch.device("cuda")
    assert b.blend._split_attention_works(device, dtype)
    gen = torch.Generator().manual_seed(5)
    n = 2000
    index = torch.cat([torch.tensor([700]), 701 + torch.randperm(n - 701, generator=gen)[:300].sort().values])
    q, k, v = (torch.randn(1, 8, m, 128, generator=gen).to(device, dtype) for m in (index.numel(), n, n))
    mask = selected_rows_mask(index.to(device), n, dtype, additive=True)
    with without_cudnn_attention():
        want = b.blend._attention_masked(q, k, v, mask)
        got = b.blend._attention_split(q, k, v, mask, 688)
    torch.testing.assert_close(
        got.float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_blend_on_cuda_equals_the_unsplit_one(dtype):
    """The fusor on CUDA with the block-causal split on every group that allows it (bounds from earlier
    layers' selections, as CUDA has them) gives the blend of one masked call per group: at full
    recompute, and in float32 at partial recompute too (in bf16 a rounding may pick another token)."""
    b = HFBackend(tiny_model("llama", layers=4).to("cuda", dtype), name="tiny-llama-cuda")
    b.blend.attention_groups, b.blend.group_rows = 4, 4
    assert b.blend._split_attention_works(
        torch.device("cuda"), dtype
    )  # else every group takes the masked call
    chunks = _chunks([48, 40, 56], seed=60)
    suffix = random_tokens(9, 256, seed=61)
    ratios = (1.0, 0.3) if dtype == torch.float32 else (1.0,)
    got = {}
    for split in (False, True):
        b.blend.attention_split, b.blend.split_min_work = split, 1
        got[split] = {r: run_blend(b, chunks, suffix, Blend(recompute_ratio=r)) for r in ratios}
    atol = ATOL if dtype == torch.float32 else 5e-2
    for r in ratios:
        torch.testing.assert_close(
            got[True][r].kv.data.float(), got[False][r].kv.data.float(), atol=atol, rtol=0
        )
        assert got[True][r].stats.recomputed == got[False][r].stats.recomputed
