"""What a secret costs a restarted vLLM server: KVRestoreConnector's TTFT with `KVRESTORE_SECRET` set
against without, SmolLM2-135M (fp32) on vLLM's CPU engine.

Two stores are filled from the same prompt, one by a process without a secret, one by a process with
`KVRESTORE_SECRET` set (its chunks signed, `codec.seal`). Then, round by round, a new process loads
the whole prompt (`split="load_all"`, a local directory) from each, the signed one with the same
secret, so that every section's GMAC tag is checked before vLLM uses it; the unsigned one checks each
section's xxh3-64 instead. Each process serves a warm-up prompt, then the prompt `--repeat` times (a
one-token generate each: the TTFT). Reported: the median TTFT of each case, their ratio (target
<= 1.15x) and the median of each round's ratio (the two processes of a round run back to back), and that every request loaded the whole prompt and gave vLLM alone's first token
(the unsigned case's is the reference: `benchmarks/vllm_connector.py` checks it against vLLM alone).

    .venv-vllm/bin/python benchmarks/seal_connector.py                 # 2000 tokens, 3 rounds x 2
    .venv-vllm/bin/python benchmarks/seal_connector.py --tokens 4000 --rounds 5

Prints a table and writes benchmarks/results/seal_connector.json. Needs the vLLM virtualenv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import machine_info, median, print_table, run_to_json
from _provenance import code_version
from vllm_connector import log, serve, vllm_version

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "seal_connector.json"
SECRET = {"KVRESTORE_SECRET": "benchmark secret for the connector, 48 bytes ok"}
CASES = {"no secret": {}, "secret": SECRET}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Blocking, one process at a time (an event loop only for `run_to_json`)."""
    from kvrestore.backends.hf import smollm2_checkpoint

    model = smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="kvrestore-seal-connector-"))
    extra = {
        name: {
            "store_url": str(work / f"kv-{i}"),
            "cost_dir": str(work / f"costs-{i}"),
            "chunk_size": args.chunk,
        }
        for i, name in enumerate(CASES)
    }
    for name, env in CASES.items():  # each store filled once, by a process that computes and saves
        serve(model, args.tokens, 0, "kvrestore", extra[name], env)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    for rnd in range(args.rounds):
        order = list(CASES) if rnd % 2 == 0 else list(reversed(CASES))  # neither always goes first
        for name in order:
            r = serve(
                model,
                args.tokens,
                args.repeat,
                "kvrestore",
                {**extra[name], "split": "load_all"},
                CASES[name],
            )
            runs[name].append(r)
            log(
                f"round {rnd + 1}/{args.rounds}, {name}: {[round(t, 3) for t in r['ttfts_s']]} s, splits {r['splits']}"
            )
    med = {name: median([t for r in rs for t in r["ttfts_s"]]) for name, rs in runs.items()}
    reference = runs["no secret"][0]["first_ids"][-1]
    checks = {}
    for name, rs in runs.items():
        loaded = [k for r in rs for k, _ in r["splits"]]  # every request's split, the warm-up's too
        checks[name] = {
            "tokens_loaded": loaded,
            "same_first_token": all(ids == reference for r in rs for ids in r["first_ids"][1:]),
        }
    rt = med["secret"] / med["no secret"]
    per_round = [  # each round's two processes run back to back: a slow spell of the machine hits both
        median(s["ttfts_s"]) / median(u["ttfts_s"])
        for u, s in zip(runs["no secret"], runs["secret"], strict=True)
    ]
    print_table(
        ["case", "TTFT s (median)", "x no secret", "tokens loaded", "same token", "target"],
        [
            [
                name,
                med[name],
                med[name] / med["no secret"],
                sorted(set(checks[name]["tokens_loaded"])),
                checks[name]["same_first_token"],
                "<= 1.15" if name == "secret" else "",
            ]
            for name in CASES
        ],
        title=f"ratio of medians {rt:.3f}, median of the rounds' ratios {median(per_round):.3f}; restarted vLLM {vllm_version()} (CPU), SmolLM2-135M fp32, {args.tokens} tokens, "
        f"median of {args.rounds} rounds x {args.repeat}",
    )
    return {
        "benchmark": "seal_connector",
        "config": {
            "tokens": args.tokens,
            "repeat": args.repeat,
            "rounds": args.rounds,
            "chunk_size": args.chunk,
            "split": "load_all",
        },
        "machine": machine_info(),
        "vllm": vllm_version(),
        "code": code_version(),
        "ttfts_s": {name: [r["ttfts_s"] for r in rs] for name, rs in runs.items()},
        "median_ttft_s": med,
        "secret_vs_no_secret": rt,  # the ratio of the medians over every timed request
        "secret_vs_no_secret_per_round": per_round,
        "secret_vs_no_secret_median_of_rounds": median(per_round),
        "target": 1.15,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=2, help="timed requests per process, after its warm-up")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, a new process per case each")
    p.add_argument("--chunk", type=int, default=256, help="kvrestore chunk size (default 256)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    return run_to_json(run, args, args.out)


if __name__ == "__main__":
    sys.exit(main())
