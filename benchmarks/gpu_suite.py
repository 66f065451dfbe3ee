"""Every GPU benchmark from one command: each in its own process with a time budget, one summary table.

A GPU host is lent for about 30 minutes, 10 per command, and returns at most 8 files from one folder.
This script runs, one after another, each in a subprocess with its own time limit (all within a total
budget, default 8 minutes):

* `cuda-tests`: pytest over the tests that need CUDA (`-k cuda` over the test files that hold them);
* `gpu_restore` at 16k and 32k tokens (`benchmarks/gpu_restore.py`, issue 14 / 31);
* `gpu_blend` (`benchmarks/gpu_blend.py`, issue 36);
* `data_path --device cuda` (`benchmarks/data_path.py`);
* `never_slower --device cuda` (`benchmarks/never_slower.py`, issue 31; "missing" until it exists);
* optional, recorded as "missing" where the script does not exist: `kv_encoding --device cuda`
  (issue 35) and `vllm_gpu` (issue 33; "skipped" where vLLM is not importable).

A benchmark that fails, times out or is missing is recorded as such; the rest still run. What comes
back is one folder of four files:

* `summary.md`: each target of the open issues (31, 33, 35, 36), the figure measured, met or not;
  then each benchmark's status, exit code and seconds;
* `summary.json`: the same rows and statuses, the machine, the code version;
* `results.json`: every benchmark's own JSON, whole, keyed by its name (split it into
  `benchmarks/results/` with `--unbundle`);
* `logs.txt`: every benchmark's stdout and stderr.

`--tiny` runs the same machinery on a CPU in a few minutes: each benchmark's own `--tiny` smoke mode
(the optional kv_encoding and vllm_gpu, whose smoke modes belong to their own CI, are skipped).

    python benchmarks/gpu_suite.py --out "$OUT/gpu_suite"      # on the GPU host (make bench-gpu)
    python benchmarks/gpu_suite.py --tiny --out /tmp/suite      # CPU smoke test
    python benchmarks/gpu_suite.py --unbundle /tmp/suite/results.json --machine h100
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import write_json
from _provenance import code_version

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DEFAULT_OUT = BENCH / "results" / "gpu_suite"
# the test files holding the tests that need CUDA; `-k cuda` picks those tests (and a few CPU-side
# checks whose names mention CUDA, which are cheap)
CUDA_TEST_FILES = [
    "tests/test_blend.py",
    "tests/test_two_pointer.py",
    "tests/test_chunkio.py",
    "tests/test_layer_reads.py",
]
LOG_TAIL = 3000  # characters of each benchmark's output kept in summary.json
MIN_START_S = 20.0  # a benchmark with less than this left of the total budget is skipped, not started


@dataclass
class Entry:
    """One benchmark: its command (the JSON path is appended as `--out PATH` where `json_out`), its own
    time limit, and whether a missing script is expected (another issue's, not written yet)."""

    name: str
    script: str | None  # benchmarks/<script>, or None for the CUDA tests
    args: list[str]
    budget_s: float
    optional: bool = False
    needs: str | None = None  # a module that must be importable, else "skipped"
    tiny_skip: bool = False  # not run by --tiny


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | timeout | missing | skipped
    rc: int | None = None
    seconds: float = 0.0
    reason: str = ""
    data: Any = None  # the benchmark's JSON
    log: str = ""
    command: list[str] = field(default_factory=list)


def entries(tiny: bool) -> list[Entry]:
    """The suite, in the order it runs: correctness first, then the benchmarks whose run times are known,
    then those still being written (their time is whatever the budget has left)."""
    dev = ["--device", "cpu", "--tiny"] if tiny else ["--device", "cuda"]
    return [
        Entry("cuda-tests", None, [], 120),
        Entry("gpu_restore", "gpu_restore.py", ["--tiny"] if tiny else ["--tokens", "16384", "32768"], 210),
        Entry("gpu_blend", "gpu_blend.py", ["--tiny"] if tiny else ["--profile"], 120),
        Entry("data_path", "data_path.py", dev, 70),
        # 2 rounds (its default is 3): 16k and 32k at seven store points must fit what the budget leaves
        Entry(
            "never_slower", "never_slower.py", dev if tiny else [*dev, "--rounds", "2"], 200, optional=True
        ),
        Entry("kv_encoding", "kv_encoding.py", ["--device", "cuda"], 90, optional=True, tiny_skip=True),
        Entry("vllm_gpu", "vllm_gpu.py", [], 240, optional=True, needs="vllm", tiny_skip=True),
    ]


def run_entry(entry: Entry, limit_s: float, work: Path) -> Outcome:
    """Run one benchmark in its own process group, killed (the group, by its id) at `limit_s`."""
    json_path = work / f"{entry.name}.json"
    if entry.script is None:
        junit = work / "cuda-tests.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda"]
        cmd += [*CUDA_TEST_FILES, f"--junitxml={junit}"]
    else:
        script = BENCH / entry.script
        if not script.exists():  # another issue's script not written yet, or (not optional) a broken checkout
            return Outcome(
                entry.name,
                "missing" if entry.optional else "failed",
                reason=f"benchmarks/{entry.script} does not exist",
            )
        cmd = [sys.executable, str(script), *entry.args, "--out", str(json_path)]
    if entry.needs and importlib.util.find_spec(entry.needs) is None:
        return Outcome(entry.name, "skipped", reason=f"{entry.needs} is not importable here", command=cmd)
    log_path = work / f"{entry.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc = None
    seconds = time.perf_counter() - t
    out = Outcome(entry.name, "ok", rc=rc, seconds=seconds, command=cmd)
    out.log = log_path.read_text(errors="replace")
    if rc is None:
        out.status, out.reason = "timeout", f"stopped after its {limit_s:.0f} s"
    elif rc != 0:
        out.status, out.reason = "failed", f"exit code {rc}"
    if entry.script is None:
        out.data = junit_counts(work / "cuda-tests.xml")
        if rc == 5:  # pytest: nothing collected (every test deselected) is not a failure of the suite
            out.status, out.reason = "ok", "no test selected"
    elif json_path.exists():  # partial results of a run cut short are kept too
        try:
            out.data = json.loads(json_path.read_text())
        except ValueError as exc:
            out.reason += f"; unreadable JSON: {exc}"
    elif out.status == "ok":
        out.status, out.reason = "failed", "exited 0 but wrote no JSON"
    return out


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a benchmark and the processes it started (its own session): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Tests, failures, errors and skips from pytest's JUnit XML, with the failed tests' names."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed_tests": failed}


# ---------------------------------------------------------------------------------------------------
# the summary: each target of the open issues, the figure, met or not


@dataclass
class Row:
    issue: str
    target: str
    figure: Any
    met: bool | None  # None: not measured (the benchmark is missing, failed, or has no such figure)
    source: str


def _get(data: Any, *path: Any) -> Any:
    for key in path:
        if isinstance(data, dict):
            data = data.get(key)
        elif isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
            data = data[key]
        else:
            return None
    return data


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _le(x: Any, bound: float) -> bool | None:
    v = _num(x)
    return None if v is None else v <= bound


def _ge(x: Any, bound: float) -> bool | None:
    v = _num(x)
    return None if v is None else v >= bound


def _restore_rows(data: Any) -> list[Row]:
    """gpu_restore: issue 31's H100 ratios per length (the token and layer-wise two-pointers against the
    better single strategy at each balance point) and exactness; issue 14's load-only rate."""
    rows: list[Row] = []
    for length in _get(data, "lengths") or []:
        n = length.get("tokens")
        grid = {p.get("multiplier"): p for p in length.get("grid", [])}
        for m, p in sorted(grid.items()):
            tp = p.get("two_pointer_over_best_single")
            if m != 1.0:  # at 1x the bound is 0.60 (below)
                rows.append(
                    Row(
                        "31",
                        f"{n} tok, {m:g}x balance: token two-pointer <= 1.05x better single",
                        tp,
                        _le(tp, 1.05),
                        "gpu_restore",
                    )
                )
            lw = p.get("layer_wise_over_best_single")
            bound = 0.75 if m == 1.0 else 1.10
            rows.append(
                Row(
                    "31",
                    f"{n} tok, {m:g}x balance: layer-wise <= {bound:.2f}x better single",
                    lw,
                    _le(lw, bound),
                    "gpu_restore",
                )
            )
        at1 = _get(grid, 1.0, "two_pointer_over_best_single")
        rows.append(
            Row(
                "31",
                f"{n} tok, 1x balance: token two-pointer <= 0.60x better single",
                at1,
                _le(at1, 0.60),
                "gpu_restore",
            )
        )
        exact = _get(length, "exactness", "all_passed")
        rows.append(
            Row(
                "31",
                f"{n} tok: every strategy's KV within tolerance, same argmax",
                exact,
                exact if isinstance(exact, bool) else None,
                "gpu_restore",
            )
        )
        gbs = _get(length, "load_only", "gb_per_s")
        rows.append(
            Row("14", f"{n} tok: load-only from host memory >= 30 GB/s", gbs, _ge(gbs, 30.0), "gpu_restore")
        )
    return rows


def _blend_rows(data: Any) -> list[Row]:
    """gpu_blend: issue 36's targets per layout; then, per layout, what the blend as shipped is compared
    with (no target: the figure only) and whether a timed round allocated device memory."""
    rows: list[Row] = []
    for lay in _get(data, "layouts") or []:
        name = f"{lay.get('chunks')}x{lay.get('chunk_tokens')}+{lay.get('question')}"
        cases = lay.get("cases", {})
        for case in ("blend@0.15 unsplit", "blend@0.15 one-call"):
            sp = _get(cases, case, "speedup_over_hf")
            rows.append(Row("36", f"{name}: {case} x stock prefill (for comparison)", sp, None, "gpu_blend"))
        seg = _get(cases, "blend@0.15", "new_segments_timed")
        rows.append(
            Row(
                "36",
                f"{name}: blend@15% allocates no device memory in timed rounds",
                seg,
                None if seg is None else seg == 0,
                "gpu_blend",
            )
        )
    for name, t in (_get(data, "targets", "by_layout") or {}).items():
        sp = t.get("blend15_speedup")
        rows.append(
            Row("36", f"{name}: restore_blend@15% >= 2.2x the stock prefill", sp, _ge(sp, 2.2), "gpu_blend")
        )
        spr = t.get("worst_spread")
        rows.append(
            Row(
                "36",
                f"{name}: round-to-round spread < 20%",
                spr,
                None if _num(spr) is None else spr < 0.20,
                "gpu_blend",
            )
        )
        ex = t.get("full_recompute_exact")
        rows.append(
            Row(
                "36",
                f"{name}: 100% recompute reproduces the stock KV",
                ex,
                ex if isinstance(ex, bool) else None,
                "gpu_blend",
            )
        )
    return rows


def _data_path_rows(data: Any) -> list[Row]:
    t = _get(data, "targets") or {}
    return [
        Row(
            "data",
            "load-only (memory) / host memcpy >= 0.60",
            t.get("load_memory_over_memcpy"),
            _ge(t.get("load_memory_over_memcpy"), t.get("load_memory_over_memcpy_min", 0.60)),
            "data_path",
        ),
        Row(
            "data",
            "load-only (file) / host memcpy >= 0.50",
            t.get("load_file_over_memcpy"),
            _ge(t.get("load_file_over_memcpy"), t.get("load_file_over_memcpy_min", 0.50)),
            "data_path",
        ),
        Row(
            "data",
            "a launching thread's rate during loads / alone >= 0.70",
            t.get("launch_rate_during_over_alone_1_lane"),
            _ge(
                t.get("launch_rate_during_over_alone_1_lane"),
                t.get("launch_rate_during_over_alone_min", 0.70),
            ),
            "data_path",
        ),
    ]


# never_slower's bounds per case (issue 31), over the better of compute-only and load-only at every point
NEVER_SLOWER = {"token-wise": 1.05, "layer-wise": 1.10, "auto-first": 1.25, "auto-fourth": 1.10}


def _never_slower_rows(data: Any) -> list[Row]:
    """never_slower (issue 31): each strategy's worst ratio to the better single strategy over the
    grid, both two-pointers at 1x balance, and stats.seconds against the wall time."""
    t = _get(data, "targets") or {}
    rows = []
    for case, bound in NEVER_SLOWER.items():
        fig = _get(t, "worst_vs_better_single", case)
        rows.append(
            Row(
                "31",
                f"{case} <= {bound:.2f}x the better single, every point",
                fig,
                _le(fig, bound),
                "never_slower",
            )
        )
    for case in ("token-wise", "layer-wise"):
        fig = _get(t, "at_balance", case)
        rows.append(
            Row("31", f"{case} <= 0.60x the better single at 1x balance", fig, _le(fig, 0.60), "never_slower")
        )
    fig = t.get("worst_stats_vs_wall")
    rows.append(
        Row("31", "stats.seconds within 5% of the caller's wall time", fig, _le(fig, 0.05), "never_slower")
    )
    return rows


def _tests_rows(data: Any) -> list[Row]:
    if not data:
        return [Row("all", "the CUDA tests pass", None, None, "cuda-tests")]
    bad = data["failures"] + data["errors"]
    fig = f"{data['passed']} passed, {bad} failed, {data['skipped']} skipped"
    return [Row("all", "the CUDA tests pass", fig, bad == 0, "cuda-tests")]


def generic_rows(issue: str, source: str, data: Any, limit: int = 40) -> list[Row]:
    """Rows of a benchmark whose JSON this suite does not know field by field (written for another
    issue): every boolean under its "targets" (a target met or not), with its path as the target; in a
    "meets" dict, the number of the same name beside it as the figure."""
    rows: list[Row] = []

    def walk(node: Any, path: list[str]) -> None:
        if not isinstance(node, dict) or len(rows) >= limit:
            return
        for key, val in node.items():
            here = [*path, str(key)]
            if isinstance(val, bool) and key != "apply":  # "apply": whether targets apply on this device
                rows.append(Row(issue, "/".join(here), val, val, source))
            elif isinstance(val, dict) and key.lower() in ("meets", "met", "passed"):
                for k, v in val.items():
                    if isinstance(v, bool):
                        fig = node.get(k) if _num(node.get(k)) is not None else None
                        rows.append(Row(issue, "/".join([*path, k]), fig, v, source))
            else:
                walk(val, here)

    walk(_get(data, "targets"), [])
    if not rows:
        rows.append(Row(issue, 'targets (none found in its JSON\'s "targets")', None, None, source))
    return rows[:limit]


# whether a benchmark ran: missing and skipped ones were not measured, which is not a miss
RAN: dict[str, bool | None] = {
    "ok": True,
    "failed": False,
    "timeout": False,
    "missing": None,
    "skipped": None,
}


def suite_rows(outcomes: dict[str, Outcome], wall_s: float, tiny: bool) -> list[Row]:
    """The summary table: every target the suite can check, from each benchmark's JSON."""
    known: dict[str, Callable[[Any], list[Row]]] = {
        "cuda-tests": _tests_rows,
        "gpu_restore": _restore_rows,
        "gpu_blend": _blend_rows,
        "data_path": _data_path_rows,
        "never_slower": _never_slower_rows,
    }
    other_issue = {"never_slower": "31", "kv_encoding": "35", "vllm_gpu": "33"}  # the rows of a missing one
    rows: list[Row] = []
    for name, o in outcomes.items():
        if name in known:
            got = known[name](o.data) if o.data is not None else []
        else:
            got = generic_rows(other_issue.get(name, "?"), name, o.data) if o.data is not None else []
        if not got or o.status != "ok":  # what was not measured, and why, stays in the table
            rows.append(
                Row(
                    other_issue.get(name, "36" if name == "gpu_blend" else "-"),
                    f"{name} runs",
                    f"{o.status}{': ' + o.reason if o.reason else ''}",
                    RAN.get(o.status),
                    name,
                )
            )
        rows.extend(got)
    rows.append(
        Row(
            "36",
            "the whole suite within 8 minutes (one 10-minute call)",
            round(wall_s, 1),
            None if tiny else wall_s <= 480.0,
            "gpu_suite",
        )
    )
    return rows


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x).replace("|", "/").replace("\n", " ")


def markdown(rows: list[Row], outcomes: dict[str, Outcome], header: dict[str, Any]) -> str:
    met = {True: "yes", False: "**NO**", None: "not measured"}
    lines = [
        "# GPU suite summary",
        "",
        f"{header['device']}; torch {header['torch']}; commit {header['code'].get('commit')} "
        f"(library changed since: {header['code'].get('library_dirty')}); {header['time_utc']}; "
        f"{header['wall_s']:.0f} s in all{' (tiny, CPU smoke run)' if header['tiny'] else ''}",
        "",
        "| issue | target | figure | met | from |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.issue} | {_cell(r.target)} | {_cell(r.figure)} | {met[r.met]} | {r.source} |" for r in rows
    ]
    lines += ["", "| benchmark | status | exit code | seconds | why |", "|---|---|---|---|---|"]
    lines += [
        f"| {o.name} | {o.status} | {_cell(o.rc)} | {o.seconds:.0f} | {_cell(o.reason)} |"
        for o in outcomes.values()
    ]
    return "\n".join(lines) + "\n"


def device_info() -> dict[str, Any]:
    """The torch version and device of the suite's own process (torch imported only here)."""
    try:
        import torch
    except ImportError:
        return {"torch": None, "device": "no torch"}
    if torch.cuda.is_available():
        return {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    return {"torch": torch.__version__, "device": "cpu (no CUDA)"}


def run_suite(args: argparse.Namespace) -> tuple[list[Row], dict[str, Outcome]]:
    t0 = time.perf_counter()
    deadline = t0 + args.budget
    outcomes: dict[str, Outcome] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_suite-") as tmp:
        work = Path(tmp)
        for e in entries(args.tiny):
            if args.only and e.name not in args.only:
                continue
            if args.tiny and e.tiny_skip:
                outcomes[e.name] = Outcome(
                    e.name, "skipped", reason="no smoke run in --tiny (its own CI has one)"
                )
                continue
            left = deadline - time.perf_counter()
            if left < MIN_START_S:
                outcomes[e.name] = Outcome(
                    e.name, "skipped", reason=f"the suite's {args.budget:.0f} s were spent"
                )
                continue
            limit = min(e.budget_s * (args.tiny_scale if args.tiny else 1.0), left)
            print(f"[gpu_suite] {e.name}: up to {limit:.0f} s", flush=True)
            o = outcomes[e.name] = run_entry(e, limit, work)
            print(f"[gpu_suite] {e.name}: {o.status} in {o.seconds:.0f} s {o.reason}", flush=True)
            write_outputs(
                args, outcomes, code_version(), time.perf_counter() - t0
            )  # a cut-short run keeps it
    wall = time.perf_counter() - t0
    rows = write_outputs(args, outcomes, code_version(), wall)
    return rows, outcomes


def write_outputs(
    args: argparse.Namespace, outcomes: dict[str, Outcome], code: dict, wall_s: float
) -> list[Row]:
    """The four files of the output folder, rewritten after every benchmark."""
    rows = suite_rows(outcomes, wall_s, args.tiny)
    header = {
        **device_info(),
        "code": code,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": wall_s,
        "budget_s": args.budget,
        "tiny": args.tiny,
    }
    summary = {
        "benchmark": "gpu_suite",
        **header,
        "rows": rows,
        "benchmarks": {
            o.name: {
                "status": o.status,
                "rc": o.rc,
                "seconds": o.seconds,
                "reason": o.reason,
                "command": o.command,
                "log_tail": o.log[-LOG_TAIL:],
            }
            for o in outcomes.values()
        },
    }
    (args.out / "summary.md").write_text(markdown(rows, outcomes, header))
    write_json(args.out / "summary.json", summary)
    write_json(args.out / "results.json", {o.name: o.data for o in outcomes.values() if o.data is not None})
    logs = [
        f"===== {o.name}: {o.status} {o.reason}\n$ {' '.join(o.command)}\n{o.log}" for o in outcomes.values()
    ]
    (args.out / "logs.txt").write_text("\n".join(logs))
    return rows


def unbundle(results: Path, machine: str, dest: Path) -> list[Path]:
    """Write each benchmark's JSON from `results.json` as `dest/<name>-<machine>.json` (the form the
    results are committed in)."""
    written = []
    for name, data in json.loads(results.read_text()).items():
        if name == "cuda-tests":
            continue
        path = dest / f"{name}-{machine}.json"
        write_json(path, data)
        written.append(path)
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT}; --tiny: -tiny)"
    )
    p.add_argument("--budget", type=float, default=None, help="total seconds (default 480; --tiny 900)")
    p.add_argument(
        "--tiny", action="store_true", help="every benchmark's CPU smoke mode: a test of the suite"
    )
    p.add_argument("--tiny-scale", type=float, default=3.0, help="--tiny: each benchmark's limit x this")
    p.add_argument("--only", nargs="+", default=None, help="run only these benchmarks (by name)")
    p.add_argument(
        "--unbundle", type=Path, default=None, help="a results.json to split into benchmarks/results/"
    )
    p.add_argument("--machine", default="h100", help="--unbundle: the machine named in the file names")
    args = p.parse_args(argv)
    args.out = args.out or (DEFAULT_OUT.with_name("gpu_suite-tiny") if args.tiny else DEFAULT_OUT)
    args.budget = args.budget or (900.0 if args.tiny else 480.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.unbundle is not None:
        for path in unbundle(args.unbundle, args.machine, BENCH / "results"):
            print(f"wrote {path}")
        return 0
    rows, outcomes = run_suite(args)
    print((args.out / "summary.md").read_text())
    print(f"wrote {args.out}/summary.md, summary.json, results.json, logs.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
