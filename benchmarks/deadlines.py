"""Issue 50's timing targets: stalled local reads against a restore's cancel and load deadline, and
`Auto` over 1-token chunks.

* **cancel**: every read of a local directory stalls `--stall` seconds (3 s, as a network filesystem
  mount does); a restore is cancelled by `anyio.move_on_after(0.2)`. Reported: how long after the
  deadline it returned (the overrun), against one decoder layer's compute, for each policy on an
  `Engine` and a `BatchEngine`.
* **deadline**: reads stall `--deadline-stall` seconds (1.5 s) and `load_timeout_s=0.3`: LoadOnly (and the
  token-wise two-pointer) against compute-only, each restore by a fresh restorer, interleaved.
* **auto**: a tiny Llama, 2,048 tokens saved with chunk_size=1: `Auto`, compute-only and load-only
  interleaved round by round on one restorer (which learns as it goes); medians, and `Auto`'s first
  restore (nothing known yet) apart.

    python benchmarks/deadlines.py            # SmolLM2 for cancel/deadline (300 tokens), 3 rounds
    python benchmarks/deadlines.py --tiny     # a tiny random Llama throughout: a smoke test

Prints tables and writes benchmarks/results/deadlines.json (deadlines-tiny.json with --tiny).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import machine_info, median, print_table, write_json
from _provenance import code_version

from kvrestore import (
    Auto,
    BatchEngine,
    ComputeOnly,
    LayerTwoPointer,
    LoadOnly,
    LocalStore,
    Restorer,
    TokenTwoPointer,
)
from kvrestore.backends.hf import HFBackend
from kvrestore.runtime.engine import Engine
from kvrestore.stores import local

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "deadlines.json"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Stall:
    """While `seconds` is set, every read of a file by `LocalStore` first sleeps that long."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("_read_file_into", "_read_ranges"):
            setattr(local, name, self._stalling(getattr(local, name)))

    def _stalling(self, read: Callable[..., Any]) -> Callable[..., Any]:
        def stalled(*args: Any) -> Any:
            if self.seconds:
                time.sleep(self.seconds)
            return read(*args)

        return stalled


def tiny_backend(layers: int = 3) -> HFBackend:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import tiny_model

    return HFBackend(tiny_model("llama", layers=layers), name="tiny-llama")


async def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


async def cancel_and_deadline(args: argparse.Namespace, stall: Stall) -> dict[str, Any]:
    if args.tiny:
        backend, desc = tiny_backend(), "tiny random Llama (3 layers)"
    else:
        backend, desc = HFBackend.from_smollm2(dtype=torch.float32), "SmolLM2-135M-Instruct (fp32)"
    tokens = torch.randint(
        0, backend.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    )
    root = tempfile.mkdtemp(prefix="kvrestore-deadlines-")
    await Restorer(backend, LocalStore(root), chunk_size=args.chunk).save(tokens)
    warm = Restorer(backend, LocalStore(root), chunk_size=args.chunk)
    await warm.restore(tokens, ComputeOnly())
    full = [await timed(lambda: warm.restore(tokens, ComputeOnly())) for _ in range(args.rounds)]
    full_s = median(full)
    layer_s = full_s / backend.spec.num_layers
    log(f"{desc}: {args.tokens} tokens in chunks of {args.chunk}; compute-only {full_s:.3f} s")

    # cancel: a 0.2 s move_on_after over reads that stall for --stall seconds
    overruns: dict[str, list[float]] = {}
    policies = {
        "load-only": LoadOnly,
        "two-pointer": TokenTwoPointer,
        "layer-wise": LayerTwoPointer,
        "auto": Auto,
    }
    for rnd in range(args.rounds):
        for engine_name in ("engine", "batch-engine"):
            for name, policy in policies.items():
                async with contextlib.AsyncExitStack() as stack:
                    batch = engine_name == "batch-engine"
                    engine = await stack.enter_async_context(BatchEngine()) if batch else Engine()
                    r = Restorer(backend, LocalStore(root), chunk_size=args.chunk, engine=engine)
                    stall.seconds = args.stall
                    t = time.perf_counter()
                    with anyio.move_on_after(args.cancel_after):
                        await r.restore(tokens, policy())
                    took = time.perf_counter() - t
                    stall.seconds = 0.0
                over = took - args.cancel_after
                overruns.setdefault(f"{engine_name}|{name}", []).append(over)
                log(f"  [round {rnd + 1}] cancel {engine_name} {name}: returned after {took:.3f} s")

    # deadline: load_timeout_s over reads that stall for --deadline-stall seconds
    times: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for name, policy in (
            ("compute-only", ComputeOnly),
            ("load-only", LoadOnly),
            ("two-pointer", TokenTwoPointer),
        ):
            r = Restorer(backend, LocalStore(root), chunk_size=args.chunk, load_timeout_s=args.load_timeout)
            stall.seconds = 0.0 if name == "compute-only" else args.deadline_stall
            took = await timed(lambda r=r, policy=policy: r.restore(tokens, policy()))
            stall.seconds = 0.0
            times.setdefault(name, []).append(took)
            log(f"  [round {rnd + 1}] deadline {name}: {took:.3f} s")

    rows = []
    cancel_cases = {}
    for key, overs in overruns.items():
        engine_name, name = key.split("|")
        cancel_cases[key] = {
            "median_overrun_s": median(overs),
            "max_overrun_s": max(overs),
            "overruns_s": overs,
        }
        rows.append([engine_name, name, median(overs) * 1e3, max(overs) * 1e3, max(overs) / layer_s])
    print_table(
        ["engine", "policy", "overrun median ms", "max ms", "max / one layer"],
        rows,
        title=f"{desc}, {args.tokens} tokens: every read stalls {args.stall:g} s; move_on_after("
        f"{args.cancel_after:g}) returned this long after its deadline (one layer {layer_s * 1e3:.1f} ms)",
    )
    base = median(times["compute-only"])
    deadline_cases = {
        k: {"median_s": median(v), "seconds": v, "x_compute_only": median(v) / base} for k, v in times.items()
    }
    print_table(
        ["policy", "median s", "x compute-only"],
        [[k, c["median_s"], c["x_compute_only"]] for k, c in deadline_cases.items()],
        title=f"{desc}: reads stall {args.deadline_stall:g} s, load_timeout_s={args.load_timeout:g}",
    )
    return {
        "model": desc,
        "tokens": args.tokens,
        "chunk_size": args.chunk,
        "compute_only_s": full_s,
        "layer_s": layer_s,
        "cancel": {"stall_s": args.stall, "cancel_after_s": args.cancel_after, "cases": cancel_cases},
        "deadline": {
            "stall_s": args.deadline_stall,
            "load_timeout_s": args.load_timeout,
            "cases": deadline_cases,
        },
    }


async def auto_over_short_chunks(args: argparse.Namespace) -> dict[str, Any]:
    backend = tiny_backend()
    n = args.auto_tokens
    tokens = torch.randint(0, backend.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    store = LocalStore(tempfile.mkdtemp(prefix="kvrestore-auto1-"))
    await Restorer(backend, store, chunk_size=1).save(tokens)
    r = Restorer(backend, store, chunk_size=1)
    first = await timed(lambda: r.restore(tokens, Auto()))
    log(f"auto, chunk_size=1, {n} tokens: first restore (nothing known) {first:.3f} s")
    times: dict[str, list[float]] = {}
    chosen: list[str] = []
    for rnd in range(args.auto_rounds):
        for name, policy in (("auto", Auto), ("compute-only", ComputeOnly), ("load-only", LoadOnly)):
            t = time.perf_counter()
            res = await r.restore(tokens, policy())
            times.setdefault(name, []).append(time.perf_counter() - t)
            if name == "auto":
                chosen.append(res.stats.policy)
        log(
            f"  [round {rnd + 1}] "
            + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items())
            + f" (auto ran {chosen[-1]})"
        )
    medians = {k: median(v) for k, v in times.items()}
    best = min(medians["compute-only"], medians["load-only"])
    print_table(
        ["policy", "median s", "x best single"],
        [[k, v, v / best] for k, v in medians.items()],
        title=f"tiny Llama, {n} tokens saved with chunk_size=1 ({args.auto_rounds} rounds; auto's first "
        f"restore {first:.3f} s); auto ran {', '.join(chosen)}",
    )
    return {
        "tokens": n,
        "first_auto_s": first,
        "seconds": times,
        "median_s": medians,
        "auto_x_best_single": medians["auto"] / best,
        "auto_chose": chosen,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stall = Stall()
    return {
        "benchmark": "deadlines",
        "config": vars(args) | {"out": str(args.out)},
        "machine": machine_info(),
        "code": code_version(),
        "stalled_reads": await cancel_and_deadline(args, stall),
        "auto_chunk_size_1": await auto_over_short_chunks(args),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=300, help="prompt of the stall cases (default 300)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per chunk of the stall cases (default 32)")
    p.add_argument("--stall", type=float, default=3.0, help="seconds each read stalls, cancel case")
    p.add_argument("--cancel-after", type=float, default=0.2, help="the move_on_after deadline (s)")
    p.add_argument(
        "--deadline-stall", type=float, default=1.5, help="seconds each read stalls, deadline case"
    )
    p.add_argument("--load-timeout", type=float, default=0.3, help="load_timeout_s of the deadline case")
    p.add_argument("--auto-tokens", type=int, default=2048, help="prompt of the chunk_size=1 case")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --tiny 1)")
    p.add_argument(
        "--auto-rounds", type=int, default=None, help="rounds of the auto case (default 5; --tiny 2)"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny random model throughout: a smoke test")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.tiny else 3)
    args.auto_rounds = args.auto_rounds or (2 if args.tiny else 5)
    if args.tiny:
        args.auto_tokens = min(args.auto_tokens, 512)
    args.out = args.out or (DEFAULT_OUT.with_name("deadlines-tiny.json") if args.tiny else DEFAULT_OUT)
    result = anyio.run(run, args)
    write_json(args.out, result)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
