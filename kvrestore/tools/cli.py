"""The `kvrestore` command: `demo`, `bench`, `profile` and `simulate` (`kvrestore COMMAND --help`).

Results go to stdout; progress goes to stderr (`tools.progress`), a line at least every few seconds.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from kvrestore.tools.progress import ProgressLog


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, unless there is none to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every command and option with its help."""
    from kvrestore.core.version import __version__

    top = argparse.ArgumentParser(
        prog="kvrestore",
        description="Restore an LLM prompt's KV cache by computing part of it and loading the rest at once.",
        epilog="`kvrestore COMMAND --help` shows a command's options.",
        formatter_class=_Help,
    )
    top.add_argument("--version", action="version", version=f"kvrestore {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, what: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=what, description=what[0].upper() + what[1:] + ".", formatter_class=_Help
        )

    demo = command("demo", "save a document's KV cache, restore it with each policy, answer a question")
    demo.add_argument("--tokens", type=int, default=3072, help="document length in tokens")
    demo.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk")
    demo.add_argument("--store", default=None, help="store URL (default: ~/.cache/kvrestore/demo-store)")
    demo.add_argument("--question", default=None, help="question to ask about the document")
    demo.add_argument("--max-new-tokens", type=int, default=40, help="longest answer, in tokens")
    demo.add_argument("--fresh", action="store_true", help="empty the local store first")

    bench = command(
        "bench", "two-pointer vs compute-only vs load-only across bandwidths (writes JSON and a PNG)"
    )
    bench.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    bench.add_argument(
        "--multipliers",
        default="0.25,0.5,1,2,4",
        help="bandwidths as multiples of the measured balance point",
    )
    bench.add_argument("--rounds", type=int, default=3, help="interleaved rounds per setting")
    bench.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk")
    bench.add_argument("--compute-chunks", type=int, default=2, help="stored chunks per compute unit")
    bench.add_argument("--load-lanes", type=int, default=4, help="chunk loads in flight at once")
    bench.add_argument("--no-fluctuation", action="store_true", help="skip the fluctuation run and its plot")
    bench.add_argument("--json", default="kvrestore-bench.json", help="where to write the results")
    bench.add_argument("--plot", default="kvrestore-bench.png", help="where to write the fluctuation plot")

    prof = command(
        "profile", "measure compute and store costs on this machine; saves the profile the Auto planner uses"
    )
    prof.add_argument("--model", default=None, help="a local HF checkpoint dir (default: bundled SmolLM2)")
    prof.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="the model's dtype"
    )
    prof.add_argument("--device", default=None, help="torch device, e.g. cuda:0 (default: cpu)")
    prof.add_argument("--store", default=None, help="also measure this store URL's bandwidth and latency")
    prof.add_argument("--max-tokens", type=int, default=2048, help="longest prompt measured")
    prof.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk")
    prof.add_argument("--repeats", type=int, default=2, help="timings per measurement (their median counts)")
    prof.add_argument(
        "--out",
        default=None,
        help="where to save (default: ~/.cache/kvrestore/profiles, where a Restorer finds it)",
    )

    sim = command(
        "simulate",
        "compare batch schedulers on a simulated workload (no model): independent, FIFO, batch-aware",
    )
    sim.add_argument("--profile", required=True, help="a saved profile (`kvrestore profile --out PATH`)")
    sim.add_argument(
        "--batch", type=int, default=None, help="N restores arriving together (instead of Poisson)"
    )
    sim.add_argument("--rate", type=float, default=0.3, help="Poisson arrivals per second")
    sim.add_argument("--duration", type=float, default=1000.0, help="seconds of Poisson arrivals")
    sim.add_argument(
        "--restore-share", type=float, default=0.6, help="share of restores; the rest are prefills"
    )
    sim.add_argument("--bandwidth", type=float, default=1.0, help="link speed, multiple of the balance point")
    sim.add_argument(
        "--kv-bytes-per-token", type=int, default=46_080, help="KV bytes per token (SmolLM2-135M fp32's)"
    )
    sim.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk")
    sim.add_argument("--load-lanes", type=int, default=4, help="chunk loads in flight at once")
    sim.add_argument("--token-budget", type=int, default=512, help="tokens one compute step takes at most")
    sim.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    return top


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
    progress = ProgressLog()

    def log(line: str) -> None:  # results on stdout; the heartbeat on stderr names the step they began
        print(line, flush=True)
        progress.note(line)

    async def run() -> dict[str, Any]:
        async with progress.beating():
            return await Bench(config, log=log).run()

    result = anyio.run(run)
    return 0 if result["targets"]["first_tokens_identical"] else 1


def _profile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from functools import partial

    import anyio.to_thread
    import torch

    from kvrestore.backends.hf import HFBackend
    from kvrestore.core.errors import KVRestoreError
    from kvrestore.costs.measure import profile
    from kvrestore.stores import open_store

    if args.max_tokens <= 0 or args.chunk_size <= 0 or args.repeats <= 0:
        parser.error("--max-tokens, --chunk-size and --repeats must be positive")
    dtype = getattr(torch, args.dtype)

    say = ProgressLog()

    async def run() -> None:
        store = open_store(args.store) if args.store else None  # a bad URL before the model loads
        try:
            async with say.beating():
                say(f"loading {args.model or 'the bundled SmolLM2-135M'} ({args.dtype})")
                if args.model:
                    load = partial(HFBackend.from_pretrained, args.model, dtype=dtype, device=args.device)
                else:
                    load = partial(HFBackend.from_smollm2, dtype=dtype, device=args.device)
                backend = await anyio.to_thread.run_sync(load)
                result = await profile(
                    backend,
                    store,
                    max_tokens=args.max_tokens,
                    chunk_size=args.chunk_size,
                    repeats=args.repeats,
                    log=say,
                    tick=say.tick,
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
