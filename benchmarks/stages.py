"""Stage-parallel restore (CacheFlow §3.2, eq. 2): S = 1 and 2 processes against the sequential pipeline.

Issue 20's benchmark. SmolLM2-135M (fp32, 30 layers) on this CPU, one torch thread per process, a prompt
saved with its boundary activations (layer 15) in a local directory; every process reads it through its
own `ThrottledStore` link (CacheFlow: each GPU has its own I/O path) at 0.5x, 1x and 2x the balance
bandwidth, where balance = the prompt's KV bytes / the time one process takes to compute the whole model
over it (loading everything takes as long as computing everything). Cases, interleaved round by round:

* **S1**: one process restores all 30 layers with the token-wise two-pointer (the single-stage restore);
* **S2**: two processes restore layers [0, 15) and [15, 30) at the same time, stage 1 computing from the
  stored boundary activations;
* **S2-seq**: the same two stages one after the other (stage 1 starts when stage 0 has finished): the
  sequential pipeline of the same stages, the same work without the stage parallelism;
* compute-only with one and two processes (the measured costs eq. 2 and the simulator start from).

Eq. 2 predicts T*_S = T*/S with T* = Tc*Tio/(Tc+Tio), Tc the measured compute-only time of one process
and Tio the prompt's KV bytes over the link. The simulator (`kvrestore.sim.simulate`, the real policy on a
simulated clock) extrapolates to S = 4 and 8 from the measured per-chunk costs, scaled by each stage's
share of the layers, plus its boundary activations on its link; it is checked against the measured S = 2.

    python benchmarks/stages.py                    # SmolLM2, 2048 tokens, 128-token chunks, 3 rounds
    python benchmarks/stages.py --tiny --out /tmp/stages.json

Prints a table and writes benchmarks/results/stages.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from _common import fmt, machine_info, median, print_table, ratio, write_json
from _provenance import code_version

from kvrestore import ComputeOnly, Restorer, TokenTwoPointer, codec, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.distributed import StageLayout, StageRestorer, gather_kv, save_with_boundaries, spawn
from kvrestore.sim.simulate import simulate
from kvrestore.stores import ThrottledStore

ROOT = Path(__file__).resolve().parent.parent
MULTIPLIERS = (0.5, 1.0, 2.0)
LLAMA_8B = {"hidden_size": 4096, "num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "itemsize": 2}


def make_backend(tiny: bool) -> HFBackend:
    if not tiny:
        return HFBackend.from_smollm2(dtype=torch.float32)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return HFBackend(transformers.LlamaForCausalLM(config).eval(), name="tiny-llama-8")


# -- the stage processes ---------------------------------------------------------------------------


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Both processes run every case in the same order; rank 1 idles through the one-process cases."""
    backend = make_backend(cfg["tiny"])
    L = backend.spec.num_layers
    tokens = cfg["tokens"]
    solo = dist.new_group([0])  # the S = 1 restores (every rank creates it)
    inner = open_store(cfg["store"])
    stages = {
        1: StageRestorer(backend, inner, StageLayout.even(L, 1), cfg["chunk"], group=solo)
        if rank == 0
        else None,
        2: StageRestorer(backend, inner, StageLayout.even(L, 2), cfg["chunk"]),
    }

    def run(case: str, policy: Any, bytes_per_s: float | None, gather: bool = False) -> dict[str, Any]:
        n = 1 if case.startswith("S1") or case == "compute1" else 2
        stage = stages[n]
        result = None
        dist.barrier()
        t0 = time.perf_counter()
        if stage is not None:
            stage.store = ThrottledStore(inner, bytes_per_s) if bytes_per_s else inner
            result = anyio.run(partial(stage.restore, tokens, policy, sequential=case.startswith("S2-seq")))
        mine = {"seconds": time.perf_counter() - t0, "stats": None, "chunk_s": None}
        if result is not None:
            mine["stats"] = asdict(result.stats)
            mine["chunk_s"] = {e.first_chunk: e.end_s - e.start_s for e in result.trace.of_kind("compute")}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        ran = [x for x in everyone if x["stats"] is not None]
        out = {"case": case, "seconds": max(x["seconds"] for x in ran), "stages": [x["stats"] for x in ran]}
        out["chunk_s"] = [x["chunk_s"] for x in ran]
        if gather and result is not None and n == 2:
            kv = gather_kv(result, backend.spec)
            if kv is not None:
                ref = torch.load(cfg["reference"])
                out["max_abs_diff"] = float((kv.data - ref).abs().max())
        return out

    per_chunk = ComputeOnly(unit_chunks=1)
    warm = run("compute1", per_chunk, None)
    balance = cfg["kv_bytes"] / warm["seconds"]
    exact = run("S2@1.0", TokenTwoPointer(), balance, gather=True)
    rounds = []
    for _ in range(cfg["rounds"]):
        samples = [run("compute1", per_chunk, None), run("compute2", per_chunk, None)]
        for m in MULTIPLIERS:
            for case in ("S1", "S2", "S2-seq"):
                samples.append(run(f"{case}@{m}", TokenTwoPointer(), m * balance))
        rounds.append(samples)
    return {"warmup": warm, "balance_bytes_per_s": balance, "exactness": exact, "rounds": rounds}


# -- analysis --------------------------------------------------------------------------------------


def harmonic(tc: float, tio: float) -> float:
    return tc * tio / (tc + tio)


def simulated(
    S: int, chunk_tokens: list[int], chunk_s: list[float], spec: Any, hidden: int, bps: float
) -> float:
    """The slowest stage's simulated token-wise two-pointer restore, each stage with its own link."""
    total_s = []
    L = spec.num_layers
    for a, b in StageLayout.even(L, S).stages:
        share = (b - a) / L
        boundary = [t * hidden * spec.dtype.itemsize / bps if a > 0 else 0.0 for t in chunk_tokens]
        costs = [c * share + x for c, x in zip(chunk_s, boundary, strict=True)]
        nbytes = [int(t * spec.kv_bytes_per_token * share) + codec.HEADER_PROBE for t in chunk_tokens]
        link = Link(BandwidthTrace.constant(bps))

        def cost(i: int, j: int, _start: float, costs: list[float] = costs) -> float:
            return sum(costs[i:j])

        run = simulate(TokenTwoPointer(), chunk_tokens, [True] * len(chunk_tokens), cost, nbytes, link)
        total_s.append(run.makespan)
    return max(total_s)


def boundary_share(hidden: int, itemsize: int, kv_bytes_per_token: int, n_stages: int) -> dict[str, float]:
    """A boundary activation's bytes as a share of a chunk's KV (all layers) and of one stage's KV."""
    per_token = hidden * itemsize
    return {
        "bytes_per_token": per_token,
        "share_of_chunk_kv": per_token / kv_bytes_per_token,
        f"share_of_stage_kv_S{n_stages}": per_token / (kv_bytes_per_token / n_stages),
        f"all_boundaries_share_of_chunk_kv_S{n_stages}": (n_stages - 1) * per_token / kv_bytes_per_token,
    }


def analyse(raw: dict[str, Any], spec: Any, hidden: int, chunk_tokens: list[int]) -> dict[str, Any]:
    balance = raw["balance_bytes_per_s"]
    kv_bytes = sum(chunk_tokens) * spec.kv_bytes_per_token
    by_case: dict[str, list[dict[str, Any]]] = {}
    for samples in raw["rounds"]:
        for s in samples:
            by_case.setdefault(s["case"], []).append(s)
    secs = {case: [s["seconds"] for s in xs] for case, xs in by_case.items()}
    tc = median(secs["compute1"])
    n = len(chunk_tokens)
    chunk_s = [median([s["chunk_s"][0][i] for s in by_case["compute1"]]) for i in range(n)]
    stage_compute = [median([sum(s["chunk_s"][k].values()) for s in by_case["compute2"]]) for k in range(2)]
    slowdown = median([ratio(stage_compute[k], tc / 2) for k in range(2)])
    grid = []
    for m in MULTIPLIERS:
        bps = m * balance
        tio = kv_bytes / bps
        ideal1 = harmonic(tc, tio)
        s1, s2, seq = (median(secs[f"{c}@{m}"]) for c in ("S1", "S2", "S2-seq"))
        sims = {S: simulated(S, chunk_tokens, chunk_s, spec, hidden, bps) for S in (1, 2, 4, 8)}
        # the same with each stage's compute as slow as measured with both processes running on this CPU
        contended = simulated(2, chunk_tokens, [x * slowdown for x in chunk_s], spec, hidden, bps)
        grid.append(
            {
                "multiplier": m,
                "bytes_per_s": bps,
                "Tc_s": tc,
                "Tio_s": tio,
                "eq2_T1_s": ideal1,
                "eq2_T2_s": ideal1 / 2,
                "S1_s": s1,
                "S2_s": s2,
                "S2_seq_s": seq,
                "S1_rounds_s": secs[f"S1@{m}"],
                "S2_rounds_s": secs[f"S2@{m}"],
                "S2_seq_rounds_s": secs[f"S2-seq@{m}"],
                "S2_over_seq": ratio(s2, seq),
                "S2_over_eq2": ratio(s2, ideal1 / 2),
                "S1_over_eq2": ratio(s1, ideal1),
                "speedup_S1_over_S2": ratio(s1, s2),
                "sim_s": sims,
                "sim_S2_error": ratio(sims[2], s2) - 1,
                "sim_S2_contended_s": contended,
                # eq. 2 with the compute the two processes measured running together (2 x a stage's time)
                "eq2_T2_contended_s": harmonic(2 * max(stage_compute), tio) / 2,
                "S2_over_eq2_contended": ratio(s2, harmonic(2 * max(stage_compute), tio) / 2),
                "sim_S2_contended_error": ratio(contended, s2) - 1,
                "eq2_S4_s": ideal1 / 4,
                "eq2_S8_s": ideal1 / 8,
                "S2_stage_stats": [s["stages"] for s in by_case[f"S2@{m}"]][-1],
            }
        )
    return {
        "balance_bytes_per_s": balance,
        "kv_bytes": kv_bytes,
        "compute1_s": tc,
        "compute1_rounds_s": secs["compute1"],
        "compute2_stage_s": stage_compute,
        "contention": [ratio(stage_compute[k], tc / 2) for k in range(2)],
        "chunk_compute_s": chunk_s,
        "grid": grid,
    }


def measure(
    backend: HFBackend, args: argparse.Namespace, layout: StageLayout
) -> tuple[dict[str, Any], Any, Any]:
    """Save the prompt with its boundary activations, then run every case in two stage processes."""
    spec = backend.spec
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (args.tokens,), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="kvrestore-stages-") as tmp:

        async def save() -> Any:
            restorer = Restorer(backend, open_store(f"file://{tmp}/store"), args.chunk)
            return await save_with_boundaries(restorer, tokens, layout), restorer.chunks(tokens)[1]

        t0 = time.perf_counter()
        saved, refs = anyio.run(save)
        reference = backend.prefill_chunk(torch.tensor(tokens), None, 0).data
        torch.save(reference, f"{tmp}/reference.pt")
        print(
            f"saved {saved.n_chunks} chunks + {saved.boundary_objects} boundary activations in {time.perf_counter() - t0:.1f} s"
        )
        cfg = {
            "tiny": args.tiny, "tokens": tokens, "chunk": args.chunk, "rounds": args.rounds,
            "store": f"file://{tmp}/store", "reference": f"{tmp}/reference.pt",
            "kv_bytes": len(tokens) * spec.kv_bytes_per_token,
        }  # fmt: skip
        t0, load_before = time.perf_counter(), os.getloadavg()
        out = spawn(worker, 2, cfg, timeout_s=600.0, threads=1)
        load_after = os.getloadavg()
        print(
            f"measured in {time.perf_counter() - t0:.0f} s; load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
        )
    return out[0], load_before, load_after


def _int_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` read back from JSON: the per-chunk compute times keyed by chunk index again."""
    for samples in raw["rounds"]:
        for s in samples:
            s["chunk_s"] = [{int(k): v for k, v in d.items()} if d else d for d in s["chunk_s"]]
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (a smoke test)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "stages.json"))
    parser.add_argument(
        "--reanalyse", metavar="JSON", help="print and write the results of an earlier run again"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.chunk, args.rounds = min(args.tokens, 256), min(args.chunk, 32), min(args.rounds, 1)
    if args.reanalyse:  # the tables again from a JSON this script wrote, without measuring
        old = json.loads(Path(args.reanalyse).read_text())
        conf = old["config"]
        args.tiny, args.tokens, args.chunk, args.rounds = (
            conf["tiny"],
            conf["tokens"],
            conf["chunk"],
            conf["rounds"],
        )
        raw = _int_keys(old["raw"])
        load_before, load_after = old["machine"]["loadavg_before"], old["machine"]["loadavg_after"]
    backend = make_backend(args.tiny)
    spec = backend.spec
    hidden = int(backend.config.hidden_size)
    layout = StageLayout.even(spec.num_layers, 2)
    if not args.reanalyse:
        raw, load_before, load_after = measure(backend, args, layout)
    chunk_tokens = [min(args.chunk, args.tokens - a) for a in range(0, args.tokens, args.chunk)]
    result = analyse(raw, spec, hidden, chunk_tokens)
    rows = []
    for p in result["grid"]:
        rows.append([
            f"{p['multiplier']}x", fmt(p["S1_s"]), fmt(p["S2_s"]), fmt(p["S2_seq_s"]), fmt(p["eq2_T2_s"]),
            fmt(p["S2_over_seq"]), fmt(p["S2_over_eq2"]), fmt(p["speedup_S1_over_S2"]),
            fmt(p["sim_s"][2]), fmt(p["sim_s"][4]), fmt(p["sim_s"][8]),
        ])  # fmt: skip
    title = (
        f"{spec.name}: {args.tokens} tokens, {args.chunk}-token chunks, one thread per process; medians of "
        f"{args.rounds} rounds; balance {result['balance_bytes_per_s'] / 1e6:.1f} MB/s, Tc {result['compute1_s']:.2f} s"
    )
    headers = [
        "bw",
        "S1 s",
        "S2 s",
        "S2-seq s",
        "eq2 S2 s",
        "S2/seq",
        "S2/eq2",
        "S1/S2",
        "sim S2",
        "sim S4",
        "sim S8",
    ]
    print_table(headers, rows, title)
    shares = {
        spec.name: boundary_share(hidden, spec.dtype.itemsize, spec.kv_bytes_per_token, 2),
        "Llama-3.1-8B shape (bf16)": boundary_share(
            LLAMA_8B["hidden_size"], LLAMA_8B["itemsize"],
            2 * LLAMA_8B["num_layers"] * LLAMA_8B["num_kv_heads"] * LLAMA_8B["head_dim"] * LLAMA_8B["itemsize"], 2,
        ),
    }  # fmt: skip
    for name, s in shares.items():
        print(
            f"boundary activation, {name}: {s['bytes_per_token']} B/token = {100 * s['share_of_chunk_kv']:.2f}% of a "
            f"chunk's KV ({100 * s['share_of_stage_kv_S2']:.1f}% of one stage's KV at S = 2)"
        )
    p1 = next(p for p in result["grid"] if p["multiplier"] == 1.0)
    targets = {
        "S2_over_seq_at_1x": {"measured": p1["S2_over_seq"], "target": 0.6, "met": p1["S2_over_seq"] <= 0.6},
        "S2_over_eq2_at_1x": {"measured": p1["S2_over_eq2"], "target": 1.2, "met": p1["S2_over_eq2"] <= 1.2},
    }
    print(
        f"exactness (S2 at 1x, gathered vs full prefill): max |diff| {raw['exactness'].get('max_abs_diff')}"
    )
    print(
        "eq. 2 with the compute the 2 processes measured together: S2/eq2 "
        + ", ".join(f"{p['multiplier']}x {p['S2_over_eq2_contended']:.2f}" for p in result["grid"])
    )
    print(
        f"targets at 1x: S2/S2-seq {p1['S2_over_seq']:.3f} (<= 0.6), S2/eq2 {p1['S2_over_eq2']:.3f} (<= 1.2)"
    )
    errors = ", ".join(
        f"{p['multiplier']}x {100 * p['sim_S2_error']:+.0f}% ({100 * p['sim_S2_contended_error']:+.0f}% with the "
        "measured 2-process compute)"
        for p in result["grid"]
    )
    contention = ", ".join(f"{c:.2f}" for c in result["contention"])
    print(
        f"simulator vs measured S2: {errors}; stage compute with 2 processes = {contention}x its share of one's"
    )
    data = {
        "config": {"model": spec.name, "tokens": args.tokens, "chunk": args.chunk, "rounds": args.rounds,
                   "tiny": args.tiny, "threads_per_process": 1, "stages": [list(s) for s in layout.stages]},
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": load_after},
        "code": code_version(),
        "result": result,
        "boundary_share": shares,
        "targets": targets,
        "exactness": {"max_abs_diff": raw["exactness"].get("max_abs_diff"), "atol": 1e-3 if not args.tiny else 1e-5},
        "raw": raw,
    }  # fmt: skip
    write_json(args.out, data)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
