"""`serve.py` in a process where xxh3-64 has perfect second preimages (`tests/forgery.py`): the attacker
the forgery tests simulate, here inside a real vLLM engine.

    python tests_vllm/forged_serve.py PREIMAGES.json [serve.py's arguments]

PREIMAGES.json maps each forged section's digest (`tests.forgery._digest`, hex) to the genuine
section's xxh3-64; every reader in the process (vLLM's engine runs in it) then sees the genuine
checksum for the forged bytes.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.forgery import SecondPreimages  # noqa: E402

if __name__ == "__main__":
    table = json.loads(Path(sys.argv.pop(1)).read_text())
    preimages = SecondPreimages(pytest.MonkeyPatch())
    preimages.table.update({bytes.fromhex(k): v for k, v in table.items()})
    sys.argv[0] = str(HERE / "serve.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
