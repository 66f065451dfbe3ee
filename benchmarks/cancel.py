"""How long a restore cancelled by a deadline takes to return: stopping at the next layer vs the unit's end.

Issue 15's cancellation bound. SmolLM2-135M (fp32) on this machine, a 4,096-token prompt: a restore is
cancelled by `anyio.move_on_after(deadline)` at several deadlines, and the time from the deadline to the
restore's return (the overrun) is measured, for

* `ComputeOnly()` (one unit: the whole prefill) and `TokenTwoPointer()` through a `ThrottledStore` at
  about half the balance bandwidth (units of a few chunks, loads in flight);
* **layer-bound**: as shipped, the unit stops at the next decoder layer (`kvrestore.core.cancel.checkpoint`);
* **unit-bound**: the same with the checkpoint switched off, i.e. how cancellation behaved before: the
  restore returns when its running unit ends.

The cases are interleaved round by round; medians and maxima of the overrun, and one layer's time (a
full prefill / layers) for scale.

    python benchmarks/cancel.py                      # SmolLM2, 4096 tokens, 3 rounds
    python benchmarks/cancel.py --tiny --out /tmp/c.json

Prints a table and writes benchmarks/results/cancel.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import machine_info, median, print_table, run_to_json
from _provenance import code_version

import kvrestore.backends.hf as hf
from kvrestore import ComputeOnly, Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.stores import MemoryStore, ThrottledStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cancel.json"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_backend(tiny: bool) -> tuple[HFBackend, str]:
    if tiny:
        sys.path.insert(0, str(ROOT))
        from tests.conftest import tiny_model

        return HFBackend(tiny_model("llama", layers=4), name="tiny-llama"), "tiny random Llama (4 layers)"
    return HFBackend.from_smollm2(dtype=torch.float32), "SmolLM2-135M-Instruct (fp32)"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backend, desc = load_backend(args.tiny)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, backend.spec.vocab_size, (args.tokens,), generator=g)
    memory = MemoryStore()
    restorer = Restorer(backend, memory, args.chunk)
    await restorer.save(tokens)
    t = time.perf_counter()
    await restorer.restore(tokens, ComputeOnly())
    full_s = time.perf_counter() - t
    layer_s = full_s / backend.spec.num_layers
    stored = sum([len(await memory.get(r.key) or b"") for r in restorer.chunks(tokens)[1]])
    throttled = Restorer(backend, ThrottledStore(memory, bytes_per_s=0.5 * stored / full_s), args.chunk)
    log(f"{desc}: {args.tokens} tokens, full prefill {full_s:.2f} s, one layer {layer_s * 1e3:.0f} ms")
    policies = {"compute-only": (restorer, ComputeOnly), "two-pointer@0.5x": (throttled, TokenTwoPointer)}
    deadlines = [f * full_s for f in args.deadlines]
    real_checkpoint = hf.checkpoint
    samples: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for mode in ("layer-bound", "unit-bound"):
            hf.checkpoint = real_checkpoint if mode == "layer-bound" else (lambda: None)
            try:
                for name, (r, policy) in policies.items():
                    for d in deadlines:
                        if isinstance(r.store, ThrottledStore):
                            r.store.reset()
                        t = time.perf_counter()
                        with anyio.move_on_after(d):
                            await r.restore(tokens, policy())
                        over = time.perf_counter() - t - d
                        samples.setdefault(f"{name}|{mode}", []).append(over)
                        log(
                            f"  [round {rnd + 1}/{args.rounds}] {name} {mode} deadline {d:.2f} s: +{over:.3f} s"
                        )
            finally:
                hf.checkpoint = real_checkpoint
    rows, cases = [], {}
    for key, overs in samples.items():
        name, mode = key.split("|")
        cases[key] = {"median_overrun_s": median(overs), "max_overrun_s": max(overs), "overruns_s": overs}
        rows.append([name, mode, median(overs) * 1e3, max(overs) * 1e3, max(overs) / layer_s])
    print_table(
        ["restore", "cancellation", "overrun median ms", "max ms", "max / one layer"],
        rows,
        title=f"{desc}, {args.tokens} tokens: time from the deadline to the restore's return "
        f"(deadlines {', '.join(f'{d:.2f}' for d in deadlines)} s; one layer {layer_s * 1e3:.0f} ms)",
    )
    return {
        "benchmark": "cancel",
        "config": {
            "model": desc,
            "tokens": args.tokens,
            "chunk_size": args.chunk,
            "rounds": args.rounds,
            "deadline_fractions": args.deadlines,
            "tiny": args.tiny,
        },
        "machine": machine_info(),
        "code": code_version(),
        "full_prefill_s": full_s,
        "layer_s": layer_s,
        "deadlines_s": deadlines,
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096; --tiny 256)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--deadlines", type=float, nargs="+", default=[0.2, 0.5], help="as fractions of a prefill")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --tiny 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny random model: a smoke test")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (256 if args.tiny else 4096)
    args.chunk = min(args.chunk, 64) if args.tiny else args.chunk
    args.rounds = args.rounds or (1 if args.tiny else 3)
    args.out = args.out or (DEFAULT_OUT.with_name("cancel-tiny.json") if args.tiny else DEFAULT_OUT)
    return run_to_json(run, args, args.out)


if __name__ == "__main__":
    sys.exit(main())
