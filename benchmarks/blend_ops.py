"""Device ops per CacheBlend selective layer: what each layer launches, counted, not timed.

On a GPU a selective layer of a few thousand tokens is bound by launches as much as by arithmetic, so
the number of kernel-launching ops each layer queues is a figure worth tracking on any machine. This
runs `restore_blend` at 15% on the seeded tiny Llama of `gpu_restore.py` (4 x 200 tokens + 16, 8 layers;
the op count does not depend on the model's size) with the attention in 4 groups, and counts, under a `TorchDispatchMode` in the
compute lane, every op between a selective layer's start and end:

* **launching**: ops that produce new data (views and no-op casts excluded) -- one kernel each on CUDA;
* **syncing**: ops that read a device result back to the host (`.item()`, `nonzero`, ...): must be 0.

And the loader's side: the ops its device path (deferred checks, here on a CPU cache) launches per
loaded layer, and how many reads (one worker-thread hop each) it makes, reading one layer per read
against four (`LayerReader.read_plan`, the default on CUDA). The loader shares the host with the compute
lane, whose selective layers are bound by their launches on a GPU.

Prints the per-op tally of one selective layer and writes benchmarks/results/blend_ops.json.

    python benchmarks/blend_ops.py

On 2026-11-23 (torch 2.13 CPU): 58 per selective layer (K and V stacked once for the deviation, the
kept rows' gather and the candidates' update); 62 before that; 70 on commit d9ec357 before the gathers
were merged (`benchmarks/results/blend_ops-d9ec357.json`, this script run against that commit's
library). In bf16 (the GPU's dtype), where the deviation's cast to float32 launches too: 59, from 64.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import machine_info, print_table, write_json
from _provenance import code_version
from gpu_restore import build_model
from torch.utils._python_dispatch import TorchDispatchMode

import kvrestore.blend.fuse as fuse
from kvrestore import Blend, Restorer
from kvrestore.blend.chunks import StoreChunkSource
from kvrestore.stores import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "blend_ops.json"
SYNCING = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "unique_consecutive",
}


class OpTally(TorchDispatchMode):
    """Counts the ops dispatched while active, split into launching, view/no-op and syncing ones."""

    def __init__(self) -> None:
        super().__init__()
        self.launching: collections.Counter[str] = collections.Counter()
        self.other: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # a cast to the dtype a tensor already has returns it: no kernel (an in-place op returns it too)
        no_op = not name.endswith("_") and isinstance(out, torch.Tensor) and any(out is a for a in args)
        (self.other if func.is_view or no_op else self.launching)[name] += 1
        return out


def count_loader(args: argparse.Namespace, layers_per_read: int) -> dict[str, Any]:
    """The loader's ops on the device path (deferred checks, run here on a CPU cache: the same ops as
    on CUDA, without streams and events), reading `layers_per_read` layers per read: how many reads
    (one worker-thread hop each) and how many launching ops, in all and per loaded layer."""
    _, backend, _ = build_model(tiny=True, device=torch.device("cpu"), seed=0, layers=args.layers)
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, 256, (args.chunk_tokens,), generator=g) for _ in range(args.chunks)]
    suffix = torch.randint(0, 256, (16,), generator=g)
    reads: list[OpTally] = []

    class CountingSource(StoreChunkSource):
        def _upload_layers(self, layers, sections, kv):  # type: ignore[no-untyped-def]
            with OpTally() as tally:
                bad = super()._upload_layers(layers, sections, kv)
            reads.append(tally)
            return bad

    source = functools.partial(CountingSource, defer_checks=True, layers_per_read=layers_per_read)

    async def main() -> None:
        async with Restorer(backend, MemoryStore()) as r:
            for c in chunks:
                await r.save_chunk(c)
            original, fuse.StoreChunkSource = fuse.StoreChunkSource, source  # type: ignore[assignment]
            try:
                await r.restore_blend(chunks, suffix, Blend(recompute_ratio=0.15))  # warm-up
                reads.clear()
                await r.restore_blend(chunks, suffix, Blend(recompute_ratio=0.15))
            finally:
                fuse.StoreChunkSource = original  # type: ignore[misc]

    anyio.run(main)
    launching = sum(sum(t.launching.values()) for t in reads)
    loaded = args.layers - 1
    return {
        "layers_per_read": layers_per_read,
        "reads": len(reads),
        "launching": launching,
        "launching_per_layer": launching / loaded,
        "reads_per_layer": len(reads) / loaded,
        "by_op": dict(sum((t.launching for t in reads), collections.Counter())),
    }


def count(args: argparse.Namespace) -> list[OpTally]:
    _, backend, _ = build_model(tiny=True, device=torch.device("cpu"), seed=0, layers=args.layers)
    backend.blend.attention_groups, backend.blend.group_rows = args.groups, 16
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 256, (args.chunk_tokens,), generator=g) for _ in range(args.chunks)]
    suffix = torch.randint(0, 256, (16,), generator=g)
    tallies: list[OpTally] = []

    class CountingTimer(fuse.LayerTimer):
        def start(self):  # type: ignore[no-untyped-def]
            tallies.append(OpTally())
            tallies[-1].__enter__()
            return super().start()

        def stop(self, i, mark, wait=False):  # type: ignore[no-untyped-def]
            super().stop(i, mark, wait)
            tallies[-1].__exit__(None, None, None)

    async def main() -> None:
        async with Restorer(backend, MemoryStore()) as r:
            for c in chunks:
                await r.save_chunk(c)
            await r.restore_blend(chunks, suffix, Blend(recompute_ratio=0.15))  # warm-up, not counted
            tallies.clear()
            original, fuse.LayerTimer = fuse.LayerTimer, CountingTimer
            try:
                await r.restore_blend(chunks, suffix, Blend(recompute_ratio=0.15))
            finally:
                fuse.LayerTimer = original

    anyio.run(main)
    return tallies[1:]  # the selective layers (layer 0 is a full layer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=200)
    p.add_argument("--groups", type=int, default=4, help="backend.blend.attention_groups (default 4)")
    p.add_argument("--tiny", action="store_true", help="4 layers of 100-token chunks: a smoke test")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.chunk_tokens = 4, 100
    tallies = count(args)
    launching = [sum(t.launching.values()) for t in tallies]
    syncing = [sum(n for name, n in {**t.launching, **t.other}.items() if name in SYNCING) for t in tallies]
    first = tallies[0]
    print_table(
        ["op", "count"],
        [[name, n] for name, n in first.launching.most_common()],
        title=f"kernel-launching ops of selective layer 1 ({launching[0]} in all)",
    )
    print(f"launching ops per selective layer: {launching}; syncing ops: {syncing}")
    loader = [count_loader(args, n) for n in (1, 4)]
    print_table(
        ["layers per read", "reads", "launching ops", "per loaded layer", "reads per layer"],
        [
            [
                x["layers_per_read"],
                x["reads"],
                x["launching"],
                f"{x['launching_per_layer']:.1f}",
                f"{x['reads_per_layer']:.2f}",
            ]
            for x in loader
        ],
        title=f"the blend loader's device path ({args.layers - 1} loaded layers of {args.chunks} chunks)",
    )
    result: dict[str, Any] = {
        "benchmark": "blend_ops",
        "config": vars(args) | {"out": str(args.out), "ratio": 0.15, "dtype": "float32"},
        "machine": machine_info(),
        "code": code_version(),
        "launching_per_layer": launching,
        "syncing_per_layer": syncing,
        "layer1_launching": dict(first.launching),
        "layer1_views_and_no_ops": dict(first.other),
        "loader": loader,
    }
    write_json(args.out, result)
    return 0 if not any(syncing) else 1


if __name__ == "__main__":
    sys.exit(main())
