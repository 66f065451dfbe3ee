"""Host calls per loaded layer of a prompt's layer reads: the torch ops the loader launches, counted.

A layer-wise restore on a GPU reads one layer of every stored chunk at a time, and the vLLM connector
on a GPU a few layers at a time. On an H100 (`gpu_restore.py --profile`, 16k tokens in 64 chunks) that
loader was bound by its host calls, not the link: one upload and one placement per chunk and layer,
2,240 torch copies per restore, beside a compute lane bound by its own launches. This counts, on any
machine, the ops the loader's device path launches per loaded layer (`LayerReader` with deferred
checks, the layer-wise restore's setting on CUDA, run here on a CPU cache: the same ops, without streams
and events), one layer per read, for a prompt of many chunks stored in a `MemoryStore`, and checks the
cache it fills against the stored KV.

The vLLM connector's device load (a `chunkio.layer_load.LayerLoad` into `page_dest.RowPages` with
`device_path=True`, the path it takes into CUDA pages, run here on CPU pages shaped as the CUDA
layout's) is counted the same way, from 16 to 1,024 pages of 16 tokens (one chunk of 256 tokens to 64
of them), two layers per read: the ops its reads and its page writes (`pages._scatter_device`, the
device branch of `pages.scatter`) launch per loaded layer, and its host synchronisations per loaded layer, the calls that wait for a
device on CUDA (`Tensor.tolist`, `.item`, `.cpu`, a stream's or an event's `synchronize`). The pages
are checked against the stored KV, token by token. Target (issue 48): both constant in the number of
pages.

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

from kvrestore import ComputeOnly, Restorer, codec
from kvrestore.chunkio.layers import LayerReader
from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.core.spec import ModelSpec
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
        stored = list(refs)
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


#: the calls that make the host wait for a device on CUDA, counted by name while a load runs
SYNCING = (
    (torch.Tensor, "tolist"),
    (torch.Tensor, "item"),
    (torch.Tensor, "cpu"),
    (torch.cuda.Stream, "synchronize"),
    (torch.cuda.Event, "synchronize"),
)


class SyncTally:
    """Counts the calls of `SYNCING` made while active (from any thread)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> SyncTally:
        for owner, name in SYNCING:
            original = getattr(owner, name)

            def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            self._saved.append((owner, name, original))
            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def count_connector(pages: int, layers: int, block_size: int = 16, chunk_tokens: int = 256) -> dict[str, Any]:
    """The connector's device load of `pages` pages (a prompt of `pages * block_size` tokens in chunks of
    `chunk_tokens`) into pages in the CUDA layout, scattered over a cache of twice as many: launching ops
    and host syncs per loaded layer, and whether every page holds the stored KV."""
    from kvrestore.chunkio.layer_load import LayerLoad
    from kvrestore.chunkio.page_dest import RowPages
    from kvrestore.chunkio.pages import _scatter_device, gather
    from kvrestore.core.sync import LoopThread
    from kvrestore.integrations.vllm.layouts import kv_views

    H, D = 2, 8
    spec = ModelSpec("tiny", layers, H, D, 256, torch.float32, fingerprint="ab" * 16)
    n = pages * block_size
    kv = torch.randn(layers, 2, H, n, D, generator=torch.Generator().manual_seed(2))
    store = MemoryStore()
    refs = chunk_keys(list(range(n)), spec.fingerprint, chunk_tokens)
    for r in refs:
        blob = codec.encode_chunk(KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()), spec, r.key)
        anyio.run(store.put, r.key, blob)
    caches = [torch.zeros(2 * pages, block_size, H, 2 * D).permute(0, 2, 1, 3) for _ in range(layers)]
    block_ids = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(3))[:pages].tolist()
    places: list[OpTally] = []
    reads: list[OpTally] = []

    class DeviceWrites:  # `page_dest.Writes` through the device branch of the page writes, counted
        queues = False

        def put(self, layer: int, pieces: list[Any]) -> None:
            k, v = kv_views(caches[layer], "cuda", H, D)
            with OpTally() as tally:
                for p in pieces:
                    _scatter_device(k, v, block_ids, p.start, p.kv())
            places.append(tally)

        def flush(self, layer: int) -> None:
            pass

    upload = LayerReader._upload_layers

    def counted(self, layers, sections, kv):  # type: ignore[no-untyped-def]
        with OpTally() as tally:
            bad = upload(self, layers, sections, kv)
        reads.append(tally)
        return bad

    io = LoopThread()
    LayerReader._upload_layers = counted  # type: ignore[method-assign]  # every read of the load's reader
    try:
        load = LayerLoad(
            spec,
            store,
            refs,
            n,
            RowPages(DeviceWrites()),
            layers_per_read=2,
            rows=RowPages.buffer(spec, refs, 2, torch.device("cpu")),
            lane=TransferLane(StagingPool()),
            device_path=True,
        )
        with SyncTally() as syncs:
            load.start(io, 60.0)
            placed = all(load.wait(layer) for layer in range(layers))
            assert load.future is not None
            load.future.result(timeout=60)
    finally:
        LayerReader._upload_layers = upload  # type: ignore[method-assign]
        io.close()
    exact = (
        placed
        and not load.failed
        and all(
            torch.equal(gather([kv_views(caches[layer], "cuda", H, D)], block_ids, 0, n)[0], kv[layer])
            for layer in range(layers)
        )
    )
    launching = sum(sum(t.launching.values()) for t in [*reads, *places])
    return {
        "pages": pages,
        "tokens": n,
        "chunks": len(refs),
        "reads": len(reads),
        "launching_per_layer": launching / layers,
        "read_ops_per_layer": sum(sum(t.launching.values()) for t in reads) / layers,
        "page_write_ops_per_layer": sum(sum(t.launching.values()) for t in places) / layers,
        "host_syncs_per_layer": sum(syncs.calls.values()) / layers,
        "host_syncs": dict(syncs.calls),
        "exact": exact,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=64, help="stored chunks (default 64)")
    p.add_argument("--chunk-tokens", type=int, default=32, help="tokens per chunk (default 32)")
    p.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--tiny", action="store_true", help="8 chunks, 16 and 64 pages: a smoke test")
    args = p.parse_args(argv)
    page_counts = (16, 64, 256, 1024)
    if args.tiny:
        args.chunks, page_counts = 8, (16, 64)
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
    connector = [count_connector(pages, args.layers) for pages in page_counts]
    print_table(
        [
            "pages",
            "tokens",
            "chunks",
            "reads",
            "ops per layer",
            "of which page writes",
            "host syncs per layer",
            "exact",
        ],
        [
            [
                c["pages"],
                c["tokens"],
                c["chunks"],
                c["reads"],
                f"{c['launching_per_layer']:.1f}",
                f"{c['page_write_ops_per_layer']:.1f}",
                f"{c['host_syncs_per_layer']:.2f}",
                c["exact"],
            ]
            for c in connector
        ],
        title="the vLLM connector's device load (LayerLoad into RowPages, device path, two layers per read)",
    )
    write_json(
        args.out,
        {
            "benchmark": "load_ops",
            "config": {
                "chunks": args.chunks,
                "chunk_tokens": args.chunk_tokens,
                "layers": args.layers,
                "connector_pages": list(page_counts),
            },
            "machine": machine_info(),
            "code": code_version(),
            "results": rows,
            "connector": connector,
        },
    )
    print(f"wrote {args.out}", file=sys.stderr)
    ok = all(r["max_abs_diff_vs_stored"] == 0 for r in rows.values()) and all(c["exact"] for c in connector)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
