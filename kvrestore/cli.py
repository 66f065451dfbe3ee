"""Command line: `kvrestore demo`, `kvrestore bench`."""

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
    args = parser.parse_args(argv)

    if args.command == "bench":
        return _bench(parser, args)

    if args.command == "demo":
        from .demo import QUESTION, run_demo
        from .errors import KVRestoreError

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

    from .bench import Bench, BenchConfig

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


if __name__ == "__main__":
    sys.exit(main())
