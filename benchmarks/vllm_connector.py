"""Time to first token inside vLLM: vLLM alone, vLLM's ExampleConnector, and KVRestoreConnector loading
everything or with its planned split, at 0.5x, 1x and 2x the balance bandwidth.

Issue 18's and issue 33's targets. SmolLM2-135M (fp32) on vLLM's CPU backend (the vLLM of the
interpreter that runs this), prompts of 2,000 and 4,000 tokens
(4,096 is vLLM's `max_model_len` here, and a prompt must leave room for the token it generates). Every
case runs in a new process (`tests_vllm/serve.py`), which first serves a short unrelated prompt (vLLM's
one-time set-up), then the prompt once more to warm up (its first request at that length pays seconds
of one-time costs in every case; not reported), then times `--repeat` one-token generations of it. The
cases run in `--rounds` interleaved rounds, a new process each; the median of every timed request is
reported:

* **vLLM alone**: no connector: the prompt computed from scratch (= compute-everything).
* **ExampleConnector**: one process saves the prompt to a local directory, a new one loads it.
* **kvrestore load-all (disk)**: one process saves the prompt through KVRestoreConnector to a local
  directory, a new one loads every stored token (`split="load_all"`): the same medium as ExampleConnector.
* **kvrestore load-all / planned @ f x balance**: the same store read through a `ThrottledStore` at f times
  the balance bandwidth (the rate at which loading the whole prompt takes as long as computing it, from
  vLLM alone's median), loading everything or the split the connector plans from the costs it measured
  (the load-all run at the same rate measures the link first). Each planned request's split and its
  prediction come from the connector's records (`integrations.vllm.stats.records`), not its log.

    .venv-vllm/bin/python benchmarks/vllm_connector.py                 # 2000 and 4000 tokens
    .venv-vllm/bin/python benchmarks/vllm_connector.py --tokens 2000 4000 --factors 1 --rounds 3
    .venv-vllm/bin/python benchmarks/vllm_connector.py --tp 2 --tokens 2000 --factors --rounds 2

With `--tp N` every vLLM runs at tensor_parallel_size N (one OpenMP thread set per worker). SmolLM2's 3
KV heads do not split over 2 workers, so `--model llama-2kv` (the default at an even tp) is a random-weight
Llama of SmolLM2's depth with 2 KV heads (30 layers, hidden 512, 8 query heads of 64, saved by the
benchmark: the KV is SmolLM2's per head, its compute comparable). Each rank loads its heads' part of
each chunk: the results add the bytes read per rank per load against its share of the KV (1/tp of the
loaded tokens' KV), from the connector's counters summed over the workers.

Prints a table and writes benchmarks/results/vllm_connector.json. Needs the vLLM virtualenv
(`make test-vllm` creates it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import machine_info, median, print_table, write_json
from _provenance import code_version

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "tests_vllm" / "serve.py"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "vllm_connector.json"
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of K and V per token over every layer (fp32), from the checkpoint's config."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def serve(
    model: Path,
    tokens: int,
    repeat: int,
    connector: str,
    extra: dict | None = None,
    env: dict | None = None,
    tp: int = 1,
) -> dict[str, Any]:
    """One new vLLM process serving the prompt `repeat` + 1 times (the first a warm-up), with `env`
    added to its environment, at tensor-parallel size `tp`."""
    cmd = [sys.executable, str(SERVE), "--model", str(model), "--tokens", str(tokens), "--ttft", "--warmup"]
    cmd += ["--repeat", str(repeat + 1), "--connector", connector, "--extra", json.dumps(extra or {})]
    env = {**os.environ, **ENV, **(env or {})}
    if tp > 1:  # one OpenMP thread set per worker, over the cores there are
        cmd += ["--tp", str(tp), "--metrics"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{connector} run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    (last,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"records"')]
    records = last["records"]
    splits = [(r["k"], r["predicted_s"]) for r in records if r["event"] == "split"]
    loads = [r["seconds"] for r in records if r["event"] == "loaded"]
    seconds = [r["seconds"] for r in rows[1:]]  # the first is the warm-up
    metrics = last.get("metrics") or {}
    return {
        "loads": metrics.get("loads"),  # summed over the workers
        "loaded_bytes": metrics.get("loaded_bytes"),
        "loaded_tokens": metrics.get("loaded_tokens"),
        "ttft_s": median(seconds) if seconds else None,
        "ttfts_s": seconds,
        "warmup_s": rows[0]["seconds"],
        "first_ids": [r["ids"] for r in rows],
        "splits": splits,  # (tokens loaded, predicted seconds) per request, as the connector recorded them
        "load_s": loads,  # each load's seconds, start to last layer placed
        "process_s": time.perf_counter() - t,
    }


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's processes (one a round) as one result: the median of every timed request."""
    merged = {
        "ttft_s": median([t for r in runs for t in r["ttfts_s"]]),
        "ttfts_s": [r["ttfts_s"] for r in runs],
        "warmup_s": [r["warmup_s"] for r in runs],
        "first_ids": [ids for r in runs for ids in r["first_ids"]],
        "splits": [r["splits"] for r in runs],
        "load_s": [r["load_s"] for r in runs],
        "process_s": [r["process_s"] for r in runs],
    }
    for name in ("loads", "loaded_bytes", "loaded_tokens"):
        merged[name] = [r.get(name) for r in runs]
    if "bytes_per_s" in runs[0]:
        merged["bytes_per_s"] = runs[0]["bytes_per_s"]
    return merged


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvrestore.backends.hf import smollm2_checkpoint

    work = Path(tempfile.mkdtemp(prefix="kvrestore-vllm-bench-"))
    tp = args.tp
    if args.model == "smollm2":
        model = smollm2_checkpoint()
    else:  # SmolLM2's depth and KV per head, 2 KV heads: splits over tp 2
        sys.path.insert(0, str(ROOT / "tests_vllm"))
        from tiny_llama import save_tiny_llama

        model = save_tiny_llama(
            work / "llama-2kv", layers=30, hidden=512, heads=8, kv_heads=2, intermediate=1536
        )
    kv_per_token = kv_bytes_per_token(model)
    example = tp == 1  # vLLM's ExampleConnector is measured at tp 1 only
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {n: {} for n in args.tokens}
    balance: dict[int, float] = {}
    for n in args.tokens:  # every store filled once, by a process that computes and saves
        (work / f"example-{n}").mkdir()
        if example:
            serve(model, n, 0, "example", {"shared_storage_path": str(work / f"example-{n}")})
        base = {"store_url": str(work / f"kv-{n}"), "cost_dir": str(work / "costs"), "chunk_size": args.chunk}
        serve(model, n, 0, "kvrestore", base, tp=tp)
    for rnd in range(args.rounds):
        for n in args.tokens:
            log(f"== round {rnd + 1} of {args.rounds}, {n} tokens")
            base = {
                "store_url": str(work / f"kv-{n}"),
                "cost_dir": str(work / "costs"),
                "chunk_size": args.chunk,
            }
            cases: list[tuple[str, str, dict[str, Any], float | None]] = [
                ("vllm alone", "none", {}, None),
                (
                    "ExampleConnector (disk)",
                    "example",
                    {"shared_storage_path": str(work / f"example-{n}")},
                    None,
                ),
                ("kvrestore load-all (disk)", "kvrestore", {**base, "split": "load_all"}, None),
            ]
            if not example:
                cases = [c for c in cases if c[1] != "example"]
            if n not in balance:  # the rate at which loading the whole prompt takes as long as computing it
                alone = serve(model, n, args.repeat, "none", tp=tp)
                runs[n].setdefault("vllm alone", []).append(alone)
                balance[n] = n * kv_per_token / median(alone["ttfts_s"])
                cases = cases[1:]
            elif not args.factors:  # no split to compare with it: its first round's token check suffices
                cases = cases[1:]
            for f in args.factors:
                throttled = {**base, "throttle_bytes_per_s": f * balance[n]}
                for split in ("load_all", "planned"):
                    name = f"kvrestore {split.replace('_', '-')} @ {f:g}x"
                    cases.append((name, "kvrestore", {**throttled, "split": split}, f * balance[n]))
            for name, connector, extra, rate in cases:
                r = serve(model, n, args.repeat, connector, extra, tp=tp)
                if rate is not None:
                    r["bytes_per_s"] = rate
                runs[n].setdefault(name, []).append(r)
                log(f"  {name}: {[round(t, 3) for t in r['ttfts_s']]} s, splits {r['splits']}")
    results: dict[str, Any] = {}
    table = []
    for n in args.tokens:
        cases_n = {name: _merge(rs) for name, rs in runs[n].items()}
        alone = cases_n["vllm alone"]
        for name, c in cases_n.items():
            same = all(ids == alone["first_ids"][0] for ids in c["first_ids"])
            c["same_first_token"] = same
            last = c["splits"][-1][-1][0] if c["splits"] and c["splits"][-1] else "-"
            table.append([n, name, c["ttft_s"], c["ttft_s"] / alone["ttft_s"], last, same])
        disk_case = cases_n["kvrestore load-all (disk)"]
        disk = disk_case["ttft_s"]
        ratios: dict[str, Any] = {"kvrestore_disk_vs_alone": disk / alone["ttft_s"]}
        if example:
            ratios["kvrestore_disk_vs_example"] = disk / cases_n["ExampleConnector (disk)"]["ttft_s"]
        per_load = [
            (b / loads, t / loads)
            for b, t, loads in zip(
                disk_case["loaded_bytes"], disk_case["loaded_tokens"], disk_case["loads"], strict=True
            )
            if loads
        ]
        if per_load:  # a rank's bytes per load (counters summed over ranks, a load each) against its share
            b, t = per_load[0]
            ratios["bytes_read_per_rank"] = b
            ratios["bytes_read_per_rank_vs_share"] = b / (t * kv_per_token / tp)
        for f in args.factors:
            planned = cases_n[f"kvrestore planned @ {f:g}x"]["ttft_s"]
            best = min(cases_n[f"kvrestore load-all @ {f:g}x"]["ttft_s"], alone["ttft_s"])
            ratios[f"planned_vs_best_of_load_all_and_compute_all@{f:g}x"] = planned / best
        results[str(n)] = {"balance_bytes_per_s": balance[n], "cases": cases_n, "ratios": ratios}
        for k, v in ratios.items():
            log(f"  {n} tokens: {k}: {v:.3f}")
    print_table(
        ["tokens", "case", "TTFT s (median)", "x vLLM alone", "tokens loaded", "same token"],
        table,
        title=f"TTFT inside vLLM {vllm_version()} (CPU) at tp {tp}, {args.model} fp32, "
        f"median of {args.rounds} x {args.repeat}",
    )
    return {
        "benchmark": "vllm_connector",
        "config": {
            "tokens": args.tokens,
            "repeat": args.repeat,
            "rounds": args.rounds,
            "factors": args.factors,
            "chunk_size": args.chunk,
            "tp": tp,
            "model": args.model,
            "kv_bytes_per_token": kv_per_token,
        },
        "machine": machine_info(),
        "vllm": vllm_version(),
        "code": code_version(),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2000, 4000])
    p.add_argument("--repeat", type=int, default=2, help="timed requests per process, after its warm-up")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, a new process per case each")
    p.add_argument(
        "--factors",
        type=float,
        nargs="*",
        default=[0.5, 1.0, 2.0],
        help="x balance bandwidth (none: no link)",
    )
    p.add_argument("--chunk", type=int, default=256, help="kvrestore chunk size (default 256)")
    p.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    p.add_argument(
        "--model",
        choices=("smollm2", "llama-2kv"),
        default=None,
        help="default: smollm2 at tp 1, else llama-2kv",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.model is None:
        args.model = "smollm2" if args.tp == 1 else "llama-2kv"
    result = run(args)
    write_json(args.out, result)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
