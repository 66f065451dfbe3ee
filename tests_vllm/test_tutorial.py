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
