"""Host calls per loaded layer of a prompt's layer reads: the torch ops the loader launches, counted.

A layer-wise restore on a GPU reads one layer of every stored chunk at a time, and the vLLM connector
on a GPU a few layers at a time. On an H100 (`gpu_restore.py --profile`, 16k tokens in 64 chunks) that
loader was bound by its host calls, not the link: one upload and one placement per chunk and layer,
2,240 torch copies per restore, beside a compute lane bound by its own launches. This counts, on any
machine, the ops the loader's device path launches per loaded layer (`LayerReader` with deferred
checks, the layer-wise restore's setting on CUDA, run here on a CPU cache: the same ops, without streams
and events), one layer per read, for a prompt of many chunks stored in a `MemoryStore`, and checks the
cache it fills against the stored KV.

    python benchmarks/load_ops.py                      # 64 chunks of 32 tokens, 8 layers
    python benchmarks/load_ops.py --chunks 16 --out /tmp/ops.json

Writes benchmarks/results/load_ops.json. Counted, not timed: the figure does not depend on the machine.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import machine_info, print_table, write_json
from _provenance import code_version
from blend_ops import OpTally
from gpu_restore import build_model

from kvrestore import ComputeOnly, Restorer
from kvrestore.chunkio.layers import LayerReader
from kvrestore.chunkio.stored import StoredChunk
from kvrestore.core.kv import KVCache
from kvrestore.stores import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "load_ops.json"


def count(args: argparse.Namespace, tail: int) -> dict[str, Any]:
    """Every layer of a prompt of `args.chunks` chunks (the last `tail` tokens shorter), read one layer
    per read: the launching ops of each read, in all and per layer, and whether the cache holds the
    stored KV."""
    _, backend, _ = build_model(tiny=True, device=torch.device("cpu"), seed=0, layers=args.layers)
    n = args.chunks * args.chunk_tokens - tail
    tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    reads: list[OpTally] = []

    class CountingReader(LayerReader):
        def _upload_layers(self, layers, sections, kv):  # type: ignore[no-untyped-def]
            with OpTally() as tally:
                bad = super()._upload_layers(layers, sections, kv)
            reads.append(tally)
            return bad

    async def main() -> torch.Tensor:
        store = MemoryStore()
        async with Restorer(backend, store, chunk_size=args.chunk_tokens) as r:
            full = (await r.restore(tokens, ComputeOnly())).kv
            await r.save(tokens, full)
            _, refs = r.chunks(tokens)
        stored = [StoredChunk(ref.key, ref.start, ref.start, ref.n_tokens) for ref in refs]
        kv = KVCache.empty(backend.spec, n)
        reader = CountingReader(backend.spec, store, stored, defer_checks=True)
        await reader.open()
        for layer in range(args.layers):
            await reader.read_layer(layer, kv)
        await reader.verify()
        return (kv.data - full.data).abs().max()

    diff = float(anyio.run(main))
    launching = sum(sum(t.launching.values()) for t in reads)
    return {
        "tokens": n,
        "chunks": args.chunks,
        "reads": len(reads),
        "launching": launching,
        "launching_per_layer": launching / args.layers,
        "by_op": dict(sum((t.launching for t in reads), collections.Counter())),
        "max_abs_diff_vs_stored": diff,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=64, help="stored chunks (default 64)")
    p.add_argument("--chunk-tokens", type=int, default=32, help="tokens per chunk (default 32)")
    p.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--tiny", action="store_true", help="8 chunks: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.chunks = 8
    rows = {"whole chunks": count(args, 0), "a partial last chunk": count(args, args.chunk_tokens // 2)}
    print_table(
        ["prompt", "tokens", "reads", "launching ops", "per loaded layer", "max |diff| vs stored"],
        [
            [
                name,
                r["tokens"],
                r["reads"],
                r["launching"],
                f"{r['launching_per_layer']:.1f}",
                r["max_abs_diff_vs_stored"],
            ]
            for name, r in rows.items()
        ],
        title=f"layer reads of {args.chunks} chunks, one layer per read (device path, deferred checks)",
    )
    write_json(
        args.out,
        {
            "benchmark": "load_ops",
            "config": {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "layers": args.layers},
            "machine": machine_info(),
            "code": code_version(),
            "results": rows,
        },
    )
    print(f"wrote {args.out}", file=sys.stderr)
    ok = all(r["max_abs_diff_vs_stored"] == 0 for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
