"""Command line: `kvrestore demo`."""

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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
