"""benchmarks/serving.py's smoke mode, end to end: real vLLM OpenAI servers, driven over HTTP with
streaming, restarted between the warm-up and the measured requests. After the restart kvrestore's server
loads what the warm-up's saved (its `/metrics` counters say so), and every measured request's greedy
output is vLLM alone's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "serving.py"


def test_the_serving_benchmark_runs(tmp_path):
    out = tmp_path / "serving.json"
    cmd = [sys.executable, str(BENCH), "--smoke", "--out", str(out), "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    results = result["results"]
    assert sorted(results) == ["kvrestore default split @ local directory", "vllm alone"]
    ours = results["kvrestore default split @ local directory"]
    for label, r in results.items():
        for name, w in r["workloads"].items():
            assert w["n"] > 0 and w["ttft_p50_s"] <= w["ttft_p99_s"], (label, name)
            assert w["same_output_as_vllm_alone"], (label, name, w["mismatched"])
            assert all(q["text"] for q in w["requests"]), (label, name)
    assert ours["metrics"]["loaded_tokens"] > 0 and ours["metrics"]["load_failures"] == 0
    assert ours["metrics"]["hit_tokens"] >= ours["metrics"]["loaded_tokens"]
    assert set(result["targets"]) == {"multi-round QA @ local directory", "long-doc QA @ local directory"}
