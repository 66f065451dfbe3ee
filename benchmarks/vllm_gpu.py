"""Time to first token inside vLLM on a GPU: vLLM alone, vLLM's own offloading, and kvrestore's connector.

Issue 33's GPU run. A Llama-3.1-8B-shaped model with `load_format="dummy"` (vLLM's deterministic
weights: the same in every process), bf16, token-id prompts (no tokenizer), prompts of 8k, 16k and 32k
tokens. Cases:

* **vLLM alone**, prefix caching off: the prompt computed (= compute-everything).
* **OffloadingConnector**, its CPU tier sized to hold the prompts; **SimpleCPUOffloadConnector**, if
  this vLLM has it and it runs. Their tiers live in the serving process: it serves each prompt once
  (saved), resets vLLM's prefix cache, then times it (loaded from the tier).
* **kvrestore load-all (pinned memory)**: the same way, from a ``memory://`` store in page-locked memory.
* **kvrestore load-all (file)**: a process computes and saves every prompt to a local directory, then a
  new process (a restarted server) loads them.
* **kvrestore load-all / planned @ f x balance**: that directory read through a `ThrottledStore` at f
  times the balance bandwidth (loading a prompt takes as long as computing it, from vLLM alone's TTFT in
  the warm-up round), loading everything or the split the connector plans (the load-all case at the
  same rate measures the link first).

Every case runs in a new process. A warm-up round runs vLLM alone (it sets the balance); then `--rounds`
rounds run every case once each, interleaved (A B C ... A B C ...); each process serves a short
unrelated prompt first (one-time set-up), then times a one-token greedy generation per prompt. Reported:
the median TTFT per case and size, the ratios the issue's targets name, and whether each case's first
token and its logprob match vLLM alone's (1e-2 in bf16).

    python benchmarks/vllm_gpu.py                       # the GPU host (GPU.md: vLLM 0.26's bundle)
    python benchmarks/vllm_gpu.py --tokens 16384 --rounds 2
    python benchmarks/vllm_gpu.py --smoke               # a CPU: a tiny Llama shape, short prompts (CI)

Writes benchmarks/results/vllm_gpu-<device>.json (`--out`), with the machine named; exits 1 if a
kvrestore case gave another first token than vLLM alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import machine_info, median, print_table, write_json
from _provenance import code_version

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: Llama-3.1-8B's shape (GPU.md), and a tiny one for the CPU smoke run
LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
#: the GPU host's vLLM bundle leaves FlashInfer out (GPU.md); vLLM's sampler then imports it unless told
#: not to use it. The engine runs in the case's process (as on the CPU), so the connector's records (the
#: split it planned) are read there: on a GPU vLLM otherwise starts an engine-core process. Every case
#: runs the same way. A user's own settings win.
GPU_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@dataclass
class Case:
    """One way of serving the prompts: a connector (or none) and its configuration."""

    name: str
    connector: str = "none"  # none | kvrestore | OffloadingConnector | SimpleCPUOffloadConnector
    extra: dict[str, Any] = field(default_factory=dict)
    in_process: bool = False  # the tier lives in the serving process: serve once to save, then time
    factor: float | None = None  # x balance bandwidth (throttled kvrestore cases)
    optional: bool = False  # vLLM's own offloading: a case that does not run here is reported, not fatal


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_model(where: Path, shape: dict[str, Any], dtype: str) -> tuple[Path, str]:
    """A checkpoint directory with only a config.json (vLLM's dummy weights fill it), and the fingerprint
    the connector keys its chunks by (dummy weights have no files to hash: the config and dtype name them)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": dtype,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    where.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, sort_keys=True)
    (where / "config.json").write_text(text)
    return where, hashlib.sha256(f"dummy|{text}|{dtype}".encode()).hexdigest()[:32]


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """`n` token ids, the same in every process (a linear congruential sequence; no tokenizer)."""
    out, x = [], 12345 + seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(3 + x % (vocab - 3))
    return out


# -- one serving process ----------------------------------------------------------------------------


def child(spec: dict[str, Any]) -> None:
    """Serve `spec["tokens"]` prompts as `spec["case"]` says, print one JSON line per prompt, then one
    with the connector's records."""
    if spec["cpu"]:
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    case = Case(**spec["case"])
    kv = None
    if case.connector == "kvrestore":
        kv = KVTransferConfig(
            kv_connector="KVRestoreConnector",
            kv_connector_module_path="kvrestore.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=case.extra,
        )
    elif case.connector != "none":
        kv = KVTransferConfig(
            kv_connector=case.connector, kv_role="kv_both", kv_connector_extra_config=case.extra
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        # vLLM's own tiers are keyed by its block hashes; between saving and timing its cache is reset
        enable_prefix_caching=case.connector in ("OffloadingConnector", "SimpleCPUOffloadConnector"),
        enforce_eager=spec["eager"],
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.85),
        kv_transfer_config=kv,
    )
    print(json.dumps({"event": "ready", "seconds": time.perf_counter() - t0}), flush=True)
    vocab = spec["vocab"]
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, detokenize=False)
    llm.generate({"prompt_token_ids": prompt(32, vocab, seed=99)}, one, use_tqdm=False)  # set-up
    for n in spec["tokens"]:
        ids = prompt(n, vocab)
        if case.in_process or spec.get("save_only"):
            llm.generate({"prompt_token_ids": ids}, one, use_tqdm=False)  # computed, saved
            if case.connector == "kvrestore":
                from kvrestore.integrations.vllm import flush_saves

                flush_saves()
            llm.reset_prefix_cache()
            if spec.get("save_only"):
                continue
        t = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, one, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - t
        token = out.token_ids[0]
        logprob = out.logprobs[0][token].logprob if out.logprobs else None
        print(json.dumps({"tokens": n, "ttft_s": seconds, "token": token, "logprob": logprob}), flush=True)
    records: list[dict[str, Any]] = []
    if case.connector == "kvrestore":
        from kvrestore.integrations.vllm import flush_saves
        from kvrestore.integrations.vllm import records as kept

        flush_saves()
        records = kept()
    print(json.dumps({"records": records}), flush=True)


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run `child(spec)` in a new process; its rows by prompt size and its records."""
    env = {**os.environ, **CPU_ENV} if spec["cpu"] else {**GPU_ENV, **os.environ}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    rows = {r["tokens"]: r for r in lines if "ttft_s" in r}
    records = next((r["records"] for r in lines if "records" in r), [])
    out = {"rows": rows, "records": records, "process_s": time.perf_counter() - t, "rc": proc.returncode}
    if proc.returncode != 0:
        out["error"] = proc.stderr[-3000:]
    return out


# -- the benchmark ----------------------------------------------------------------------------------


def cases(args: argparse.Namespace, work: Path, fingerprint: str, kv_bytes: int) -> list[Case]:
    files = {"store_url": str(work / "kv"), "cost_dir": str(work / "costs"), "fingerprint": fingerprint}
    tier_bytes = int(sum(args.tokens) * kv_bytes * 1.25)
    memory = {"store_url": "memory://", "store_options": {"pinned": not args.cpu}}
    out = [
        Case("vllm alone"),
        Case(
            "OffloadingConnector",
            "OffloadingConnector",
            {"cpu_bytes_to_use": tier_bytes},
            in_process=True,
            optional=True,
        ),
        Case(
            "SimpleCPUOffloadConnector",
            "SimpleCPUOffloadConnector",
            {"cpu_bytes_to_use": tier_bytes},
            in_process=True,
            optional=True,
        ),
        Case(
            "kvrestore load-all (memory)",
            "kvrestore",
            {**files, **memory, "split": "load_all"},
            in_process=True,
        ),
        Case("kvrestore load-all (file)", "kvrestore", {**files, "split": "load_all"}),
    ]
    for f in args.factors:
        for split in ("load_all", "planned"):
            name = f"kvrestore {split.replace('_', '-')} @ {f:g}x"
            out.append(Case(name, "kvrestore", {**files, "split": split}, factor=f))
    return [c for c in out if c.name not in args.skip]


def files_of(all_cases: list[Case]) -> dict[str, Any]:
    """The file store's options, as the loading cases read it (the saver writes it for them)."""
    extra = next(c.extra for c in reversed(all_cases) if c.extra.get("store_url", "").startswith("/"))
    return {k: extra[k] for k in ("store_url", "cost_dir", "fingerprint")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    shape = TINY if args.smoke else LLAMA_8B
    dtype = "float32" if args.cpu else "bfloat16"
    work = Path(tempfile.mkdtemp(prefix="kvrestore-vllm-gpu-"))
    model, fingerprint = write_model(work / "model", shape, dtype)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    itemsize = 4 if dtype == "float32" else 2
    kv_bytes = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * itemsize
    base = {
        "model": str(model),
        "dtype": dtype,
        "vocab": shape["vocab_size"],
        "tokens": args.tokens,
        "max_model_len": max(args.tokens) + 16,
        "eager": args.eager,
        "cpu": args.cpu,
    }
    timeout = args.timeout
    log(f"model {shape['num_hidden_layers']} layers, {kv_bytes} KV bytes per token, work dir {work}")
    warm = run_child({**base, "case": asdict(Case("vllm alone"))}, timeout)
    if warm["rc"] != 0:
        raise RuntimeError(f"vLLM alone failed:\n{warm['error']}")
    balance = {n: n * kv_bytes / warm["rows"][n]["ttft_s"] for n in args.tokens}
    log(f"balance bandwidth: { {n: f'{b / 1e6:.1f} MB/s' for n, b in balance.items()} }")
    all_cases = cases(args, work, fingerprint, kv_bytes)
    saver = Case("kvrestore save", "kvrestore", {**files_of(all_cases), "split": "compute_all"})
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in all_cases}
    skipped: dict[str, str] = {}
    for r in range(args.rounds):
        log(f"== round {r + 1} of {args.rounds}")
        if r == 0:  # the file store's chunks, computed and saved by a process of their own
            saved = run_child({**base, "case": asdict(saver), "save_only": True}, timeout)
            if saved["rc"] != 0:
                raise RuntimeError(f"saving failed:\n{saved['error']}")
        for case in all_cases:
            if case.name in skipped:
                continue
            specs = [{**base, "case": asdict(case)}]
            if case.factor is not None:  # a rate per prompt size (its own balance): a process per size
                specs = []
                for n in args.tokens:
                    extra = {**case.extra, "throttle_bytes_per_s": case.factor * balance[n]}
                    specs.append({**base, "tokens": [n], "case": {**asdict(case), "extra": extra}})
            got: dict[str, Any] = {"rows": {}, "records": []}
            for spec in specs:
                one = run_child(spec, timeout)
                if one["rc"] != 0:
                    break
                got["rows"].update(one["rows"])
                got["records"] += one["records"]
            if one["rc"] != 0:
                if case.optional:
                    skipped[case.name] = one["error"].strip().splitlines()[-1] if one["error"] else "failed"
                    log(f"  {case.name}: does not run here ({skipped[case.name]})")
                    continue
                raise RuntimeError(f"{case.name} failed:\n{one['error']}")
            runs[case.name].append(got)
            log(
                f"  {case.name}: "
                + ", ".join(f"{n}: {row['ttft_s']:.3f} s" for n, row in got["rows"].items())
            )
    results: dict[str, Any] = {}
    table = []
    mismatched = []
    for n in args.tokens:
        ref = warm["rows"][n]
        per_case: dict[str, Any] = {}
        for name, got in runs.items():
            if not got:
                continue
            rows = [g["rows"][n] for g in got]
            ttft = median([row["ttft_s"] for row in rows])
            same = all(row["token"] == ref["token"] for row in rows)
            diff = max(
                (abs(row["logprob"] - ref["logprob"]) for row in rows if row["logprob"] is not None),
                default=None,
            )
            splits = [  # the timed request's split (a process that saves first records that one too)
                [rec["k"] for rec in g["records"] if rec["event"] == "split" and rec["n_tokens"] == n][-1]
                for g in got
                if any(rec["event"] == "split" and rec["n_tokens"] == n for rec in g["records"])
            ]
            per_case[name] = {
                "ttft_s": ttft,
                "ttfts_s": [row["ttft_s"] for row in rows],
                "same_first_token": same,
                "max_logprob_diff": diff,
                "tokens_loaded": splits,
            }
            if name.startswith("kvrestore") and (not same or (diff is not None and diff > args.logprob_tol)):
                mismatched.append(f"{name} at {n} tokens")
            table.append([n, name, ttft, splits[-1] if splits else "-", same, diff])
        alone = per_case["vllm alone"]["ttft_s"]
        ratios: dict[str, float] = {}
        off = per_case.get("OffloadingConnector")
        if off and "kvrestore load-all (memory)" in per_case:
            ratios["load_all_memory_vs_offloading"] = (
                per_case["kvrestore load-all (memory)"]["ttft_s"] / off["ttft_s"]
            )
        for f in args.factors:
            planned = per_case[f"kvrestore planned @ {f:g}x"]["ttft_s"]
            best = min(alone, per_case[f"kvrestore load-all @ {f:g}x"]["ttft_s"])
            ratios[f"planned_vs_best_of_alone_and_load_all@{f:g}x"] = planned / best
        results[str(n)] = {"balance_bytes_per_s": balance[n], "cases": per_case, "ratios": ratios}
    print_table(
        ["tokens", "case", "TTFT s (median)", "tokens loaded (last)", "same token", "max |dlogprob|"],
        table,
        title=f"TTFT inside vLLM, {'tiny' if args.smoke else 'Llama-3.1-8B'} shape ({dtype}), "
        f"median of {args.rounds} rounds",
    )
    for n, r in results.items():
        for k, v in r["ratios"].items():
            log(f"  {n} tokens: {k} = {v:.3f}")
    from importlib.metadata import version

    try:
        vllm_version = version("vllm")
    except Exception:  # the CPU build's distribution name
        vllm_version = version("vllm-cpu")
    return {
        "benchmark": "vllm_gpu",
        "config": {
            "tokens": args.tokens,
            "rounds": args.rounds,
            "factors": args.factors,
            "skipped_cases": args.skip,
            "smoke": args.smoke,
            "eager": args.eager,
            "shape": shape,
            "dtype": dtype,
        },
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "vllm": vllm_version,
        "machine": machine_info(),
        "code": code_version(),
        "not_run": skipped,
        "mismatched": mismatched,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny model, 256/512 tokens, one round")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=None, help="rounds after the warm-up (default 3; smoke 1)")
    p.add_argument("--factors", type=float, nargs="+", default=None, help="x balance (default 0.5 1 2)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (default: vLLM's piecewise graphs)")
    p.add_argument("--logprob-tol", type=float, default=None, help="default 1e-2 (bf16), 1e-3 (CPU fp32)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--skip", nargs="+", default=[], metavar="CASE", help="cases left out, by name")
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    import torch

    args.cpu = not torch.cuda.is_available()
    if not args.cpu and args.smoke:
        p.error("--smoke is the CPU run; on a GPU run the benchmark itself")
    if args.cpu and not args.smoke:
        p.error("no GPU here: the Llama-3.1-8B shape is for a GPU; use --smoke")
    args.tokens = args.tokens or ([256, 512] if args.smoke else [8192, 16384, 32768])
    args.rounds = args.rounds or (1 if args.smoke else 3)
    args.factors = args.factors or ([1.0] if args.smoke else [0.5, 1.0, 2.0])
    args.eager = args.eager or args.cpu
    args.logprob_tol = args.logprob_tol or (1e-3 if args.cpu else 1e-2)
    result = run(args)
    device = "cpu-smoke" if args.smoke else result["device"].lower().replace(" ", "-")
    out = args.out or RESULTS / f"vllm_gpu-{device}.json"
    write_json(out, result)
    log(f"wrote {out}")
    if result["mismatched"]:
        log(f"kvrestore gave another first token or logprob than vLLM alone: {result['mismatched']}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
