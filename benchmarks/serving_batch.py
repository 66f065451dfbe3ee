"""CacheFlow's batch rule in a vLLM OpenAI server: several users asking at once after a restart, each
prompt a stored document, read through the connector's throttle (issue 48).

What a user runs, with the pieces of `serving.py`: a warm-up server fills the store with `--docs`
documents of `--doc-tokens` tokens (each asked once, one at a time); every later server is a restart
over the store as the warm-up left it, asked all the documents at once (`--docs` users, each with its
own document).

Calibration: a new server with ``"split": "compute_all"`` (the connector never loads) is asked all the
documents at once, `--calibrations` times. The fastest sets the **balance bandwidth**, the documents' KV
over its worst TTFT: the rate at which loading them all takes as long as computing them all at once
(issue 48's); a host shared with other work only ever slows a run, so the fastest is the least
disturbed (`--balance-bytes-per-s` gives the rate instead). Its learned compute costs are where every
later server starts. The warm-up's one-at-a-time rate is recorded beside it.

Configurations:

* **compute-all**, the link playing no part;
* at each of `--factors` x the balance bandwidth, through the connector's throttle:
  **load-all** (``"split": "load_all"``), **per-request split** (the default split, ``"batch": false``:
  each split planned as if the request had the link to itself) and **batch rule** (the default split,
  ``"batch": true``, the default: each split counts the loads queued ahead of it, and the link serves
  the load that saves the most compute per byte first).

Rounds (`--rounds`): each round restarts a server per configuration, each asked four fresh requests
(the documents again, over the store as the warm-up left it). The first round runs load-all first at
each rate (it measures the link); later rounds rotate the order, so each configuration takes each slot
in turn and the noise of a shared host hits them alike. Every load-all server starts from the
calibration's costs; the first round's load-all at a rate leaves the link's. From those, one split
server at that rate, not counted, learns what steps that split cost (a step that loads computes
slower beside its load: `costs.learned.loading_factor`), as a server restarted over its cost file
knows; every split at that rate starts from the costs it left (so every round of a split starts from
the same costs).

Reported per configuration over all rounds: TTFT p50, p90, p99 (nearest rank: the worst below 100
samples) and worst; and per rate the ratios of the targets (issue 48, at 1x): the batch rule's worst
TTFT <= 0.80x the better of load-all's and compute-all's, and its p99 <= 0.85x the per-request
split's, with the same ratio round by round. Beside them, each rate's **lane floor** (`lane_floor`): the
shortest time in which any split of the documents could compute and load them all, both lanes busy
from the first request to the last, with the compute costs the calibration learned and the link's rate
as load-all's loads saw it; no schedule's worst TTFT is below it. Prints a table and writes JSON (default
`benchmarks/results/serving-batch.json`); every output is checked against compute-all's (greedy).

    .venv-vllm/bin/python benchmarks/serving_batch.py                  # 3 rates, one round: ~30 minutes
    .venv-vllm/bin/python benchmarks/serving_batch.py --factors 1 --rounds 4   # ~25 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from _common import percentile, print_table, ratio, write_json
from serving import (
    KV_BYTES_PER_TOKEN,
    LongDocQA,
    Phase,
    log,
    model_and_text,
    report_head,
    serve_phase,
    snapshot,
    summarize,
)

from kvrestore.costs.learned import LOADING_MIN_TOKENS, LearnedState, fit_prefill_steps
from kvrestore.costs.links import link_from_loads
from kvrestore.planning.split import max_loadable, pipelined_s, split_candidates
from kvrestore.tools.vllm_server import kv_transfer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serving-batch.json"
CHUNK_TOKENS, BLOCK_TOKENS = 256, 128  # the connector's default chunks, the server's pages
CONFIGS = {  # label -> the connector's extra config beyond the store
    "load-all": {"split": "load_all"},
    "per-request split": {"split": "planned", "batch": False},
    "batch rule": {"split": "planned", "batch": True},
}


def round_order(items: list[tuple[str, float | None]], r: int) -> list[tuple[str, float | None]]:
    """Round `r`'s servers: the first round as listed (compute-all first, load-all first at each rate),
    each later round rotated by one more (each configuration takes each slot in turn)."""
    if r == 0:
        return list(items)
    k = r % len(items)
    return items[k:] + items[:k]


def _book(cost_dir: Path) -> LearnedState | None:
    files = sorted(cost_dir.glob("costs-*.json")) if cost_dir.exists() else []
    return msgspec.json.decode(files[0].read_bytes(), type=LearnedState) if files else None


def lane_floor(prompt_tokens: list[int], compute_dir: Path, link_dir: Path) -> dict[str, Any] | None:
    """The least time in which the link and the compute lane, both busy from the start and never
    waiting on each other, could serve these prompts: over every choice of stored tokens to load per
    prompt (whole chunks and pages, as a split loads), the least of max(link seconds, compute seconds).
    Compute from the costs `compute_dir` learned (`fit_prefill_steps`: steps and passes of several
    requests), the link from the whole loads `link_dir`'s book saw. No schedule's last first token
    comes sooner: a server adds its steps' boundaries, the first request's step alone and the host
    the two lanes share (`step_overrun`). None without both costs."""
    comp, lnk = _book(compute_dir), _book(link_dir)
    compute = fit_prefill_steps(comp.steps, comp.passes) if comp is not None else None
    link = link_from_loads([s for v in lnk.links.values() for s in v]) if lnk is not None else None
    if compute is None or link is None:
        return None

    def ks(n: int) -> list[int]:
        stored = n // CHUNK_TOKENS * CHUNK_TOKENS
        return split_candidates(max_loadable(n, stored, BLOCK_TOKENS), CHUNK_TOKENS, BLOCK_TOKENS)

    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(*(ks(n) for n in prompt_tokens)):
        load = sum(k * KV_BYTES_PER_TOKEN for k in choice) / link.bytes_per_s
        comp_s = sum(compute.seconds(n - k, k) for n, k in zip(prompt_tokens, choice, strict=True))
        if best is None or max(load, comp_s) < best[0]:
            best = (max(load, comp_s), choice)
    assert best is not None
    return {"floor_s": best[0], "loaded_tokens": list(best[1]), "link_bytes_per_s": link.bytes_per_s}


def step_overrun(compute_dir: Path, loading_dirs: Sequence[Path]) -> list[float]:
    """How much longer each step that loaded and computed (at least `LOADING_MIN_TOKENS` of it) took, in
    the servers whose books are `loading_dirs`, than its load and its compute side by side
    (`planning.split.pipelined_s`, the compute from `compute_dir`'s costs): what the two lanes lose to
    sharing the host."""
    comp = _book(compute_dir)
    compute = fit_prefill_steps(comp.steps, comp.passes) if comp is not None else None
    seen: set[tuple[float, ...]] = set()  # each server's book starts with the samples before it
    out = []
    for d in loading_dirs:
        book = _book(d)
        for sample in book.loading if book is not None and compute else []:
            n_new, past, load_s, step_s, layers = sample
            if n_new >= LOADING_MIN_TOKENS and tuple(sample) not in seen:
                seen.add(tuple(sample))
                alone = pipelined_s(load_s, compute.seconds(int(n_new), int(past)), int(layers))
                out.append(step_s / alone)
    return out


def ttft_stats(ttfts: list[float]) -> dict[str, float]:
    return {
        "n": len(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_worst_s": max(ttfts) if ttfts else float("nan"),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, encode, texts = model_and_text()
    docs = LongDocQA(args.docs, args.doc_tokens, 24, args.answer_tokens, args.docs, args.seed)
    docs.make(texts)
    args.primer = texts.take(64)
    args.work.mkdir(parents=True, exist_ok=True)
    store, costs = args.work / "kv", args.work / "costs"
    fill, computed = args.work / "kv-after-warm-up", args.work / "costs-after-compute-all"
    base = {"store_url": str(store), "cost_dir": str(costs)}

    def serve(label: str, extra: dict[str, Any], warm: bool = False) -> Phase:
        kv = kv_transfer("KVRestoreConnector", {**base, **extra})
        return serve_phase(args, model, label, kv, None, docs, warm, encode)

    def costs_from(src: Path | None) -> None:
        shutil.rmtree(costs, ignore_errors=True)
        if src is not None and src.exists():
            shutil.copytree(src, costs)

    log("== warm-up: the store filled, one document at a time")
    warm = serve("warm-up", {}, warm=True)
    snapshot(store, fill)
    per_byte = sorted(
        r.result.ttft_s / (len(r.prompt) * KV_BYTES_PER_TOKEN) for r in warm.requests[docs.name]
    )
    one_at_a_time = ratio(1.0, per_byte[len(per_byte) // 2])

    def kv_bytes_of(phase: Phase) -> int:
        return sum(len(q.prompt) for q in phase.requests[docs.name]) * KV_BYTES_PER_TOKEN

    def worst(phase: Phase) -> float:
        return max(q.result.ttft_s for q in phase.requests[docs.name] if q.result)

    # calibration: compute-all, `--calibrations` times; a shared host only ever slows a run, so the
    # fastest sets the balance and leaves the compute costs every later server starts from
    calibrations: list[tuple[float, int, Path]] = []  # (worst TTFT, KV bytes asked, costs left)
    for c in range(args.calibrations):
        log(f"== calibration {c + 1} of {args.calibrations}: compute-all")
        snapshot(fill, store)
        costs_from(None)
        phase = serve(f"calibration {c + 1}", {"split": "compute_all"})
        kept = args.work / f"costs-after-calibration-{c + 1}"
        if costs.exists():
            shutil.copytree(costs, kept)
        worst_s, kv_bytes = worst(phase), kv_bytes_of(phase)
        calibrations.append((worst_s, kv_bytes, kept))
        log(f"   worst TTFT {worst_s:.2f} s: {kv_bytes / worst_s / 1e6:.1f} MB/s")
    fastest_s, kv_bytes, fastest_costs = min(calibrations)
    if fastest_costs.exists():
        shutil.copytree(fastest_costs, computed)
    balance = args.balance_bytes_per_s or ratio(kv_bytes, fastest_s)
    log(
        f"   balance bandwidth: {balance / 1e6:.1f} MB/s"
        f"{' (given)' if args.balance_bytes_per_s else ''}; "
        f"calibrations' worst TTFTs {', '.join(f'{c[0]:.2f}' for c in calibrations)} s; "
        f"{one_at_a_time / 1e6:.1f} MB/s one at a time"
    )

    items: list[tuple[str, float | None]] = [("compute-all", None)]
    items += [(name, f) for f in args.factors for name in CONFIGS]
    phases: dict[str, list[tuple[int, int, Phase]]] = {}  # label -> (round, slot, phase)
    points: dict[str, dict[str, Any]] = {}
    warmed: set[float] = set()  # rates whose split warm-up ran
    for r in range(args.rounds):
        log(f"== round {r + 1} of {args.rounds}")
        for slot, (name, f) in enumerate(round_order(items, r)):
            label = name if f is None else f"{name} @ {f:g}x"
            snapshot(fill, store)  # every server finds the chunks the warm-up saved, and only those
            learned = args.work / f"costs-after-load-all-{f or 0:g}x"
            if name == "compute-all":
                costs_from(computed)
                extra: dict[str, Any] = {"split": "compute_all"}
            elif name == "load-all":
                costs_from(computed)
                extra = {**CONFIGS[name], "throttle_bytes_per_s": f * balance}
            else:  # both splits start from the costs a split server at this rate left
                extra = {**CONFIGS[name], "throttle_bytes_per_s": f * balance}
                primed = args.work / f"costs-after-split-{f:g}x"
                if f not in warmed:
                    warmed.add(f)
                    log(f"== split warm-up @ {f:g}x (not counted): its costs are where every split starts")
                    costs_from(learned)
                    serve(f"split warm-up @ {f:g}x", {**extra, **CONFIGS["per-request split"]})
                    if costs.exists():
                        shutil.copytree(costs, primed)
                    snapshot(fill, store)
                costs_from(primed if primed.exists() else learned)
            phase = serve(f"{label} r{r + 1}", extra)
            phases.setdefault(label, []).append((r, slot, phase))
            points[label] = {"config": name, "factor": f, "bytes_per_s": None if f is None else f * balance}
            if name == "load-all" and not learned.exists() and costs.exists():
                shutil.copytree(costs, learned)
            if name == "batch rule" and costs.exists():  # what its steps beside loads took (`lane_floor`)
                shutil.copytree(
                    costs, args.work / f"costs-after-batch-rule-{f:g}x-r{r + 1}", dirs_exist_ok=True
                )

    reference = phases["compute-all"][0][2]
    results: dict[str, Any] = {}
    for label, runs in phases.items():
        rounds = []
        for r, slot, phase in runs:
            w = summarize(phase, reference)[docs.name]
            ttfts = [q["ttft_s"] for q in w["requests"] if "ttft_s" in q]
            rounds.append(
                {
                    "round": r + 1,
                    "slot": slot,
                    "ready_s": phase.ready_s,
                    "metrics": phase.metrics,
                    "ttfts_s": ttfts,
                    **ttft_stats(ttfts),
                    "same_output_as_vllm_alone": w["same_output_as_vllm_alone"],
                    "mismatched": w["mismatched"],
                    "requests": w["requests"],
                }
            )
        every = [t for q in rounds for t in q["ttfts_s"]]
        results[label] = {
            **points[label],
            "rounds": len(rounds),
            **ttft_stats(every),
            "ttft_median_s": statistics.median(every),
            "same_output_as_vllm_alone": all(q["same_output_as_vllm_alone"] for q in rounds),
            "planned_tokens_per_round": statistics.fmean(
                q["metrics"].get("planned_tokens", 0) for q in rounds
            ),
            "loaded_tokens_per_round": statistics.fmean(q["metrics"].get("loaded_tokens", 0) for q in rounds),
            "per_round": rounds,
        }
    targets: dict[str, Any] = {}
    prompts = [len(q.prompt) for q in reference.requests[docs.name]]
    for f in args.factors:
        batch, alone = results[f"batch rule @ {f:g}x"], results[f"per-request split @ {f:g}x"]
        load_all, compute_all = results[f"load-all @ {f:g}x"], results["compute-all"]
        best = min(load_all["ttft_worst_s"], compute_all["ttft_worst_s"])
        by_round = [
            b["ttft_p99_s"] / a["ttft_p99_s"]
            for b, a in zip(batch["per_round"], alone["per_round"], strict=True)
        ]
        targets[f"{f:g}x balance"] = {
            "rounds": args.rounds,
            "batch_rule_worst_vs_best_of_load_all_compute_all": batch["ttft_worst_s"] / best,
            "per_request_worst_vs_best_of_load_all_compute_all": alone["ttft_worst_s"] / best,
            "batch_rule_p99_vs_per_request_p99": batch["ttft_p99_s"] / alone["ttft_p99_s"],
            "batch_rule_p90_vs_per_request_p90": batch["ttft_p90_s"] / alone["ttft_p90_s"],
            "batch_rule_p50_vs_per_request_p50": batch["ttft_p50_s"] / alone["ttft_p50_s"],
            "batch_rule_p99_vs_per_request_p99_by_round": by_round,
            "batch_rule_p99_vs_per_request_p99_median_of_rounds": statistics.median(by_round),
            "batch_rule_beats_per_request_rounds": sum(x < 1 for x in by_round),
            "batch_rule_worst_vs_best_of_load_all_compute_all_by_round": [
                b["ttft_worst_s"] / min(la["ttft_worst_s"], ca["ttft_worst_s"])
                for b, la, ca in zip(
                    batch["per_round"], load_all["per_round"], compute_all["per_round"], strict=True
                )
            ],
            "target_worst": 0.80,
            "target_p99": 0.85,
        }
        floor = lane_floor(prompts, computed, args.work / f"costs-after-load-all-{f:g}x")
        if floor is not None:
            overrun = step_overrun(
                computed, [args.work / f"costs-after-batch-rule-{f:g}x-r{r + 1}" for r in range(args.rounds)]
            )
            targets[f"{f:g}x balance"] |= {
                "lane_floor": floor,
                "batch_rule_worst_vs_floor": batch["ttft_worst_s"] / floor["floor_s"],
                "per_request_p99_vs_floor": alone["ttft_p99_s"] / floor["floor_s"],
                "target_p99_vs_floor": 0.85 * alone["ttft_p99_s"] / floor["floor_s"],
                "batch_rule_loading_steps_vs_lanes_side_by_side": overrun,
            }
    rows = [
        [
            label,
            r["n"],
            r["ttft_p50_s"],
            r["ttft_p90_s"],
            r["ttft_p99_s"],
            r["ttft_worst_s"],
            r["planned_tokens_per_round"],
            r["loaded_tokens_per_round"],
            r["same_output_as_vllm_alone"],
        ]
        for label, r in results.items()
    ]
    print_table(
        [
            "configuration",
            "n",
            "p50 s",
            "p90 s",
            "p99 s",
            "worst s",
            "planned tok/round",
            "loaded tok/round",
            "same output",
        ],
        rows,
        title=f"{args.docs} users at once after a restart, {args.rounds} rounds, {args.doc_tokens}-token documents, "
        f"vLLM OpenAI server (CPU), SmolLM2-135M fp32; balance {balance / 1e6:.1f} MB/s",
    )
    for k, v in targets.items():
        log(
            f"  {k}: batch rule worst {v['batch_rule_worst_vs_best_of_load_all_compute_all']:.2f}x the better "
            f"of load-all and compute-all (per-request {v['per_request_worst_vs_best_of_load_all_compute_all']:.2f}x); "
            f"p99 {v['batch_rule_p99_vs_per_request_p99']:.2f}x the per-request split's (median of rounds "
            f"{v['batch_rule_p99_vs_per_request_p99_median_of_rounds']:.2f}x, lower in "
            f"{v['batch_rule_beats_per_request_rounds']} of {args.rounds} rounds)"
        )
        if "lane_floor" in v:
            log(
                f"  {k}: lane floor {v['lane_floor']['floor_s']:.2f} s (loading "
                f"{v['lane_floor']['loaded_tokens']} tokens); batch rule worst {v['batch_rule_worst_vs_floor']:.2f}x "
                f"it, per-request p99 {v['per_request_p99_vs_floor']:.2f}x, the p99 target "
                f"{v['target_p99_vs_floor']:.2f}x"
            )
        if v.get("batch_rule_loading_steps_vs_lanes_side_by_side"):
            log(
                f"  {k}: the batch rule's steps that loaded and computed took "
                f"{statistics.median(v['batch_rule_loading_steps_vs_lanes_side_by_side']):.2f}x their two lanes "
                f"side by side (median of {len(v['batch_rule_loading_steps_vs_lanes_side_by_side'])})"
            )
    return {
        **report_head("serving-batch", args, balance),
        "balance_one_at_a_time_bytes_per_s": one_at_a_time,
        "calibration_worst_ttfts_s": [c[0] for c in calibrations],
        "results": results,
        "targets": targets,
        "warm_up": summarize(warm, None)[docs.name],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=4, help="documents, and users asking at once")
    p.add_argument("--doc-tokens", type=int, default=1800)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=80, help="vLLM's KV space, in blocks of 128 tokens")
    p.add_argument("--factors", type=float, nargs="*", default=[0.5, 1.0, 2.0], help="x balance bandwidth")
    p.add_argument("--rounds", type=int, default=1, help="restarted servers per configuration, interleaved")
    p.add_argument(
        "--calibrations",
        type=int,
        default=2,
        help="compute-all servers before the rounds: the fastest sets the balance",
    )
    p.add_argument(
        "--balance-bytes-per-s",
        type=float,
        default=None,
        help="the balance bandwidth, given instead of measured",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="stores and server logs (default: a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.calibrations < 1:
        p.error("--calibrations must be at least 1 (the compute costs every server starts from)")
    args.work = args.work or Path(tempfile.mkdtemp(prefix="kvrestore-serving-batch-"))
    result = run(args)
    write_json(args.out, result)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
