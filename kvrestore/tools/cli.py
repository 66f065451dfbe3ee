"""Command line: `kvrestore demo`, `kvrestore bench`, `kvrestore profile`."""

from __future__ import annotations

import argparse
import sys

import anyio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrestore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="save a document's KV cache, restore it with each policy, answer a question"
    )
    demo.add_argument("--tokens", type=int, default=3072, help="document length in tokens (default 3072)")
    demo.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk (default 256)")
    demo.add_argument(
        "--store", default=None, help="store URL (default: a directory under the user cache dir)"
    )
    demo.add_argument("--question", default=None, help="question to ask about the document")
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--fresh", action="store_true", help="empty the local store first")
    bench = sub.add_parser(
        "bench", help="two-pointer vs compute-only vs load-only across bandwidths (writes JSON and a PNG)"
    )
    bench.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default 4096)")
    bench.add_argument(
        "--multipliers",
        default="0.25,0.5,1,2,4",
        help="bandwidths as multiples of the measured balance point (default 0.25,0.5,1,2,4)",
    )
    bench.add_argument("--rounds", type=int, default=3, help="interleaved rounds per setting (default 3)")
    bench.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk (default 256)")
    bench.add_argument("--compute-chunks", type=int, default=2, help="stored chunks per compute unit")
    bench.add_argument("--load-lanes", type=int, default=4)
    bench.add_argument("--no-fluctuation", action="store_true", help="skip the fluctuation run and its plot")
    bench.add_argument("--json", default="kvrestore-bench.json", help="where to write the results")
    bench.add_argument("--plot", default="kvrestore-bench.png", help="where to write the fluctuation plot")
    prof = sub.add_parser(
        "profile",
        help="measure compute and store costs on this machine; saves the profile the Auto planner uses",
    )
    prof.add_argument("--model", default=None, help="a local HF checkpoint dir (default: bundled SmolLM2)")
    prof.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    prof.add_argument("--device", default=None, help="torch device, e.g. cuda:0 (default: cpu)")
    prof.add_argument("--store", default=None, help="also measure this store URL's bandwidth and latency")
    prof.add_argument("--max-tokens", type=int, default=2048, help="longest prompt measured (default 2048)")
    prof.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk (default 256)")
    prof.add_argument("--repeats", type=int, default=2, help="timings per measurement (median; default 2)")
    prof.add_argument("--out", default=None, help="where to save (default: the cache dir, found by Restorer)")
    sim = sub.add_parser(
        "simulate",
        help="compare batch schedulers on a simulated workload (no model): independent, FIFO, batch-aware",
    )
    sim.add_argument("--profile", required=True, help="a saved profile (`kvrestore profile --out PATH`)")
    sim.add_argument(
        "--batch", type=int, default=None, help="N restores arriving together (instead of Poisson)"
    )
    sim.add_argument("--rate", type=float, default=0.3, help="Poisson arrivals per second (default 0.3)")
    sim.add_argument(
        "--duration", type=float, default=1000.0, help="seconds of Poisson arrivals (default 1000)"
    )
    sim.add_argument(
        "--restore-share", type=float, default=0.6, help="share of restores; the rest are prefills"
    )
    sim.add_argument("--bandwidth", type=float, default=1.0, help="link speed, multiple of the balance point")
    sim.add_argument("--kv-bytes-per-token", type=int, default=46_080, help="default: SmolLM2-135M fp32")
    sim.add_argument("--chunk-size", type=int, default=256)
    sim.add_argument("--load-lanes", type=int, default=4)
    sim.add_argument("--token-budget", type=int, default=512)
    sim.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "bench":
        return _bench(parser, args)
    if args.command == "profile":
        return _profile(parser, args)
    if args.command == "simulate":
        return _simulate(parser, args)

    if args.command == "demo":
        from kvrestore.core.errors import KVRestoreError
        from kvrestore.tools.demo import QUESTION, run_demo

        if args.tokens <= 0:
            parser.error("--tokens must be positive")
        try:
            anyio.run(
                lambda: run_demo(
                    n_tokens=args.tokens,
                    chunk_size=args.chunk_size,
                    store_url=args.store,
                    question=args.question or QUESTION,
                    max_new_tokens=args.max_new_tokens,
                    fresh=args.fresh,
                )
            )
        except KVRestoreError as exc:
            print(f"kvrestore: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvrestore.tools.bench import Bench, BenchConfig

    try:
        multipliers = tuple(float(m) for m in args.multipliers.split(","))
    except ValueError:
        parser.error(f"--multipliers must be comma-separated numbers, got {args.multipliers!r}")
    if args.tokens <= 0 or args.rounds <= 0 or any(m <= 0 for m in multipliers):
        parser.error("--tokens, --rounds and every multiplier must be positive")
    config = BenchConfig(
        n_tokens=args.tokens,
        multipliers=multipliers,
        rounds=args.rounds,
        chunk_size=args.chunk_size,
        compute_chunks=args.compute_chunks,
        load_lanes=args.load_lanes,
        fluctuation=not args.no_fluctuation,
        json_path=Path(args.json),
        plot_path=None if args.no_fluctuation else Path(args.plot),
    )
    result = anyio.run(Bench(config, log=lambda line: print(line, flush=True)).run)
    return 0 if result["targets"]["first_tokens_identical"] else 1


def _profile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from kvrestore.backends.hf import HFBackend
    from kvrestore.core.errors import KVRestoreError
    from kvrestore.costs.measure import profile
    from kvrestore.stores import open_store

    if args.max_tokens <= 0 or args.chunk_size <= 0 or args.repeats <= 0:
        parser.error("--max-tokens, --chunk-size and --repeats must be positive")
    dtype = getattr(torch, args.dtype)

    async def run() -> None:
        if args.model:
            backend = HFBackend.from_pretrained(args.model, dtype=dtype, device=args.device)
        else:
            backend = HFBackend.from_smollm2(dtype=dtype, device=args.device)
        store = open_store(args.store) if args.store else None
        try:
            result = await profile(
                backend,
                store,
                max_tokens=args.max_tokens,
                chunk_size=args.chunk_size,
                repeats=args.repeats,
                log=lambda line: print(line, flush=True),
            )
        finally:
            if store is not None:
                await store.close()
        print(result.summary())
        print(f"saved {result.save(args.out)}")

    try:
        anyio.run(run)
    except KVRestoreError as exc:
        print(f"kvrestore: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import statistics

    from kvrestore.core.errors import KVRestoreError
    from kvrestore.costs.profile import Profile
    from kvrestore.sim.compare import balance_bytes_per_s, batch_lower_bound, compare_schedulers
    from kvrestore.sim.workload import Kind, burst, poisson
    from kvrestore.tools.benchmarking import format_table, percentile

    if not 0 <= args.restore_share <= 1:
        parser.error("--restore-share must be between 0 and 1")
    if min(args.bandwidth, args.rate, args.duration) <= 0 or (args.batch is not None and args.batch <= 0):
        parser.error("--bandwidth, --rate, --duration and --batch must be positive")
    try:
        prof = Profile.load(args.profile)
    except (OSError, KVRestoreError, ValueError) as exc:
        print(f"kvrestore: error: {exc}", file=sys.stderr)
        return 2
    if args.batch is not None:
        workload = burst(args.batch, seed=args.seed, weights={"restore": 1.0})
        what = f"{args.batch} restores arriving together"
    else:
        weights: dict[Kind, float] = {"restore": args.restore_share, "prefill": 1 - args.restore_share}
        workload = poisson(args.rate, args.duration, seed=args.seed, weights=weights)
        what = f"{len(workload)} requests, Poisson at {args.rate}/s"
    if not any(r.kind == "restore" for r in workload):
        parser.error("the workload has no restore: raise --restore-share or --duration")
    bps = args.bandwidth * balance_bytes_per_s(workload, prof.chunk, args.kv_bytes_per_token, args.chunk_size)
    runs = compare_schedulers(
        workload,
        prof.chunk,
        args.kv_bytes_per_token,
        bps,
        chunk_size=args.chunk_size,
        load_lanes=args.load_lanes,
        token_budget=args.token_budget,
    )
    rows = [
        [c, statistics.mean(r.ttft_s), percentile(r.ttft_s, 0.9), percentile(r.ttft_s, 0.99), r.makespan]
        for c, r in runs.items()
    ]
    print(
        format_table(
            ["case", "mean TTFT s", "P90 s", "P99 s", "finish s"],
            rows,
            title=f"{what}; {prof.model} costs ({prof.machine}); link {bps / 1e6:.1f} MB/s ({args.bandwidth}x balance)",
        )
    )
    if args.batch is not None:
        bound = batch_lower_bound(workload, prof.chunk, args.kv_bytes_per_token, args.chunk_size, bps)
        print(f"no schedule finishes this batch before {bound:.2f} s (batch_lower_bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
