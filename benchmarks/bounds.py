"""Bounded in time and memory (issue 32): the figures behind docs/guarantees.md's promises.

Four cases, each in a process of its own (resident memory and thread counts are per process):

* **blackhole**: an S3 client against a socket on 127.0.0.1 that accepts connections and never answers.
  `lookup`, `restore` (checked against a full prefill) and `save`, each on a fresh restorer with the
  default deadlines, at 1,024 and 4,096 tokens: seconds to return, and what came back.
* **garbage**: four objects of garbage (100 MB each) under a prompt's chunk keys behind a
  `BoundedStore` over a local directory; one restore of that prompt (misses), three clean restores of
  another, then `close()`: resident memory before, after and its growth.
* **restorers**: 300 restorers over one local directory, each created, used for one restore and
  closed: threads and resident memory at the start and at the end.
* **poisoned**: a learned-costs file whose link is in bounds but absurd (2 kB/s, 5 s a request), then
  six `Auto` restores of a stored prompt on a new restorer, each interleaved with a `ComputeOnly` and a
  `LoadOnly` restore of it: Auto's time over the better of the two, restore by restore.

    python benchmarks/bounds.py                     # every case; SmolLM2 where the model matters
    python benchmarks/bounds.py --case blackhole --tiny

Prints a table per case and writes benchmarks/results/bounds.json (bounds-tiny.json with --tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import machine_info, print_table, write_json
from _provenance import code_version

from kvrestore import ComputeOnly, KVCache, LoadOnly, Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.costs.learned import CostLearner, store_name
from kvrestore.costs.links import LinkCost
from kvrestore.stores import BoundedStore, LocalStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bounds.json"
CASES = ("blackhole", "garbage", "restorers", "poisoned")


def tiny_backend() -> HFBackend:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return HFBackend(transformers.LlamaForCausalLM(config).eval(), name="tiny-llama")


def backend(tiny: bool) -> HFBackend:
    return tiny_backend() if tiny else HFBackend.from_smollm2(dtype=torch.float32)


def tokens_of(b: HFBackend, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, b.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


# -- cases ---------------------------------------------------------------------------------------------


class BlackHole:
    """Accepts on 127.0.0.1, never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return


def case_blackhole(b: HFBackend) -> dict[str, Any]:
    hole = BlackHole()
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": hole.endpoint,
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }
    out: dict[str, Any] = {"rows": []}
    for n in (1024, 4096):
        tokens = tokens_of(b, n, seed=n)
        ref = b.prefill_chunk(tokens, None, 0).data
        for call in ("lookup", "restore", "save"):

            async def one(call: str = call, tokens: torch.Tensor = tokens) -> Any:
                async with Restorer(b, open_store("s3://kv/p", **options), learn=False) as r:
                    return await getattr(r, call)(tokens)

            t0 = time.monotonic()
            try:
                got: Any = anyio.run(one)
                what = "returned"
            except Exception as exc:  # noqa: BLE001 - what came back is the figure
                got, what = exc, f"{type(exc).__name__}"
            seconds = time.monotonic() - t0
            exact = None
            if call == "restore":
                exact = bool(torch.allclose(got.kv.data, ref, atol=1e-5, rtol=0))
                what = f"computed {got.stats.computed_chunks}/{got.stats.n_chunks} (stats.seconds {got.stats.seconds:.2f})"
            out["rows"].append(
                {"tokens": n, "call": call, "seconds": seconds, "outcome": what, "exact": exact}
            )
    return out


def case_garbage(b: HFBackend, tmp: str, object_mb: int = 100) -> dict[str, Any]:
    bad, good = tokens_of(b, 1024, seed=1), tokens_of(b, 1024, seed=2)
    good_kv = KVCache(b.spec, b.prefill_chunk(good, None, 0).data)
    store = BoundedStore(LocalStore(os.path.join(tmp, "kv")), 1 << 34)
    r = Restorer(b, store, learn=False)
    _, refs = r.chunks(bad)

    async def main() -> dict[str, Any]:
        await r.save(good, good_kv)
        for ref in refs[:4]:
            await store.put(ref.key, os.urandom(1 << 20) * object_mb)
        before = rss_mb()
        first = await r.restore(bad, LoadOnly())
        after_garbage = rss_mb()
        for _ in range(3):
            clean = await r.restore(good, LoadOnly())
        await r.close()
        return {
            "object_mb": object_mb,
            "garbage_objects": 4,
            "failed_loads": first.stats.failed_loads,
            "clean_loaded": clean.stats.loaded_chunks,
            "rss_before_mb": before,
            "rss_after_garbage_mb": after_garbage,
            "rss_after_close_mb": rss_mb(),
        }

    res = anyio.run(main)
    res["rss_growth_mb"] = res["rss_after_close_mb"] - res["rss_before_mb"]
    return res


def case_restorers(b: HFBackend, tmp: str, count: int = 300) -> dict[str, Any]:
    tokens = tokens_of(b, 512, seed=3)
    url = os.path.join(tmp, "kv")

    async def main() -> dict[str, Any]:
        async with Restorer(b, open_store(url), learn=False) as w:
            await w.save(tokens, KVCache(b.spec, b.prefill_chunk(tokens, None, 0).data))
        start_threads, start_rss = threading.active_count(), rss_mb()
        peak = start_threads
        for _ in range(count):
            r = Restorer(b, open_store(url), learn=False)
            await r.restore(tokens, LoadOnly())
            peak = max(peak, threading.active_count())
            await r.close()
        await anyio.sleep(0.5)  # lane threads told to stop end on their own
        return {
            "restorers": count,
            "threads_start": start_threads,
            "threads_peak": peak,
            "threads_end": threading.active_count(),
            "rss_start_mb": start_rss,
            "rss_end_mb": rss_mb(),
        }

    res = anyio.run(main)
    res["rss_growth_mb"] = res["rss_end_mb"] - res["rss_start_mb"]
    return res


def case_poisoned(b: HFBackend, tmp: str) -> dict[str, Any]:
    tokens = tokens_of(b, 1024, seed=4)
    store = LocalStore(os.path.join(tmp, "kv"))
    path = Path(tmp) / "learned.json"
    learner = CostLearner(b.spec, b.device, store_name(store), path)

    async def main() -> dict[str, Any]:
        async with Restorer(b, store, learn=False) as w:  # compute samples, and the prompt stored
            await w.save(tokens)  # computed: the learned costs have compute units to predict with
            w.costs.state.link = LinkCost(2e3, 5.0)  # in bounds, absurd
            learner.state = w.costs.state
            learner.save()
        rounds = []
        async with Restorer(b, store, learn=path) as r, Restorer(b, store, learn=False) as ref:
            for _ in range(6):  # each Auto restore interleaved with the two strategies it is held to
                row: dict[str, Any] = {}
                for name, policy in (
                    ("auto", None),
                    ("compute-only", ComputeOnly()),
                    ("load-only", LoadOnly()),
                ):
                    t0 = time.perf_counter()
                    res = await (r if policy is None else ref).restore(tokens, policy)
                    row[name] = time.perf_counter() - t0
                    if policy is None:
                        row["choice"] = res.plan.choice.name
                row["over_best"] = row["auto"] / min(row["compute-only"], row["load-only"])
                rounds.append(row)
        return {
            "tokens": len(tokens),
            "rounds": rounds,
            "fourth_over_best": rounds[3]["over_best"],
            "median_over_best_4_to_6": sorted(x["over_best"] for x in rounds[3:])[1],
        }

    return anyio.run(main)


# -- driver --------------------------------------------------------------------------------------------


def run_case(case: str, tiny: bool) -> dict[str, Any]:
    b = backend(tiny)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVRESTORE_LEARNED_DIR"] = os.path.join(tmp, "learned")  # never the user's cache
        if case == "blackhole":
            return case_blackhole(b)
        if case == "garbage":
            return case_garbage(b, tmp)
        if case == "restorers":
            return case_restorers(b, tmp)
        return case_poisoned(b, tmp)


def report(case: str, res: dict[str, Any]) -> None:
    if case == "blackhole":
        rows = [
            [r["tokens"], r["call"], f"{r['seconds']:.2f}", r["outcome"], r["exact"]] for r in res["rows"]
        ]
        print_table(["tokens", "call", "seconds", "outcome", "exact"], rows, title="black-hole S3")
    elif case == "poisoned":
        rows = [
            [
                i + 1,
                x["choice"],
                f"{x['auto']:.3f}",
                f"{x['compute-only']:.3f}",
                f"{x['load-only']:.3f}",
                f"{x['over_best']:.2f}",
            ]
            for i, x in enumerate(res["rounds"])
        ]
        heads = ["restore", "Auto chose", "Auto s", "compute-only s", "load-only s", "Auto / best"]
        print_table(heads, rows, title="poisoned learned link")
    else:
        print_table(
            ["figure", "value"],
            [[k, f"{v:.1f}" if isinstance(v, float) else v] for k, v in res.items()],
            title=case,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=(*CASES, "all"), default="all")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one case in this process: its result as JSON on stdout's last line
        res = run_case(args.case, args.tiny)
        print(json.dumps(res))
        return 0
    results: dict[str, Any] = {}
    for case in CASES if args.case == "all" else (args.case,):
        cmd = [sys.executable, __file__, "--case", case, "--child"] + (["--tiny"] if args.tiny else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[case] = json.loads(proc.stdout.strip().splitlines()[-1])
        report(case, results[case])
    out = args.out or DEFAULT_OUT.with_name("bounds-tiny.json" if args.tiny else "bounds.json")
    if args.case != "all" and out.exists():  # one case run again: keep the others' figures
        results = {**json.loads(out.read_text()).get("cases", {}), **results}
    write_json(out, {"machine": machine_info(), "code": code_version(), "tiny": args.tiny, "cases": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
