"""docs/tutorial-vllm.md runs: its python blocks, in order, as one script in a new process (vLLM's
engine is one per process here). The main suite's tests/test_docs.py leaves this page to this tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "tutorial-vllm.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_vllm_tutorial_runs(tmp_path):
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 5
    script = tmp_path / "tutorial_vllm.py"
    script.write_text("\n\n".join(blocks))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]  # its own asserts: tokens, records


def test_the_server_commands_python_and_model_dir_come_from_lines_that_work(tmp_path):
    """The shell lines before `vllm serve`'s command set `$PYTHON` and `$MODEL_DIR`: run as written (the
    Python is this tier's virtualenv's), they name a checkpoint vLLM can load."""
    text = DOC.read_text()
    lines = [line for line in text.splitlines() if line.startswith(("PYTHON=", "MODEL_DIR="))]
    assert [line.split("=", 1)[0] for line in lines] == ["PYTHON", "MODEL_DIR"]
    script = "\n".join([f"PYTHON={sys.executable}", lines[1], 'printf %s "$MODEL_DIR"'])
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600, check=True)
    assert (Path(proc.stdout) / "config.json").is_file()
