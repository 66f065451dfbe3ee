"""Where a loaded prompt's first token spends its time inside vLLM: CPU time and calls per connector hook,
engine steps per request, and a profile of the step thread, for ExampleConnector and kvrestore load-all.

Robust on a machine shared with other jobs: the figures are the step thread's CPU time
(`time.thread_time`) and call counts, not wall clock. One process per case (`--connector`), serving the
prompt `--repeat` times after a warm-up; a store filled first by a saving process (`--save`).

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_hooks.py --tokens 4000 --repeat 8

Prints a table per case and writes benchmarks/results/vllm_hooks.json (`--out`).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "tests_vllm" / "serve.py"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "vllm_hooks.json"
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "build_connector_worker_meta",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
)


class Tally:
    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)

    def wrap(self, cls: type, name: str) -> None:
        fn = getattr(cls, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] += time.thread_time() - c
                self.wall[name] += time.perf_counter() - w
                self.calls[name] += 1

        setattr(cls, name, timed)

    def take(self) -> dict[str, Any]:
        out = {k: {"calls": self.calls[k], "cpu_s": self.cpu[k], "wall_s": self.wall[k]} for k in self.calls}
        self.calls.clear(), self.cpu.clear(), self.wall.clear()
        return out


def case(args: argparse.Namespace) -> dict[str, Any]:
    """One connector's process: serve the prompt, tally the hooks."""
    sys.path.insert(0, str(SERVE.parent))
    from serve import engine, prompt_ids
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvrestore.integrations.vllm import KVRestoreConnector

    tally = Tally()
    cls = KVRestoreConnector if args.connector == "kvrestore" else ExampleConnector
    for name in HOOKS:
        tally.wrap(cls, name)
    tally.wrap(Scheduler, "schedule")  # one call per engine step
    llm = engine(args.model, args.connector, json.loads(args.extra), disable_log_stats=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    llm.generate(
        {"prompt_token_ids": prompt_ids(tok, 32, 20000)}, SamplingParams(max_tokens=1), use_tqdm=False
    )
    prompt = {"prompt_token_ids": prompt_ids(tok, args.tokens)}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows = []
    profile = cProfile.Profile()
    for i in range(args.repeat + 1):  # the first: a warm-up, not reported
        timed = i > 0
        tally.on = timed
        c, p, w = time.thread_time(), time.process_time(), time.perf_counter()
        if timed and args.profile:
            profile.enable()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        if timed and args.profile:
            profile.disable()
        row = {
            "wall_s": time.perf_counter() - w,
            "thread_cpu_s": time.thread_time() - c,
            "process_cpu_s": time.process_time() - p,
            "ids": list(out.outputs[0].token_ids),
            "hooks": tally.take(),
        }
        tally.on = False
        if timed:
            rows.append(row)
    stats = io.StringIO()
    if args.profile:
        pstats.Stats(profile, stream=stats).sort_stats("tottime").print_stats(40)
    if args.connector == "kvrestore":
        from kvrestore.integrations.vllm.stats import records

        loads = [r["seconds"] for r in records() if r["event"] == "loaded"]
    else:
        loads = []
    return {"rows": rows, "profile": stats.getvalue(), "load_s": loads}


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hooks = sorted({h for r in rows for h in r["hooks"]})
    out: dict[str, Any] = {
        "wall_s": median([r["wall_s"] for r in rows]),
        "thread_cpu_s": median([r["thread_cpu_s"] for r in rows]),
        "process_cpu_s": median([r["process_cpu_s"] for r in rows]),
        "hooks": {},
    }
    for h in hooks:
        got = [r["hooks"].get(h, {"calls": 0, "cpu_s": 0.0, "wall_s": 0.0}) for r in rows]
        out["hooks"][h] = {
            "calls": median([g["calls"] for g in got]),
            "cpu_ms": 1e3 * median([g["cpu_s"] for g in got]),
            "wall_ms": 1e3 * median([g["wall_s"] for g in got]),
        }
    return out


def spawn(
    model: Path, args: argparse.Namespace, connector: str, extra: dict, repeat: int, profile: bool
) -> Any:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--tokens", str(args.tokens)]
    cmd += ["--connector", connector, "--extra", json.dumps(extra), "--repeat", str(repeat)]
    cmd += ["--profile"] if profile else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child", action="store_true")
    p.add_argument("--model")
    p.add_argument("--connector")
    p.add_argument("--extra", default="{}")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    if args.child:
        print(json.dumps(case(args)))
        return 0
    from kvrestore.backends.hf import smollm2_checkpoint

    start_load = os.getloadavg()
    model = smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="kvrestore-vllm-hooks-"))
    (work / "example").mkdir()
    example = {"shared_storage_path": str(work / "example")}
    kv = {"store_url": str(work / "kv"), "cost_dir": str(work / "costs"), "chunk_size": 256}
    spawn(model, args, "example", example, 0, False)
    spawn(model, args, "kvrestore", kv, 0, False)
    cases = {
        "ExampleConnector": ("example", example),
        "kvrestore load-all": ("kvrestore", {**kv, "split": "load_all"}),
    }
    rows: dict[str, list] = defaultdict(list)
    profiles: dict[str, str] = {}
    loads: dict[str, list] = defaultdict(list)
    for rnd in range(args.rounds + 1):  # the last round profiled (cProfile), not counted
        for name, (connector, extra) in cases.items():
            profiled = rnd == args.rounds
            got = spawn(model, args, connector, extra, 3 if profiled else args.repeat, profiled)
            if profiled:
                profiles[name] = got["profile"]
                continue
            rows[name] += got["rows"]
            loads[name] += got["load_s"][1:]
            print(f"round {rnd + 1}: {name}: {[round(r['wall_s'], 3) for r in got['rows']]}", file=sys.stderr)
    from _common import machine_info
    from _provenance import code_version

    result: dict[str, Any] = {
        "benchmark": "vllm_hooks",
        "config": vars(args) | {"out": str(args.out)},
        "load_average_at_start": start_load,
        "load_average_at_end": os.getloadavg(),
        "machine": machine_info(),
        "code": code_version(),
        "cases": {},
    }
    for name in cases:
        s = summary(rows[name])
        s["load_s"] = loads[name]
        s["same_ids"] = len({tuple(r["ids"]) for n in cases for r in rows[n]}) == 1
        result["cases"][name] = s | {"rows": rows[name], "profile": profiles.get(name, "")}
        hooks = sum(v["cpu_ms"] for h, v in s["hooks"].items() if h != "schedule") / 1e3
        print(
            f"== {name}: wall {s['wall_s']:.3f} s, step thread cpu {s['thread_cpu_s']:.3f} s "
            f"(hooks {hooks:.3f} s), process cpu {s['process_cpu_s']:.3f} s, "
            f"loads {sorted(s['load_s'])[len(s['load_s']) // 2] if s['load_s'] else '-'}"
        )
        for h, v in s["hooks"].items():
            print(
                f"   {h:32s} calls {v['calls']:6.0f}  cpu {v['cpu_ms']:8.2f} ms  wall {v['wall_ms']:8.2f} ms"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
