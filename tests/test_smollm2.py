"""Integration on the real model: SmolLM2-135M-Instruct, 2048 tokens of real text.

Tolerance: KV within 1e-3 absolute of a plain transformers prefill (`model(input_ids)`), fp32 on CPU
(restores run the same kernels on different chunkings, so float summation order differs a little), and
16 greedy tokens generated from the restored cache identical to those generated without any cache.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore import ComputeOnly, KVCache, LoadOnly, Restorer, TokenTwoPointer, open_store
from kvrestore.core.keys import chunk_keys
from kvrestore.stores import ThrottledStore
from kvrestore.tools.text import reference_tokens

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_TOKENS = 2048
KV_ATOL = 1e-3


@pytest.fixture(scope="module")
def prompt(smollm2):
    tokens = torch.tensor(reference_tokens(smollm2.tokenizer, N_TOKENS))
    with torch.inference_mode():
        out = smollm2.model(tokens[None], use_cache=True)
    reference = KVCache.from_hf(smollm2.spec, out.past_key_values)
    question = smollm2.tokenizer("\nQuestion: what does the with statement guarantee?\nAnswer:")["input_ids"]
    full = torch.cat([tokens, torch.tensor(question)])
    greedy = smollm2.generate(full, None, max_new_tokens=16)
    return tokens, reference, full, greedy


def test_smollm2_loads_from_its_cached_checkpoint(smollm2, monkeypatch):
    """A second load reads the cached safetensors checkpoint: it never converts the GGUF again (how long
    a load takes is no business of a test)."""
    import transformers

    from kvrestore.backends.hf import HFBackend

    loads = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loads.append(kwargs.get("gguf_file"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    again = HFBackend.from_smollm2(dtype=torch.float32)
    assert loads and all(g is None for g in loads), loads  # loaded, and never from the GGUF
    assert again.spec.fingerprint == smollm2.spec.fingerprint
    assert again.spec.num_layers == 30 and again.spec.num_kv_heads == 3 and again.spec.head_dim == 64


@pytest.mark.parametrize("policy", [ComputeOnly(), ComputeOnly(unit_chunks=1), LoadOnly()], ids=repr)
def test_restore_equals_plain_prefill_and_generates_identically(smollm2, prompt, tmp_path, policy):
    tokens, reference, full, greedy = prompt

    async def main():
        r = Restorer(smollm2, open_store(f"file://{tmp_path}"), chunk_size=256)
        await r.save(tokens, kv=reference)
        return await r.restore(tokens, policy)

    res = anyio.run(main)
    assert res.stats.n_chunks == N_TOKENS // 256
    if isinstance(policy, LoadOnly):
        assert res.stats.loaded_chunks == res.stats.n_chunks
    else:
        assert res.stats.computed_chunks == res.stats.n_chunks
    torch.testing.assert_close(res.kv.data, reference.data, atol=KV_ATOL, rtol=0)
    assert smollm2.generate(full, res.kv, max_new_tokens=16) == greedy


@pytest.fixture(scope="module")
def balance(smollm2, prompt, tmp_path_factory):
    """A saved copy of the prompt and the bandwidth at which loading it takes as long as computing it."""
    tokens, reference, _, _ = prompt
    store = open_store(f"file://{tmp_path_factory.mktemp('balance')}")

    async def main():
        r = Restorer(smollm2, store, chunk_size=256)
        saved = await r.save(tokens, kv=reference)
        res = await r.restore(tokens, ComputeOnly())
        return saved.bytes_written / res.stats.seconds

    return store, anyio.run(main)


@pytest.mark.parametrize("multiplier", [0.5, 1.0, 2.0])
def test_two_pointer_restore_is_exact_at_several_bandwidths(smollm2, prompt, balance, multiplier):
    tokens, reference, full, greedy = prompt
    store, bytes_per_s = balance

    async def main():
        r = Restorer(smollm2, ThrottledStore(store, bytes_per_s * multiplier), chunk_size=256)
        return await r.restore(tokens, TokenTwoPointer())

    res = anyio.run(main)
    assert res.stats.computed_chunks >= 1 and res.stats.loaded_chunks >= 1  # both sides took part
    assert res.stats.computed_chunks + res.stats.loaded_chunks == res.stats.n_chunks
    torch.testing.assert_close(res.kv.data, reference.data, atol=KV_ATOL, rtol=0)
    assert smollm2.generate(full, res.kv, max_new_tokens=16) == greedy


def test_corrupt_chunk_on_real_model_is_recomputed(smollm2, prompt, tmp_path):
    tokens, reference, full, greedy = prompt
    store = open_store(f"file://{tmp_path}")

    async def main():
        r = Restorer(smollm2, store, chunk_size=256)
        await r.save(tokens, kv=reference)
        key = chunk_keys(tokens, smollm2.spec.fingerprint, 256)[3].key
        blob = bytearray(await store.get(key))
        blob[-10] ^= 0x01  # one flipped bit in the last layer's V
        await store.put(key, bytes(blob))
        return await r.restore(tokens, LoadOnly())

    res = anyio.run(main)
    assert res.stats.failed_loads == 1 and res.stats.computed_chunks == 1
    torch.testing.assert_close(res.kv.data, reference.data, atol=KV_ATOL, rtol=0)
    assert smollm2.generate(full, res.kv, max_new_tokens=16) == greedy


def test_gguf_conversion_from_scratch(smollm2, tmp_path):
    """The first-run path: convert the bundled GGUF into a fresh cache dir, then load it from there."""
    from kvrestore.backends.hf import HFBackend, smollm2_checkpoint

    path = smollm2_checkpoint(tmp_path)
    assert (path / "done.json").exists() and path.parent == tmp_path / "models"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]  # no leftovers
    again = HFBackend.from_smollm2(dtype=torch.float32, cache_dir=tmp_path)
    assert again.spec.fingerprint == smollm2.spec.fingerprint
