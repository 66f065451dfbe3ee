"""The manual decoder-layer loop equals transformers' own forward, on tiny Llama/Qwen2/Qwen3 models."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrestore import KVCache
from kvrestore.backends.attention import SharedSdpaRestriction
from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import InvalidInputError, UnsupportedModelError

from .conftest import random_tokens, tiny_model

ATOL = 1e-5


def hf_reference(backend: HFBackend, tokens: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    with torch.inference_mode():
        out = backend.model(tokens[None], use_cache=True)
    return KVCache.from_hf(backend.spec, out.past_key_values), out.logits[0, -1]


def test_full_prefill_equals_hf(tiny_backend):
    tokens = random_tokens(97, tiny_backend.spec.vocab_size)
    ref, ref_logits = hf_reference(tiny_backend, tokens)
    chunk, logits = tiny_backend.forward(tokens, None, 0, logits=True)
    torch.testing.assert_close(chunk.data, ref.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [1, 16, 40])
def test_chunked_prefill_equals_full(tiny_backend, chunk):
    tokens = random_tokens(100, tiny_backend.spec.vocab_size, seed=1)
    ref, _ = hf_reference(tiny_backend, tokens)
    kv = KVCache.empty(tiny_backend.spec, len(tokens))
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        kv.write(tiny_backend.prefill_chunk(part, kv.prefix(start) if start else None, start))
    torch.testing.assert_close(kv.data, ref.data, atol=ATOL, rtol=0)


def test_run_layer_by_layer_equals_prefill(llama_backend):
    b = llama_backend
    tokens = random_tokens(30, b.spec.vocab_size)
    full = b.prefill_chunk(tokens, None, 0)
    hidden = b.embed(tokens)
    positions = torch.arange(len(tokens))
    for layer in range(b.spec.num_layers):
        hidden, k, v = b.run_layer(layer, hidden, None, None, positions)
        torch.testing.assert_close(k, full.data[layer, 0], atol=ATOL, rtol=0)
        torch.testing.assert_close(v, full.data[layer, 1], atol=ATOL, rtol=0)


def test_generate_from_restored_cache_matches_plain(tiny_backend):
    tokens = random_tokens(64, tiny_backend.spec.vocab_size, seed=2)
    kv = KVCache.empty(tiny_backend.spec, len(tokens))
    kv.write(tiny_backend.prefill_chunk(tokens, None, 0))
    plain = tiny_backend.generate(tokens, None, max_new_tokens=8)
    cached = tiny_backend.generate(tokens, kv, max_new_tokens=8)
    assert cached == plain
    assert len(plain) == 8


def test_fingerprint_separates_models_and_dtypes():
    a = HFBackend(tiny_model("llama", seed=0))
    b = HFBackend(tiny_model("llama", seed=1))
    c = HFBackend(tiny_model("llama", seed=0), dtype=torch.bfloat16)
    d = HFBackend(tiny_model("llama", seed=0))
    assert a.spec.fingerprint == d.spec.fingerprint
    assert len({a.spec.fingerprint, b.spec.fingerprint, c.spec.fingerprint}) == 3
    assert c.spec.dtype == torch.bfloat16


def test_validate_tokens(llama_backend):
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        llama_backend.validate_tokens(torch.tensor([1, 2, 256]))
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        llama_backend.validate_tokens(torch.tensor([-1]))


def test_unsupported_model_is_refused():
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        HFBackend(transformers.GPT2LMHeadModel(config))


def test_fingerprint_ignores_where_the_model_was_loaded_from(tmp_path):
    model = tiny_model("llama")
    a = HFBackend(model).spec.fingerprint
    model.config._name_or_path = str(tmp_path / "elsewhere")
    model.config.transformers_version = "0.0.0"
    assert HFBackend(model).spec.fingerprint == a
    model.config.rms_norm_eps = 1e-3  # what the model computes does count
    assert HFBackend(model).spec.fingerprint != a


# -- prefill_into: computing straight into a KVCache's buffer --------------------------------------


def _prefill_into_chunks(backend: HFBackend, tokens: torch.Tensor, sizes: list[int], extra: int = 0):
    """Prefill `tokens` chunk by chunk into one cache (with `extra` unused tokens after them, filled with
    a sentinel); returns the cache buffer and the last chunk's logits."""
    cache = KVCache.empty(backend.spec, len(tokens) + extra).data.fill_(7.0)
    start, logits = 0, None
    for n in sizes:
        last = start + n == len(tokens)
        logits = backend.prefill_into(tokens[start : start + n], cache, start, logits=last)
        assert (logits is not None) == last
        start += n
    assert start == len(tokens)
    return cache, logits


@pytest.mark.parametrize("sizes", [[100], [1, 7, 16, 33, 43], [40, 1, 59]])
def test_prefill_into_chunk_by_chunk_equals_full_prefill(tiny_backend, sizes):
    """Uneven chunks, grouped-query heads (4 query, 2 KV), Qwen2 biases and Qwen3 q/k norms."""
    tokens = random_tokens(100, tiny_backend.spec.vocab_size, seed=3)
    ref, ref_logits = hf_reference(tiny_backend, tokens)
    cache, logits = _prefill_into_chunks(tiny_backend, tokens, sizes, extra=5)
    torch.testing.assert_close(cache[:, :, :, :100], ref.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert int(logits.argmax()) == int(ref_logits.argmax())
    assert bool((cache[:, :, :, 100:] == 7.0).all())  # nothing after `end` is written


def test_prefill_into_equals_forward(tiny_backend):
    tokens = random_tokens(50, tiny_backend.spec.vocab_size, seed=4)
    past = tiny_backend.prefill_chunk(tokens[:20], None, 0).data
    chunk, fwd_logits = tiny_backend.forward(tokens[20:], past, 20, logits=True)
    cache = torch.zeros((*past.shape[:3], 50, past.shape[4]), dtype=past.dtype)
    cache[:, :, :, :20] = past
    logits = tiny_backend.prefill_into(tokens[20:], cache, 20, logits=True)
    torch.testing.assert_close(cache[:, :, :, 20:], chunk.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, fwd_logits, atol=1e-5, rtol=0)


def test_prefill_into_leaves_the_past_untouched(llama_backend):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=5)
    cache = KVCache.empty(b.spec, 64).data.zero_()
    cache[:, :, :, :40] = b.prefill_chunk(tokens[:40], None, 0).data
    before = cache.clone()
    assert b.prefill_into(tokens[40:52], cache, 40) is None
    assert torch.equal(cache[:, :, :, :40], before[:, :, :, :40])
    assert torch.equal(cache[:, :, :, 52:], before[:, :, :, 52:])
    assert not torch.equal(cache[:, :, :, 40:52], before[:, :, :, 40:52])


def test_prefill_into_refuses_a_cache_that_does_not_fit(llama_backend):
    b = llama_backend
    spec = b.spec
    tokens = random_tokens(10, spec.vocab_size)
    good = (spec.num_layers, 2, spec.num_kv_heads, 32, spec.head_dim)
    with pytest.raises(InvalidInputError, match=r"cache holds 32 tokens.*needs \[30, 40\)"):
        b.prefill_into(tokens, torch.zeros(good), 30)
    with pytest.raises(InvalidInputError, match="start must be >= 0"):
        b.prefill_into(tokens, torch.zeros(good), -1)
    with pytest.raises(InvalidInputError, match="no tokens"):
        b.prefill_into(tokens[:0], torch.zeros(good), 0)
    wrong_heads = (spec.num_layers, 2, spec.num_kv_heads + 1, 32, spec.head_dim)
    with pytest.raises(InvalidInputError, match="does not fit tiny-llama: expected"):
        b.prefill_into(tokens, torch.zeros(wrong_heads), 0)
    with pytest.raises(InvalidInputError, match="does not fit"):
        b.prefill_into(tokens, torch.zeros(good[1:]), 0)  # no layer axis
    with pytest.raises(InvalidInputError, match="torch.bfloat16 on cpu; the model computes torch.float32"):
        b.prefill_into(tokens, torch.zeros(good, dtype=torch.bfloat16), 0)


def test_attention_plan_takes_the_bias_path_only_on_cuda(llama_backend):
    from kvrestore.backends.attention import _SDPA_GQA, attention_plan

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert attention_plan("cpu", f32, 64, 0, True) == ("causal", not _SDPA_GQA)
    assert attention_plan("cpu", f32, 64, 10, True) == ("mask", not _SDPA_GQA)
    assert attention_plan("cpu", bf16, 64, 10, False) == ("mask", False)
    assert attention_plan("cuda", bf16, 128, 0, True) == ("causal", not _SDPA_GQA)
    assert attention_plan("cuda", f32, 128, 10, False) == ("lower_right", False)
    # flash attention takes grouped K/V heads as they are; in float32 (or heads over 256) CausalBias
    # runs the memory-efficient kernel, which has no GQA: the heads are expanded first
    assert attention_plan("cuda", bf16, 128, 10, True) == ("lower_right", not _SDPA_GQA)
    assert attention_plan("cuda", f16, 64, 10, True) == ("lower_right", not _SDPA_GQA)
    assert attention_plan("cuda", f32, 128, 10, True) == ("lower_right", True)
    assert attention_plan("cuda", bf16, 512, 10, True) == ("lower_right", True)
    assert llama_backend.attention_plan(10)[0] == "mask"  # on CPU, never the bias path
    assert llama_backend.attention_plan(0)[0] == "causal"


@pytest.mark.parametrize("expand", [False, True])
def test_lower_right_bias_path_computes_the_same_kv(tiny_backend, monkeypatch, expand):
    """The CUDA attention branch (a lower-right CausalBias, GQA heads as they are or expanded), forced on
    CPU, where CausalBias falls back to a materialized mask: checks how the branch calls SDPA."""
    import warnings

    b = tiny_backend
    tokens = random_tokens(60, b.spec.vocab_size, seed=6)
    ref, _ = hf_reference(b, tokens)
    real = b.attention_plan
    monkeypatch.setattr(b, "attention_plan", lambda n_past: ("lower_right", expand) if n_past else real(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CausalBias warns that no fused kernel runs on CPU
        cache, _ = _prefill_into_chunks(b, tokens, [13, 20, 27])
    torch.testing.assert_close(cache, ref.data, atol=ATOL, rtol=0)


def _sdpa_flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


def _overlapping(enter: Callable[[], contextlib.AbstractContextManager]) -> tuple[bool, bool, bool, bool]:
    """Two threads hold `enter()` in the order A in, B in, A out, B out; the flags after both left."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def thread_a() -> None:
        with enter():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def thread_b() -> None:
        a_in.wait(5)
        with enter():
            b_in.set()
            a_out.wait(5)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return _sdpa_flags()


def test_shared_sdpa_restriction_restores_flags_when_threads_overlap():
    before = _sdpa_flags()
    assert before[0], "flash attention is enabled by default"
    restriction = SharedSdpaRestriction([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    with restriction():
        with restriction():  # nested in one thread too
            assert _sdpa_flags() == (False, True, True, False)
        assert _sdpa_flags() == (False, True, True, False)  # still held
    assert _sdpa_flags() == before
    assert _overlapping(restriction) == before
    # what it guards against: plain sdpa_kernel blocks overlapping across threads leave flash off for good
    try:
        leaked = _overlapping(lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
        assert leaked != before
    finally:
        torch.backends.cuda.enable_flash_sdp(before[0])
        torch.backends.cuda.enable_mem_efficient_sdp(before[1])
        torch.backends.cuda.enable_math_sdp(before[2])
        torch.backends.cuda.enable_cudnn_sdp(before[3])
    assert _sdpa_flags() == before
