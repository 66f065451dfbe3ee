"""A restarted vLLM server with a secret takes none of a forged chunk (`make test-vllm`).

A server with `KVRESTORE_SECRET` saves a prompt; every section of every chunk it saved is then forged as
an attacker who can write the store would (`tests/forgery.py`: header and MAC kept, each section's
device sum kept, its xxh3-64 kept by simulated perfect second preimages, `forged_serve.py`), so that
only the GMAC tags tell. A new server with the same secret asks the same prompt: it loads nothing,
computes it, answers as the server that computed it first did, and leaves the forged chunks in the
store: a forgery is a miss, not proven damage (`core.errors.proves_damage`), so it is not deleted (a
save of the prompt writes its genuine chunks over it; the new server does not save, so the store shows
what its load did).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from test_connector import N_CHUNKS, N_TOKENS, VLLM, VLLM_ENV, Served, assert_same_generation  # noqa: E402

from tests.forgery import SecondPreimages, forge  # noqa: E402

SECRET = {"KVRESTORE_SECRET": "a secret shared by the servers of this test only"}


def serve(model: Path, store: dict, preimages: Path | None = None) -> Served:
    """The prompt served once by a new vLLM process with the connector and the secret; with
    `preimages`, forged sections' checksums seen as genuine and nothing saved (a save would write the
    prompt's genuine chunks over the forged ones, hiding whether the load deleted them)."""
    script = (
        [str(HERE / "serve.py")] if preimages is None else [str(HERE / "forged_serve.py"), str(preimages)]
    )
    cmd = [sys.executable, *script, "--model", str(model), "--tokens", str(N_TOKENS), "--metrics"]
    cmd += [
        "--connector",
        "kvrestore",
        "--extra",
        json.dumps({**store, "split": "load_all", "save": preimages is None}),
    ]
    env = {**os.environ, **VLLM_ENV, **SECRET}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"vLLM exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    (last,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"records"')]
    return Served({r["offset"]: r for r in rows}, rows, last["records"], last["metrics"], proc.stderr)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvrestore.backends.hf import smollm2_checkpoint

    return smollm2_checkpoint()


def test_a_server_with_the_secret_loads_no_forged_chunk(model_dir, tmp_path, monkeypatch):
    store = {"store_url": str(tmp_path / "kv"), "cost_dir": str(tmp_path / "costs")}
    first = serve(model_dir, store)
    assert not first.events("loaded")  # nothing stored yet: vLLM computed the prompt
    paths = sorted(Path(store["store_url"]).rglob("*.kvc"))
    assert len(paths) == N_CHUNKS
    preimages = SecondPreimages(monkeypatch)
    forged = {}
    for seed, path in enumerate(paths):
        forged[path] = forge(path.read_bytes(), seed, preimages)
        path.write_bytes(forged[path])
    table = tmp_path / "preimages.json"
    table.write_text(json.dumps({k.hex(): v for k, v in preimages.table.items()}))

    second = serve(model_dir, store, table)
    assert not second.events("loaded")
    (failed,) = second.events("load_failed")
    assert failed["failed"] == N_CHUNKS and failed["from_token"] == 0, failed
    if VLLM >= (0, 32):  # vLLM 0.26's stats leave out the step whose blocks did not load
        assert second.metrics["loaded_tokens"] == 0 and second.metrics["failed_chunks"] == N_CHUNKS
    assert_same_generation(second.results[0], first.results[0])
    # not proven damaged: every forged chunk is still there, as the attacker wrote it
    assert [p.exists() and p.read_bytes() == forged[p] for p in paths] == [True] * N_CHUNKS
