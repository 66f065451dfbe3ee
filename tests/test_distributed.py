"""Stage-parallel restore with real processes over gloo on the CPU (`kvrestore.distributed`)."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore import Restorer, codec, open_store
from kvrestore.core.errors import StageFailedError
from kvrestore.distributed import StageLayout, save_with_boundaries, spawn
from tests import stage_workers as w

ATOL = 1e-5  # the restore tests' tolerance (tests/test_restorer.py)


def _save(path, layout: StageLayout, drop_boundaries=(), drop_chunks=()) -> list[str]:
    """Save the workers' prompt with boundary activations, then delete some; returns the chunk keys."""
    b = w.backend()

    async def main():
        store = open_store(f"file://{path}")
        restorer = Restorer(b, store, w.CHUNK)
        await save_with_boundaries(restorer, w.tokens(), layout)
        _, refs = restorer.chunks(w.tokens())
        for c in drop_boundaries:
            for layer in layout.boundaries:
                await store.delete(codec.boundary_key(refs[c].key, layer))
        for c in drop_chunks:
            await store.delete(refs[c].key)
        return [r.key for r in refs]

    return anyio.run(main)


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    b = w.backend()
    return b.prefill_chunk(w.tokens(), None, 0).data


def test_two_stages_restore_exactly_or_fail_on_every_rank(tmp_path_factory, reference):
    """Two processes (one spawn, several restores): every policy, with all activations, without some
    (pipelined), sequentially, with one stage's KV reads failing (computed from activations instead), and
    with rank 0's store lookup failing (everything computed in the pipeline): the gathered shards equal a
    full prefill every time. With stage 1's activations unreadable, both ranks
    raise StageFailedError naming stage 1, and the group still serves the next restore."""
    layout = StageLayout.even(w.LAYERS, 2)
    full, holes = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("holes")
    _save(full, layout)
    _save(holes, layout, drop_boundaries=(2, 3), drop_chunks=(6,))  # 7 chunks of 16 tokens
    runs = [
        (str(full), "two-pointer", "", 0),
        (str(full), "compute-only", "", 0),
        (str(full), "load-only", "", 0),
        (str(holes), "two-pointer", "", 0),
        (str(holes), "compute-only", "", 0),
        (str(full), "two-pointer", "", 1),
        (str(full), "load-only", "ranges", 0),
        (str(full), "compute-only", "gets", 0),
        (str(full), "two-pointer", "", 0),
        (str(full), "two-pointer", "lookup", 0),
    ]
    out = spawn(w.restore_runs, 2, runs, timeout_s=30.0)
    for i in (0, 1, 2, 3, 4, 5, 6, 8, 9):
        rank0, rank1 = out[0][i], out[1][i]
        assert "error" not in rank0 and "error" not in rank1, (runs[i], rank0, rank1)
        torch.testing.assert_close(
            rank0["kv"], reference, atol=ATOL, rtol=0, msg=lambda m, i=i: f"{runs[i]}: {m}"
        )
        assert rank1["kv"] is None
        for r in (rank0, rank1):
            s = r["stats"]
            assert s.computed_chunks + s.loaded_chunks == 7
    compute_only, load_only = out[1][1]["stats"], out[1][2]["stats"]
    assert compute_only.computed_chunks == 7 and compute_only.boundary_bytes > 0  # from activations
    assert load_only.loaded_chunks == 7 and load_only.boundary_bytes == 0
    holes_stage1 = out[1][4]
    assert holes_stage1["pipelined"] == [False, False, True, True, False, False, False]
    assert out[0][4]["pipelined"] == holes_stage1["pipelined"]  # stage 0 computes them too, and sends
    failed_reads = out[1][6]["stats"]
    assert failed_reads.failed_loads == 7 and failed_reads.computed_chunks == 7  # every load failed: computed
    assert out[0][9]["pipelined"] == out[1][9]["pipelined"] == [True] * 7  # no lookup: all in the pipeline
    for rank in (0, 1):
        failed = out[rank][7]
        assert failed["error"] == "StageFailedError" and list(failed["failures"]) == [1]
        assert "boundary activation" in failed["message"]


@pytest.mark.slow
def test_a_dead_rank_fails_the_others_within_the_timeout(tmp_path):
    """Stage 1's process dies during the restore: stage 0 raises StageFailedError (no hang), and spawn
    reports the dead process."""
    layout = StageLayout.even(w.LAYERS, 2)
    _save(tmp_path, layout)
    with pytest.raises(StageFailedError) as info:
        spawn(w.restore_runs, 2, [(str(tmp_path), "compute-only", "die", 0)], timeout_s=10.0)
    assert "exited with code 3" in info.value.failures[1]
    assert info.value.results[0][0]["error"] == "StageFailedError"


@pytest.mark.slow
def test_stages_benchmark_tiny(tmp_path):
    """benchmarks/stages.py runs end to end in its tiny mode (speed is claimed from the benchmark itself)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "stages.json"
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "stages.py"), "--tiny", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["exactness"]["max_abs_diff"] <= 1e-5
    assert [p["multiplier"] for p in data["result"]["grid"]] == [0.5, 1.0, 2.0]
    for p in data["result"]["grid"]:
        assert p["S1_s"] > 0 and p["S2_s"] > 0 and p["S2_seq_s"] > 0
        assert set(p["sim_s"]) == {"1", "2", "4", "8"}
    assert 0.06 < data["boundary_share"]["Llama-3.1-8B shape (bf16)"]["share_of_chunk_kv"] < 0.07
