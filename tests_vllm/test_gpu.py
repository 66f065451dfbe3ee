"""The connector on a GPU (`make test-vllm` on the GPU host; skipped without CUDA).

A Llama-shaped model with vLLM's dummy weights (deterministic: the same in every process) in bf16, a
prompt of token ids; each vLLM run is a new process (`gpu_serve.py`). A first process computes the
prompt and saves it; then:

* a process that loads it holds, in its pages, exactly the KV the first process computed, page by page
  (vLLM's CUDA paged layout written by the connector's stream, read back through the same layout);
* loading, with piecewise CUDA graphs and in eager mode, gives the same tokens as each other, and the
  same first token as vLLM alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HERE = Path(__file__).resolve().parent
N_TOKENS = 3000  # not a whole number of chunks or blocks: a partial last chunk and block
CHUNK = 256
SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
FINGERPRINT = "d" * 32
TOKENS = [3 + (i * 7919) % 31000 for i in range(N_TOKENS)]


def serve(
    model: Path, *, extra: dict | None, eager: bool = True, max_tokens: int = 8, dump: Path | None = None
):
    spec = {
        "model": str(model),
        "fingerprint": FINGERPRINT,
        "tokens": TOKENS,
        "max_tokens": max_tokens,
        "eager": eager,
        "extra": extra,
        "dump": str(dump) if dump else None,
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "gpu_serve.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith('{"ids"')]
    return json.loads(line)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("model")
    (where / "config.json").write_text(json.dumps(SHAPE))
    return where


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kv")
    return {"store_url": str(root / "kv"), "cost_dir": str(root / "costs"), "chunk_size": CHUNK}


@pytest.fixture(scope="module")
def alone(model):
    return serve(model, extra=None)


@pytest.fixture(scope="module")
def saved(model, store):
    """A process computes the prompt and saves every chunk."""
    run = serve(model, extra=store, max_tokens=1)
    assert [r for r in run["records"] if r["event"] == "loaded"] == []
    return run


def test_loaded_pages_hold_the_kv_vllm_computed(model, store, saved, tmp_path):
    from kvrestore import codec
    from kvrestore.core.keys import chunk_keys
    from kvrestore.core.spec import ModelSpec
    from kvrestore.core.sync import LoopThread as IOThread
    from kvrestore.stores import open_store

    dump = tmp_path / "pages.pt"
    run = serve(model, extra={**store, "split": "load_all"}, max_tokens=1, dump=dump)
    (loaded,) = [r for r in run["records"] if r["event"] == "loaded"]
    k = loaded["tokens"]
    assert k >= N_TOKENS - 2 * CHUNK
    pages = torch.load(dump)
    H = SHAPE["num_key_value_heads"]
    D = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    spec = ModelSpec(
        "dummy", SHAPE["num_hidden_layers"], H, D, SHAPE["vocab_size"], torch.bfloat16, FINGERPRINT
    )
    kv_store, io = open_store(store["store_url"]), IOThread()
    try:  # what the first process computed, as its connector gathered it from vLLM's pages
        parts = []
        for ref in chunk_keys(TOKENS, FINGERPRINT, CHUNK):
            if ref.start < k:
                blob = io.call(kv_store.get, ref.key)
                parts.append(codec.decode_chunk(blob, spec, ref.key, ref.start, ref.end - ref.start).data)
    finally:
        io.close()
    computed = torch.cat(parts, dim=3)[:, :, :, :k]
    assert pages.shape == computed.shape and pages.abs().sum() > 0
    block = 16
    for start in range(0, k, block):  # page by page, bit for bit
        assert torch.equal(pages[..., start : start + block, :], computed[..., start : start + block, :]), (
            start
        )


def test_piecewise_cuda_graphs_and_eager_mode_give_the_same_tokens_with_loading_on(
    model, store, saved, alone
):
    load = {**store, "split": "load_all"}
    eager = serve(model, extra=load, eager=True)
    graphs = serve(model, extra=load, eager=False)
    for run in (eager, graphs):
        assert [r["event"] for r in run["records"] if r["event"] in ("loaded", "load_failed")] == ["loaded"]
    assert eager["ids"] == graphs["ids"]
    assert eager["ids"][0] == alone["ids"][0]
    assert abs(eager["logprobs"][0] - alone["logprobs"][0]) <= 1e-2
