"""benchmarks/vllm_gpu.py's CPU smoke mode runs every case end to end (a tiny Llama shape, dummy
weights, short prompts): each kvrestore case gives vLLM alone's first token, and the JSON it writes
names the machine and holds a TTFT for every case that runs here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the CPU run")
def test_the_gpu_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cpu_count"] >= 1 and result["device"] == "cpu"
    assert result["mismatched"] == []
    for n in ("256", "512"):
        cases = result["results"][n]["cases"]
        kvrestore = [name for name in cases if name.startswith("kvrestore")]
        assert len(kvrestore) == 4, sorted(cases)  # memory, file, load-all and planned at 1x
        for name in kvrestore:
            assert cases[name]["same_first_token"] and cases[name]["ttft_s"] > 0, name
        assert cases["kvrestore load-all (file)"]["tokens_loaded"] == [int(n) - 128]  # whole blocks
