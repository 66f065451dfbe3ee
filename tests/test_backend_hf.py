"""The manual decoder-layer loop equals transformers' own forward, on tiny Llama/Qwen2/Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from kvrestore import KVCache
from kvrestore.backends.hf import HFBackend
from kvrestore.errors import InvalidInputError, UnsupportedModelError

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
