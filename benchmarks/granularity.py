"""How the two-pointer's fetch and compute granularities change its TTFT (how its defaults were chosen).

    python benchmarks/granularity.py [--tokens 4096] [--rounds 2] [--multipliers 0.5,1,2]

The fetch granularity is the store's chunk size (128 or 256 tokens here); the compute granularity is
`TokenTwoPointer(compute_chunks=...)` stored chunks per compute unit. For each bandwidth (a multiple of
the balance point, measured first with 256-token chunks) every combination restores the same prompt in
interleaved rounds; restore times are reported as ratios to the default (256-token chunks, 2 per unit).
Writes benchmarks/results/granularity.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import anyio
import torch
from _common import format_table, machine_info, median, write_json

from kvrestore import ComputeOnly, Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.stores import FsspecStore, ThrottledStore
from kvrestore.tools.text import reference_tokens

COMBOS = [(128, 1), (128, 2), (128, 4), (256, 1), (256, 2), (256, 4), (512, 1)]
DEFAULT = (256, 2)


async def main(tokens: int, rounds: int, multipliers: list[float]) -> dict:
    backend = HFBackend.from_smollm2(dtype=torch.float32)
    prompt = reference_tokens(backend.tokenizer, tokens)
    tmp = Path(tempfile.mkdtemp(prefix="kvrestore-granularity-"))
    stores, saved = {}, {}
    for size in sorted({c for c, _ in COMBOS}):
        stores[size] = FsspecStore((tmp / str(size)).as_uri())
        saved[size] = (await Restorer(backend, stores[size], size).save(prompt)).bytes_written
    local = Restorer(backend, stores[256], 256)
    await local.restore(prompt, ComputeOnly())  # warm-up
    compute_s = median([(await local.restore(prompt, ComputeOnly())).stats.seconds for _ in range(2)])
    balance = saved[256] / compute_s
    print(f"compute-only {compute_s:.2f} s, balance {balance / 1e6:.2f} MB/s", flush=True)
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        for m in multipliers:
            for size, unit in COMBOS:
                store = ThrottledStore(stores[size], balance * m)
                res = await Restorer(backend, store, size).restore(prompt, TokenTwoPointer(unit))
                times.setdefault(f"{m}|{size}|{unit}", []).append(res.stats.seconds)
                print(
                    f"  [round {r + 1}] {m}x chunk {size} unit {unit}: {res.stats.seconds:.2f} s", flush=True
                )
    rows, out = [], []
    for m in multipliers:
        base = median(times[f"{m}|{DEFAULT[0]}|{DEFAULT[1]}"])
        for size, unit in COMBOS:
            t = median(times[f"{m}|{size}|{unit}"])
            rows.append([f"{m}x", size, unit, f"{t:.2f}", f"{t / base:.3f}"])
            out.append(
                {
                    "multiplier": m,
                    "chunk_size": size,
                    "compute_chunks": unit,
                    "median_s": t,
                    "vs_default": t / base,
                    "samples": times[f"{m}|{size}|{unit}"],
                }
            )
    print(
        format_table(
            ["bw", "chunk", "unit", "restore s", "vs 256x2"],
            rows,
            title=f"two-pointer restore, {tokens} tokens, median of {rounds}",
        )
    )
    return {
        "tokens": tokens,
        "balance_bytes_per_s": balance,
        "compute_only_s": compute_s,
        "results": out,
        "machine": machine_info(),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--multipliers", default="0.5,1,2")
    a = ap.parse_args()
    result = anyio.run(main, a.tokens, a.rounds, [float(x) for x in a.multipliers.split(",")])
    path = write_json(Path(__file__).resolve().parent / "results" / "granularity.json", result)
    print(f"wrote {path}")
