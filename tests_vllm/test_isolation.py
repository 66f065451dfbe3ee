"""Keys that name everything the KV depends on, on real vLLM engines (`make test-vllm`).

Tenants' `cache_salt` and a LoRA adapter (random weights on q/k/v/o, made here with `peft`) each key
their own chunks: a new process loads a request's chunks only for the same salt and adapter, and every
request's greedy tokens equal vLLM's own without the connector. Each vLLM run is a new process
(`serve.py`), so what one saved is on disk (its writes are flushed at exit) before the next looks.
The keys of a multimodal request are checked on a `Request` built with `mm_features` (no multimodal
model runs here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_connector import LOADABLE, N_TOKENS, VLLM_ENV, assert_same_generation  # noqa: E402

BASE = {"offset": 0}
SALT_A = {"offset": 0, "salt": "tenantA"}
SALT_B = {"offset": 0, "salt": "tenantB"}
ADAPTER = {"offset": 0, "lora": True}


def serve_requests(
    model: Path, adapter: Path, requests: list[dict], extra: dict | None
) -> tuple[list[dict], list[dict]]:
    """Serve `requests` in one new vLLM process with LoRA on (with the connector where `extra` is given);
    returns each request's row (`serve.py`) and the connector's records."""
    cmd = [sys.executable, str(HERE / "serve.py"), "--model", str(model), "--tokens", str(N_TOKENS)]
    cmd += ["--lora", str(adapter), "--requests", json.dumps(requests)]
    cmd += ["--connector", "kvrestore" if extra is not None else "none", "--extra", json.dumps(extra or {})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **VLLM_ENV})
    assert proc.returncode == 0, f"vLLM exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    assert len(rows) == len(requests), proc.stderr[-3000:]
    (last,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"records"')]
    return rows, last["records"]


def loaded_tokens(row: dict, records: list[dict]) -> int:
    """Tokens the connector loaded for the request of `row` (vLLM's engine ids are the request's id
    with a suffix of its own)."""
    mine = [
        r for r in records if r["event"] == "loaded" and r["request"].rsplit("-", 1)[0] == row["request_id"]
    ]
    return sum(r["tokens"] for r in mine)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvrestore.backends.hf import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter with random weights on the attention projections (rank 8): it changes every
    layer's K and V."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    out = tmp_path_factory.mktemp("lora") / "adapter"
    peft.get_peft_model(model, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def reference(model_dir, adapter) -> dict[str, dict]:
    """vLLM without the connector: the base model's answer and the adapter's."""
    rows, _ = serve_requests(model_dir, adapter, [BASE, ADAPTER], None)
    return {"base": rows[0], "adapter": rows[1]}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("isolation")
    return {"store_url": str(root / "kv"), "cost_dir": str(root / "costs"), "split": "load_all"}


@pytest.fixture(scope="module")
def first(model_dir, adapter, store, reference):
    """A first process saves the base model's prompt, unsalted and under tenant A's salt."""
    return serve_requests(model_dir, adapter, [BASE, SALT_A], store)


@pytest.fixture(scope="module")
def second(model_dir, adapter, store, first):
    """A new process: tenant B, tenant A and the adapter ask for the same prompt."""
    return serve_requests(model_dir, adapter, [SALT_B, SALT_A, ADAPTER], store)


def test_the_adapter_changes_the_answer(reference):
    assert reference["adapter"]["ids"] != reference["base"]["ids"]


def test_the_first_process_saves_under_each_salt(first, reference, store):
    rows, records = first
    assert [loaded_tokens(r, records) for r in rows] == [0, 0]
    for row in rows:
        assert_same_generation(row, reference["base"])
    assert len(list(Path(store["store_url"]).rglob("*.kvc"))) == 2 * 8  # two namespaces, 8 chunks each


def test_only_the_same_salt_and_adapter_load_a_chunk(second, reference):
    rows, records = second
    salt_b, salt_a, lora = rows
    assert loaded_tokens(salt_b, records) == 0  # another tenant's chunks are not its own
    assert loaded_tokens(salt_a, records) == LOADABLE  # its own tenant's chunks are
    assert loaded_tokens(lora, records) == 0  # the base model's chunks are not the adapter's
    assert_same_generation(salt_b, reference["base"])
    assert_same_generation(salt_a, reference["base"])
    assert_same_generation(lora, reference["adapter"])


def test_a_new_process_loads_the_adapters_own_chunks(model_dir, adapter, store, second, reference):
    rows, records = serve_requests(model_dir, adapter, [ADAPTER], store)
    assert loaded_tokens(rows[0], records) == LOADABLE
    assert_same_generation(rows[0], reference["adapter"])


# -- without an engine ------------------------------------------------------------------------------


def _mm_request(image_hash: str, offset: int = 300):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=image_hash,
        mm_position=PlaceholderRange(offset=offset, length=64),
    )
    return Request(
        "mm",
        prompt_token_ids=list(range(1000)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=[feature],
    )


def test_a_multimodal_requests_keys_follow_its_image():
    from kvrestore.integrations.vllm.keys import RequestKeys

    keys = RequestKeys("ab" * 16)

    def refs(req):
        return [r.key for r in keys.refs(req, req.prompt_token_ids, 256)]

    one, two = refs(_mm_request("image-1")), refs(_mm_request("image-2"))
    assert one[0] == two[0]  # tokens 0-255 precede the image (at 300)
    assert all(a != b for a, b in zip(one[1:], two[1:], strict=True))
    assert refs(_mm_request("image-1")) == one
    assert refs(_mm_request("image-1", offset=310))[1] != one[1]


def test_the_scheduler_neither_loads_nor_saves_an_unkeyable_request(tmp_path):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvrestore.core.spec import ModelSpec
    from kvrestore.integrations.vllm.config import ConnectorConfig, ConnectorContext
    from kvrestore.integrations.vllm.scheduler import SchedulerSide
    from kvrestore.stores import MemoryStore

    spec = ModelSpec("tiny", 3, 2, 4, 100, torch.float32, fingerprint="ab" * 16)
    cfg = ConnectorConfig.from_extra({"store_url": "memory://", "cost_dir": str(tmp_path)})
    side = SchedulerSide(ConnectorContext.make(cfg, spec, 16), store=MemoryStore())
    req = Request(
        "embeds",
        prompt_token_ids=None,
        prompt_embeds=torch.zeros(40, 8),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: still nothing
    assert "embeds" not in side._reqs  # so no step of it saves a chunk
    assert side.counters.take()["unkeyed_requests"] == 1
