"""The vLLM connector's CPU load on its own: a prompt's chunks read from a local directory straight into
vLLM's host pages (a `chunkio.layer_load.LayerLoad` into `chunkio.host_pages.HostPages`), chunks saved with their keys row-major (format 4) against
keys saved as the pages keep them (format 5, `codec.layout`), beside a plain copy of the same bytes.

SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64, fp32), 4,000 tokens in chunks of 256 (the last
one partial, as the connector stores them), vLLM's CPU pages of 128 tokens ("cpu" layout) in a request
whose blocks are out of order. Each case loads every layer as vLLM asks for them, into the same pages;
the directory's files are in the page cache (read once before timing). The floor is `np.copyto` of the
prompt's KV bytes into a buffer of their size, one thread: what a load costs at least without reading
a file or checking anything. Cases interleave round by round; the pages are checked against the saved
KV after every load; ratios are of medians in this run.

    python benchmarks/host_pages.py                    # 4000 tokens, 15 rounds
    python benchmarks/host_pages.py --tokens 2000 --rounds 5 --out /tmp/hp.json
    python benchmarks/host_pages.py --tiny --out /tmp/hp.json   # a smoke test (seconds)

Prints a table and writes benchmarks/results/host_pages.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import machine_info, print_table, write_json
from _provenance import code_version

from kvrestore.chunkio.host_pages import HostPages
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.pages import PagedCache, gather
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.integrations.vllm.layouts import kv_views
from kvrestore.stores import LocalStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "host_pages.json"
L, H, D = 30, 3, 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--tiny", action="store_true", help="1,000 tokens, 2 rounds: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.rounds = 1000, 2
    spec = ModelSpec("smollm2-shape", L, H, D, 49152, torch.float32, fingerprint="5a" * 16)
    bs, n = args.block_size, args.tokens
    k = n // bs * bs  # what the connector loads: whole pages
    kv = torch.randn(L, 2, H, n, D, generator=torch.Generator().manual_seed(0))
    refs = chunk_keys(list(range(n)), spec.fingerprint, args.chunk)
    pages = -(-n // bs)
    blocks = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(1))[:pages].tolist()
    caches = [torch.zeros(2 * pages, H, bs, 2 * D) for _ in range(L)]
    views = [kv_views(c, "cpu", H, D) for c in caches]
    paged = PagedCache([k_ for k_, _ in views], [v for _, v in views])
    io = LoopThread()
    stores: dict[str, LocalStore] = {}
    tmp = tempfile.TemporaryDirectory(prefix="kvrestore-host-pages-")
    try:
        for name, tile in (("keys row-major (format 4)", 0), ("keys as the pages keep them (format 5)", bs)):
            store = LocalStore(str(Path(tmp.name) / str(tile)))
            saver = ChunkSaver(spec, store, io, key_tile=tile)
            for r in refs:
                assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
            assert saver.flush(timeout=120) and saver.written == len(refs)
            stores[name] = store

        def load(store: LocalStore) -> float:
            for c in caches:
                c.zero_()
            t = time.perf_counter()
            got = LayerLoad(spec, store, refs, k, HostPages(paged, blocks, 0, k))
            got.start(io)
            for layer in range(L):
                got.wait(layer)
            seconds = time.perf_counter() - t
            got.cancel("done")
            assert not got.failed, got.errors
            return seconds

        nbytes = L * 2 * H * n * D * 4
        src, dst = np.random.default_rng(2).bytes(nbytes), np.empty(nbytes, np.uint8)

        def copy() -> float:
            t = time.perf_counter()
            np.copyto(dst, np.frombuffer(src, np.uint8))
            return time.perf_counter() - t

        times: dict[str, list[float]] = {
            "np.copyto of the prompt's KV bytes": [],
            **{name: [] for name in stores},
        }
        exact: dict[str, bool] = {}
        for name, store in stores.items():  # warm-up: files into the page cache, pages touched
            load(store)
            exact[name] = all(
                torch.equal(gather([kv_views(caches[i], "cpu", H, D)], blocks, 0, k)[0], kv[i, :, :, :k])
                for i in range(L)
            )
        for _ in range(args.rounds):
            times["np.copyto of the prompt's KV bytes"].append(copy())
            for name, store in stores.items():
                times[name].append(load(store))
    finally:
        io.close()
        tmp.cleanup()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    floor = med["np.copyto of the prompt's KV bytes"]
    row_major = med["keys row-major (format 4)"]
    print_table(
        ["case", "median s", "x the copy", "x format 4", "pages exact"],
        [
            [name, f"{m:.4f}", f"{m / floor:.2f}", f"{m / row_major:.2f}", exact.get(name, "-")]
            for name, m in med.items()
        ],
        title=f"one load of {k} tokens ({n} stored, {len(refs)} chunks) into vLLM's CPU pages of {bs}, {args.rounds} rounds",
    )
    result: dict[str, Any] = {
        "benchmark": "host_pages",
        "config": {"tokens": n, "loaded": k, "chunk": args.chunk, "block_size": bs, "rounds": args.rounds},
        "machine": machine_info(),
        "code": code_version(),
        "results": {
            name: {"median_s": med[name], "seconds": times[name], "exact": exact.get(name)} for name in med
        },
        "ratios": {
            "format5_vs_format4": med["keys as the pages keep them (format 5)"] / row_major,
            "format5_vs_copy": med["keys as the pages keep them (format 5)"] / floor,
            "format4_vs_copy": row_major / floor,
        },
    }
    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
