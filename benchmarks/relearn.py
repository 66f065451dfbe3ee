"""`Auto` after the link changed speed: restore by restore, against the best single strategy.

    python benchmarks/relearn.py                  # SmolLM2 on the CPU: issue 59's sequence, 2 rounds
    python benchmarks/relearn.py --quick          # 1,024 tokens, 1 round, a restorer per phase only
    python benchmarks/relearn.py --tokens 4096    # the last phase at another length

Issue 59's sequence, over one store (a memory store behind a `ThrottledStore`, whose name, and so the
file of what restorers learn of it, is the same whatever its speed): `Auto` restores a 256-token prompt
three times over a link at 0.25x the balance bandwidth (where computing and loading the prompt take
equally long), then three times at 4x, then a 2,048-token prompt six times at 0.25x of its own
balance. Two ways: a fresh `Restorer` per phase that starts from what the last one kept (`learn=` one
file, as restorers of one machine and store do), and one restorer throughout (a process whose link
changed speed under it). No profile of the machine is used.

Each restore of the last phase is compared with the best of the fixed strategies (compute-only, the
token-wise and the layer-wise two-pointers, and load-only from 0.5x up: below, it takes Tc / m > Tc),
each run by a warmed restorer of its own that learns nothing persistent, timed right after that
`Auto` restore (taking turns in a rotating order), so that each ratio compares restores that shared
the machine's state; the median over rounds is reported.
Every restored KV is checked against a full prefill.

Target (issue 59): from the 4th restore after the change on, `Auto` within 1.10x of the best.
Writes benchmarks/results/relearn[-quick].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import format_table, machine_info, median, write_json
from _provenance import code_version

from kvrestore import Auto, ComputeOnly, LayerTwoPointer, LoadOnly, Restorer, TokenTwoPointer
from kvrestore.backends.hf import HFBackend
from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.stores import MemoryStore, ThrottledStore
from kvrestore.tools.text import reference_tokens

RESULTS = Path(__file__).resolve().parent / "results"
FIXED = {
    "compute-only": ComputeOnly,
    "load-only": LoadOnly,
    "two-pointer": TokenTwoPointer,
    "layer-wise": LayerTwoPointer,
}
TARGET = 1.10
FROM_RESTORE = 4
KV_ATOL = 1e-3
MODES = ("a restorer per phase", "one restorer")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def timed(
    restorer: Restorer, tokens: list[int], policy: Any, store: ThrottledStore
) -> tuple[float, Any]:
    store.reset()
    t0 = time.perf_counter()
    res = await restorer.restore(tokens, policy)
    return time.perf_counter() - t0, res


async def run(args: argparse.Namespace) -> dict:
    backend = HFBackend.from_smollm2(dtype=torch.float32)  # (converted once into the user's cache)
    os.environ["KVRESTORE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvrestore-relearn-cache-")  # no profile
    lengths = sorted({256, args.tokens})
    prompt = reference_tokens(backend.tokenizer, max(lengths))
    memory = MemoryStore()
    seeder = Restorer(backend, memory, learn=False, profile=False)
    refs, compute_s = {}, {}
    for n in lengths:
        await seeder.save(prompt[:n])
        refs[n] = (await seeder.restore(prompt[:n], ComputeOnly())).kv.data.clone()  # also a warm-up
        compute_s[n] = median(
            [(await seeder.restore(prompt[:n], ComputeOnly())).stats.seconds for _ in range(2)]
        )
    balance = {n: n * backend.spec.kv_bytes_per_token / compute_s[n] for n in lengths}
    phases = [(256, 0.25, 3), (256, 4.0, 3), (args.tokens, 0.25, args.restores)]
    n_last, m_last, _ = phases[-1]
    last = ThrottledStore(memory, m_last * balance[n_last])
    fixed_names = [k for k in FIXED if not (k == "load-only" and m_last < 0.5)]
    fixed = {name: Restorer(backend, last, learn=False, profile=False) for name in fixed_names}
    tokens = prompt[:n_last]
    worst_kv = 0.0
    for name in fixed_names:  # warm-up: each fixed restorer learns the costs it will run with
        await timed(fixed[name], tokens, FIXED[name](), last)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for mode in args.modes:
            learned = Path(tempfile.mkdtemp(prefix="kvrestore-relearn-")) / "learned.json"
            store = ThrottledStore(memory, 1.0)  # one store; its link's speed is set per phase
            restorer = None
            seq: list[dict[str, Any]] = []
            for n, m, count in phases:
                store.link = Link(BandwidthTrace.constant(m * balance[n]))  # the link changes speed
                if restorer is None or mode == MODES[0]:
                    if restorer is not None:  # what it learned goes to the file (as `close` would;
                        await restorer.planner.keep(settle=True)  # that would close the shared store)
                    restorer = Restorer(backend, store, learn=learned, profile=False)
                for k in range(count):
                    seconds, res = await timed(restorer, prompt[:n], Auto(), store)
                    worst_kv = max(worst_kv, (res.kv.data - refs[n]).abs().max().item())
                    step: dict[str, Any] = {
                        "tokens": n,
                        "multiplier": m,
                        "restore": k + 1,
                        "seconds": seconds,
                        "choice": res.plan.choice.name,
                        "link_changes": restorer.planner.link.changes,
                        "explain": res.plan.explain(),
                        "vs_best": None,
                    }
                    if (n, m) == (n_last, m_last):  # the fixed strategies, right after (turns rotate)
                        step["fixed_s"] = {}
                        for name in fixed_names[k % len(fixed_names) :] + fixed_names[: k % len(fixed_names)]:
                            fixed_s, done = await timed(fixed[name], tokens, FIXED[name](), last)
                            worst_kv = max(worst_kv, (done.kv.data - refs[n_last]).abs().max().item())
                            step["fixed_s"][name] = fixed_s
                        step["vs_best"] = seconds / min(step["fixed_s"].values())
                    seq.append(step)
            last_phase = [s for s in seq if s["vs_best"] is not None]
            log(
                f"  {mode}: "
                + ", ".join(f"#{s['restore']} {s['vs_best']:.2f} ({s['choice']})" for s in last_phase)
            )
            rounds.append({"round": r + 1, "mode": mode, "restores": seq})
    return summarize(args, rounds, compute_s, balance, worst_kv)


def summarize(
    args: argparse.Namespace, rounds: list[dict], compute_s: dict, balance: dict, worst_kv: float
) -> dict:
    by_mode: dict[str, Any] = {}
    rows = []
    for mode in args.modes:
        runs = [r for r in rounds if r["mode"] == mode]
        last = [[s for s in r["restores"] if s["vs_best"] is not None] for r in runs]
        ratios = [median([seq[k]["vs_best"] for seq in last]) for k in range(args.restores)]
        choices = [[seq[k]["choice"] for seq in last] for k in range(args.restores)]
        worst_from = max(ratios[FROM_RESTORE - 1 :])
        # the noise floor: how far apart one fixed strategy's own restores of the phase were, and Auto
        # against the strategy of the lowest median over its round (one noisy sample is not the best)
        samples = {
            n: [x for seq in last for s in seq for k, x in s["fixed_s"].items() if k == n] for n in FIXED
        }
        spread = {n: max(v) / min(v) for n, v in samples.items() if v}
        per_round_best = [
            median(min(([s["fixed_s"][n] for s in seq] for n in seq[0]["fixed_s"]), key=median))
            for seq in last
        ]
        vs_median = [
            median([seq[k]["seconds"] / b for seq, b in zip(last, per_round_best, strict=True)])
            for k in range(args.restores)
        ]
        by_mode[mode] = {
            "vs_best_by_restore": {f"#{k + 1}": v for k, v in enumerate(ratios)},
            "vs_best_median_by_restore": {f"#{k + 1}": v for k, v in enumerate(vs_median)},
            "choices_by_restore": {f"#{k + 1}": c for k, c in enumerate(choices)},
            "fixed_spread_max_over_min": spread,
            f"worst_from_restore_{FROM_RESTORE}": worst_from,
            "met": worst_from <= TARGET,
        }
        rows.append([mode, "vs per-restore best", *ratios, "yes" if worst_from <= TARGET else "NO"])
        rows.append(
            [
                mode,
                "vs best median",
                *vs_median,
                "yes" if max(vs_median[FROM_RESTORE - 1 :]) <= TARGET else "NO",
            ]
        )
        log(
            f"  {mode}: one fixed strategy's restores, max / min: "
            + ", ".join(f"{n} {v:.2f}" for n, v in spread.items())
        )
    print(
        format_table(
            [
                "restorer",
                "against",
                *(f"#{k + 1}/best" for k in range(args.restores)),
                f"<= {TARGET} from #{FROM_RESTORE}",
            ],
            rows,
            title=f"Auto at {args.tokens} tokens over 0.25x its balance bandwidth, after the same store was "
            f"learned at 256 tokens over 0.25x and 4x: restore time over the best single strategy timed right "
            f"after it, and over the single strategy of the best median in its round (medians of {args.rounds} "
            "rounds)",
        )
    )
    print(f"KV max |diff| {worst_kv:.2e} (<= {KV_ATOL})")
    return {
        "config": {
            "tokens": args.tokens,
            "rounds": args.rounds,
            "restores": args.restores,
            "modes": args.modes,
        },
        "compute_only_s": {str(k): v for k, v in compute_s.items()},
        "balance_bytes_per_s": {str(k): v for k, v in balance.items()},
        "results": by_mode,
        "rounds": rounds,
        "targets": {
            "auto_within": TARGET,
            "from_restore": FROM_RESTORE,
            "met": all(v["met"] for v in by_mode.values()),
            "worst_kv_abs_diff": worst_kv,
            "kv_exact": worst_kv <= KV_ATOL,
        },
        "machine": machine_info(),
        "code": code_version(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None, help="the last phase's prompt length (default 2048)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick 1)")
    p.add_argument("--restores", type=int, default=6, help="Auto restores in the last phase")
    p.add_argument("--quick", action="store_true", help="1,024 tokens, one round, a restorer per phase")
    p.add_argument("--out", default=None, help="the JSON to write")
    p.add_argument("--summarize", default=None, help="work out the figures of this JSON again, run nothing")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.quick else 2048)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.modes = list(MODES[:1] if args.quick else MODES)
    if args.restores < FROM_RESTORE:
        p.error(f"--restores must be at least {FROM_RESTORE}")
    args.out = Path(args.out) if args.out else RESULTS / f"relearn{'-quick' if args.quick else ''}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:  # the figures of a JSON written before, worked out again (no restore runs)
        old = json.loads(Path(args.summarize).read_text())
        data = {
            **old,
            **summarize(
                args,
                old["rounds"],
                old["compute_only_s"],
                old["balance_bytes_per_s"],
                old["targets"]["worst_kv_abs_diff"],
            ),
            "machine": old["machine"],
            "code": old["code"],
        }
        print(f"wrote {write_json(args.out, data)}")
        return 0
    data = asyncio.run(run(args))
    print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
