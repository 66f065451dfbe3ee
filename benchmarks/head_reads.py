"""A tensor-parallel rank's read of chunks saved whole: what per-head checks (format 6) save it, and what
they cost the writer.

A tp-2 rank needs one of the 2 KV heads of each chunk a tp-1 engine (or a `Restorer`) saved. A chunk with
per-head checks (`codec.heads`) is read by head: the head table, then the rank's two byte ranges of each
layer, each head verified against its own check; one without them (format 4, `head_checks=False`) is
read a section (both heads) at a time and cut. Measured, from a local directory (real files), a rank's
load into its pages (`chunkio.part_loads.share_loads`, the connector's path for a layout not its own),
interleaved round by round, each load's pages checked against the stored KV:

* bytes read per load against the rank's share (1/2 of the loaded KV): target <= 1 plus headers;
* the load's wall time, by head against whole sections (median of `--rounds`), from the directory as it
  is (the page cache: bytes cost little, calls count) and through a `ThrottledStore` at `--link-mb-s`
  (a link: bytes count);
* unsigned and signed (a secret: each head's GMAC tag checked instead of its xxh3-64);
* the writer's cost: `encode_chunk` of one chunk with and without per-head checks (one more xxh3-64
  pass, and signed one more GMAC pass), median of `--repeats`.

The model is SmolLM2's depth and head size with 2 KV heads (30 layers, D 64, fp32: 30,720 B a token),
chunks of 256 tokens.

    python benchmarks/head_reads.py                   # 8 chunks, 7 rounds
    python benchmarks/head_reads.py --tiny --out /tmp/h.json

Prints a table and writes benchmarks/results/head_reads.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import machine_info, print_table, write_json
from _provenance import code_version

from kvrestore import codec
from kvrestore.chunkio.page_dest import PageWrites
from kvrestore.chunkio.pages import PagedCache, gather
from kvrestore.chunkio.part_loads import share_loads
from kvrestore.chunkio.parts import engine_layout, rank_part
from kvrestore.codec.seal import Seal
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.stores import LocalStore, ThrottledStore
from kvrestore.stores.base import ChunkStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "head_reads.json"
BS = 16  # page size


def save(root: Path, spec: ModelSpec, kv: torch.Tensor, chunk: int, head_checks: bool, seal: Seal | None):
    store = LocalStore(str(root))
    refs = [ChunkRef(i, i * chunk, (i + 1) * chunk, f"{i + 1:x}" * 40) for i in range(kv.shape[3] // chunk)]

    async def put() -> None:
        for r in refs:
            data = KVChunk(r.start, kv[:, :, :, r.start : r.end].contiguous())
            await store.put(r.key, codec.encode_chunk(data, spec, r.key, seal=seal, head_checks=head_checks))

    anyio.run(put)
    return store, refs


def load(io: LoopThread, store: ChunkStore, spec: ModelSpec, refs, n: int, rank: int, seal: Seal | None):
    """A tp-2 rank's load of tokens [0, n) into its pages: (seconds, bytes read, its pages' KV)."""
    mine, _ = rank_part(spec, 2, rank)
    blocks = list(range(-(-n // BS)))
    shape = (len(blocks), 1, BS, spec.head_dim)
    paged = PagedCache(
        [torch.zeros(shape) for _ in range(spec.num_layers)],
        [torch.zeros(shape) for _ in range(spec.num_layers)],
    )
    t = time.perf_counter()
    loads = share_loads(
        spec, mine, engine_layout(spec), store, refs, n, paged, lambda p: PageWrites(p, blocks), seal=seal
    )
    loads.start(io, timeout=120)
    ok = all([loads.wait(layer) for layer in range(spec.num_layers)])
    seconds = time.perf_counter() - t
    assert ok and not loads.failed, loads.errors
    return seconds, loads.bytes_read, gather(list(zip(paged.k, paged.v, strict=True)), blocks, 0, n)


def encode_s(
    spec: ModelSpec, kv: torch.Tensor, chunk: int, head_checks: bool, seal: Seal | None, repeats: int
) -> float:
    data = KVChunk(0, kv[:, :, :, :chunk].contiguous())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        codec.encode_chunk(data, spec, "ab" * 20, seal=seal, head_checks=head_checks)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec("smollm2-depth-2kv", args.layers, 2, 64, 49152, torch.float32, fingerprint="ab" * 16)
    torch.manual_seed(0)
    n = args.chunks * args.chunk
    kv = torch.randn(spec.num_layers, 2, 2, n, spec.head_dim)
    share = n * spec.num_layers * 2 * 1 * spec.head_dim * 4  # one head's K and V of every token, fp32
    seal = Seal(b"k" * 32)
    io = LoopThread()
    rows, result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {
            (signed, heads): save(
                Path(tmp) / f"{signed}-{heads}", spec, kv, args.chunk, heads, seal if signed else None
            )
            for signed in (False, True)
            for heads in (True, False)
        }
        times: dict[tuple[bool, bool], list[float]] = {k: [] for k in stores}
        nbytes: dict[tuple[bool, bool], int] = {}
        linked: dict[tuple[bool, bool], list[float]] = {k: [] for k in stores}
        for _ in range(args.rounds):
            for (signed, heads), (store, refs) in stores.items():
                s, b, got = load(io, store, spec, refs, n, 1, seal if signed else None)
                assert torch.equal(got, kv[:, :, 1:2]), "the rank's pages differ from the stored KV"
                times[signed, heads].append(s)
                nbytes[signed, heads] = b
                link = ThrottledStore(store, args.link_mb_s * 1e6)
                s, _, got = load(io, link, spec, refs, n, 1, seal if signed else None)
                assert torch.equal(got, kv[:, :, 1:2]), "the rank's pages differ from the stored KV"
                linked[signed, heads].append(s)
        for signed in (False, True):
            by_head, whole = (signed, True), (signed, False)
            enc = {
                h: encode_s(spec, kv, args.chunk, h, seal if signed else None, args.repeats)
                for h in (True, False)
            }
            name = "signed" if signed else "unsigned"
            result[name] = {
                "bytes_by_head": nbytes[by_head],
                "bytes_whole": nbytes[whole],
                "by_head_vs_share": nbytes[by_head] / share,
                "whole_vs_share": nbytes[whole] / share,
                "load_s_by_head": statistics.median(times[by_head]),
                "load_s_whole": statistics.median(times[whole]),
                "load_by_head_vs_whole": statistics.median(
                    [a / b for a, b in zip(times[by_head], times[whole], strict=True)]
                ),
                "link_s_by_head": statistics.median(linked[by_head]),
                "link_s_whole": statistics.median(linked[whole]),
                "link_by_head_vs_whole": statistics.median(
                    [a / b for a, b in zip(linked[by_head], linked[whole], strict=True)]
                ),
                "encode_s_with_head_checks": enc[True],
                "encode_s_without": enc[False],
                "encode_with_vs_without": enc[True] / enc[False],
            }
            r = result[name]
            rows.append(
                [
                    name,
                    "by head (format 6)",
                    r["bytes_by_head"],
                    r["by_head_vs_share"],
                    r["load_s_by_head"],
                    r["load_by_head_vs_whole"],
                    r["link_s_by_head"],
                    r["link_by_head_vs_whole"],
                    r["encode_s_with_head_checks"],
                    r["encode_with_vs_without"],
                ]
            )
            rows.append(
                [
                    name,
                    "whole sections (format 4)",
                    r["bytes_whole"],
                    r["whole_vs_share"],
                    r["load_s_whole"],
                    1.0,
                    r["link_s_whole"],
                    1.0,
                    r["encode_s_without"],
                    1.0,
                ]
            )
    io.close()
    print_table(
        [
            "chunks",
            "read",
            "bytes read",
            "x share",
            "dir s",
            "x whole",
            "link s",
            "x whole",
            "encode s",
            "x without",
        ],
        rows,
        title=f"a tp-2 rank's load of {n} tokens saved whole ({args.chunks} chunks of {args.chunk}, {spec.num_layers} layers)",
    )
    return {
        "benchmark": "head_reads",
        "config": vars(args) | {"tokens": n, "share_bytes": share},
        "machine": machine_info(),
        "code": code_version(),
        "results": result,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--link-mb-s", type=float, default=400.0, help="the throttled link's MB/s")
    p.add_argument("--repeats", type=int, default=15, help="encodes timed per case")
    p.add_argument(
        "--tiny", action="store_true", help="2 chunks of 32 tokens, 4 layers, 2 rounds: a smoke test"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.tiny:
        args.chunks, args.chunk, args.layers, args.rounds, args.repeats = 2, 32, 4, 2, 3
    write_json(args.out, run(args))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
