"""`kvrestore bench`: the token-wise two-pointer against compute-only and load-only, across bandwidths.

A prompt of SmolLM2 (4096 tokens of the Python reference by default) is saved to a local directory
store and read back through a `ThrottledStore` at 0.25x .. 4x the balance point: the bandwidth at which
loading the whole prompt takes as long as computing it, measured first on this machine. At each
bandwidth, in interleaved rounds: the time to first token (restore + the question's prefill) of
compute-only, load-only and the two-pointer, the chunks each computed and loaded, and the oracle bound
(the best split for that round's measured per-chunk compute times and the link's delivery). Then a
fluctuation run (bandwidth and compute share both changing, Cake §5.7), plotted like Cake's Figure 5.
Every restore's first token is checked against a full prefill.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch

from kvrestore.core.bandwidth import BandwidthTrace, oracle_split, trace_suffix_times
from kvrestore.core.kv import KVCache
from kvrestore.core.trace import Trace
from kvrestore.policies import ComputeOnly, LoadOnly, Policy, TokenTwoPointer
from kvrestore.restorer import Restorer
from kvrestore.stores import FsspecStore, ThrottledStore
from kvrestore.tools.benchmarking import format_table, machine_info, next_token_logits, ratio, write_json

QUESTION = "\n\nQuestion: what does the with statement guarantee?\nAnswer:"


@dataclass
class BenchConfig:
    n_tokens: int = 4096
    multipliers: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    rounds: int = 3
    chunk_size: int = 256
    compute_chunks: int = 2
    load_lanes: int = 4
    fluctuation: bool = True
    fluctuation_step_s: float = 0.5
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None


@dataclass
class Run:
    """One timed restore: TTFT, restore time, what it did, and its trace."""

    policy: str
    ttft_s: float
    restore_s: float
    computed: int
    loaded: int
    dropped: int
    first_token_ok: bool
    trace: Trace = field(repr=False)


class SharedCompute:
    """A backend whose compute lane gets only a share of the device over time (Cake §5.7's compute
    budget): a unit that needs w seconds of the whole device ends once the share, integrated from its
    start, reaches w; the lane idles meanwhile, as if other work held the rest."""

    def __init__(self, inner: Any, share: BandwidthTrace) -> None:
        self._inner = inner
        self._share = share
        self.t0 = time.perf_counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _shared(self, compute: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = compute()
        work = time.perf_counter() - t
        done = self.t0 + self._share.finish_time(t - self.t0, work)
        time.sleep(max(0.0, done - time.perf_counter()))
        return out

    def prefill_chunk(self, tokens: torch.Tensor, past: Any, start: int) -> Any:
        return self._shared(lambda: self._inner.prefill_chunk(tokens, past, start))

    def prefill_into(self, tokens: torch.Tensor, cache: torch.Tensor, start: int, **kwargs: Any) -> Any:
        return self._shared(lambda: self._inner.prefill_into(tokens, cache, start, **kwargs))


class Bench:
    def __init__(self, config: BenchConfig, log: Callable[[str], None] = print) -> None:
        self.config = config
        self.log = log

    async def run(self) -> dict[str, Any]:
        from kvrestore.backends.hf import HFBackend
        from kvrestore.tools.text import reference_tokens

        cfg = self.config
        self.log("loading the bundled SmolLM2-135M (float32)")
        self.backend = await anyio.to_thread.run_sync(partial(HFBackend.from_smollm2, dtype=torch.float32))
        tok = self.backend.tokenizer
        assert tok is not None  # from_smollm2 loads the model's own tokenizer
        self.prefix = reference_tokens(tok, cfg.n_tokens)
        self.suffix = torch.tensor(tok(QUESTION, add_special_tokens=False)["input_ids"])
        with tempfile.TemporaryDirectory(prefix="kvrestore-bench-") as tmp:
            self.inner = FsspecStore(Path(tmp).as_uri())
            plain = Restorer(self.backend, self.inner, cfg.chunk_size, load_lanes=cfg.load_lanes)
            _, refs = plain.chunks(self.prefix)
            self.log(f"saving {cfg.n_tokens} tokens ({len(refs)} chunks of {cfg.chunk_size}) to {tmp}")
            saved = await plain.save(self.prefix)
            self.chunk_bytes = [len(await self.inner.get(r.key)) for r in refs]  # type: ignore[arg-type]
            self.out = KVCache.empty(plain.spec, len(self.prefix), device=self.backend.device)
            full = torch.tensor(self.prefix + self.suffix.tolist())
            self.reference = int((await next_token_logits(plain, self.backend, full, None, 0)).argmax())
            result = await self._measure_grid()
            result["saved_bytes"] = saved.bytes_written
            if cfg.fluctuation:
                result["fluctuation"] = await self._fluctuation()
        result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
        result["machine"] = machine_info()
        if cfg.json_path is not None:
            write_json(cfg.json_path, result)
            self.log(f"wrote {cfg.json_path}")
        return result

    async def _ttft(self, restorer: Restorer, policy: Policy) -> Run:
        store = restorer.store
        if isinstance(store, ThrottledStore):
            store.reset()
        t0 = time.perf_counter()
        result = await restorer.restore(self.prefix, policy, out=self.out)
        restore_s = time.perf_counter() - t0
        past = result.kv.data
        logits = await next_token_logits(restorer, self.backend, self.suffix, past, len(self.prefix))
        ttft = time.perf_counter() - t0
        s = result.stats
        dropped = len(result.trace.of_kind("load-dropped"))
        return Run(
            policy.name,
            ttft,
            restore_s,
            s.computed_chunks,
            s.loaded_chunks,
            dropped,
            int(logits.argmax()) == self.reference,
            result.trace,
        )

    async def _measure_grid(self) -> dict[str, Any]:
        cfg = self.config
        local = Restorer(self.backend, self.inner, cfg.chunk_size, load_lanes=cfg.load_lanes)
        two_pointer = TokenTwoPointer(cfg.compute_chunks)
        # warm-up, then the balance point: the bandwidth at which loading takes as long as computing
        self.log("warm-up and balance point")
        await self._ttft(local, ComputeOnly())
        compute_s = statistics.median([(await self._ttft(local, ComputeOnly())).restore_s for _ in range(2)])
        total = sum(self.chunk_bytes)
        balance = total / compute_s
        self.log(
            f"compute-only restore {compute_s:.2f} s for {total / 1e6:.1f} MB: balance {balance / 1e6:.2f} MB/s"
        )
        self._balance, self._compute_s = balance, compute_s
        links = {m: ThrottledStore(self.inner, balance * m) for m in cfg.multipliers}
        stores = {
            m: Restorer(self.backend, s, cfg.chunk_size, load_lanes=cfg.load_lanes) for m, s in links.items()
        }
        runs: dict[str, list[Run]] = {}
        oracle: dict[float, list[float]] = {m: [] for m in cfg.multipliers}
        suffix_s: list[float] = []
        for r in range(cfg.rounds):
            tag = f"round {r + 1}/{cfg.rounds}"
            full = await self._ttft(local, ComputeOnly())
            chunked = await self._ttft(local, ComputeOnly(unit_chunks=1))
            runs.setdefault("compute-only", []).append(full)
            runs.setdefault("compute-only (chunked)", []).append(chunked)
            suffix_s.append(full.ttft_s - full.restore_s)
            per_chunk = [
                e.seconds for e in sorted(chunked.trace.of_kind("compute"), key=lambda e: e.first_chunk)
            ]
            self.log(f"  [{tag}] compute-only {full.ttft_s:.2f} s, chunked {chunked.ttft_s:.2f} s")
            for m in cfg.multipliers:
                restorer = stores[m]
                lo = await self._ttft(restorer, LoadOnly())
                tp = await self._ttft(restorer, two_pointer)
                runs.setdefault(f"load-only@{m}", []).append(lo)
                runs.setdefault(f"two-pointer@{m}", []).append(tp)
                link = trace_suffix_times(self.chunk_bytes, restorer.store.trace)  # type: ignore[attr-defined]
                oracle[m].append(oracle_split(per_chunk, link)[0] + (full.ttft_s - full.restore_s))
                self.log(
                    f"  [{tag}] {m}x: load-only {lo.ttft_s:.2f} s, two-pointer {tp.ttft_s:.2f} s "
                    f"({tp.computed} computed, {tp.loaded} loaded, {tp.dropped} dropped)"
                )
        return self._summarize(runs, oracle, balance, compute_s)

    def _summarize(
        self, runs: dict[str, list[Run]], oracle: dict[float, list[float]], balance: float, compute_s: float
    ) -> dict[str, Any]:
        cfg = self.config

        def med(name: str, attr: str = "ttft_s") -> float:
            return statistics.median(getattr(r, attr) for r in runs[name])

        co = med("compute-only")
        rows: list[list[Any]] = []
        grid: list[dict[str, Any]] = []
        for m in cfg.multipliers:
            lo, tp, bound = med(f"load-only@{m}"), med(f"two-pointer@{m}"), statistics.median(oracle[m])
            point = {
                "multiplier": m,
                "bytes_per_s": balance * m,
                "compute_only_s": co,
                "compute_only_chunked_s": med("compute-only (chunked)"),
                "load_only_s": lo,
                "two_pointer_s": tp,
                "oracle_s": bound,
                "two_pointer_vs_best_single": ratio(tp, min(co, lo)),
                "two_pointer_vs_oracle": ratio(tp, bound),
                "two_pointer_computed": med(f"two-pointer@{m}", "computed"),
                "two_pointer_loaded": med(f"two-pointer@{m}", "loaded"),
                "two_pointer_dropped": med(f"two-pointer@{m}", "dropped"),
                "samples": {
                    k: [r.ttft_s for r in runs[k]]
                    for k in ("compute-only", "compute-only (chunked)", f"load-only@{m}", f"two-pointer@{m}")
                },
            }
            grid.append(point)
            rows.append(
                [
                    f"{m}x",
                    f"{balance * m / 1e6:.1f}",
                    f"{co:.2f}",
                    f"{lo:.2f}",
                    f"{tp:.2f}",
                    f"{bound:.2f}",
                    f"{point['two_pointer_vs_best_single']:.2f}",
                    f"{point['two_pointer_vs_oracle']:.2f}",
                    f"{point['two_pointer_computed']:.0f}/{point['two_pointer_loaded']:.0f}",
                ]
            )
        self.log(
            format_table(
                ["bw", "MB/s", "compute", "load", "2-ptr", "oracle", "2p/best", "2p/oracle", "comp/load"],
                rows,
                title=f"TTFT (s), median of {cfg.rounds}, {cfg.n_tokens} tokens, chunk {cfg.chunk_size}, "
                f"compute unit {cfg.compute_chunks} chunks, {cfg.load_lanes} load lanes",
            )
        )
        all_ok = all(r.first_token_ok for rs in runs.values() for r in rs)
        at1 = next((p for p in grid if p["multiplier"] == 1.0), None)
        targets = {
            "at_1x_two_pointer_vs_best_single": at1["two_pointer_vs_best_single"] if at1 else math.nan,
            "at_1x_target": 0.60,
            "worst_two_pointer_vs_oracle": max(p["two_pointer_vs_oracle"] for p in grid),
            "oracle_target": 1.15,
            "first_tokens_identical": all_ok,
        }
        self.log(
            f"targets: at 1x two-pointer / best single = {targets['at_1x_two_pointer_vs_best_single']:.2f} "
            f"(<= 0.60); worst two-pointer / oracle = {targets['worst_two_pointer_vs_oracle']:.2f} (<= 1.15); "
            f"first tokens identical to a full prefill: {all_ok}"
        )
        return {
            "balance_bytes_per_s": balance,
            "compute_only_restore_s": compute_s,
            "grid": grid,
            "targets": targets,
        }

    async def _fluctuation(self) -> dict[str, Any]:
        """Cake §5.7: bandwidth uniform in [0, 2x balance] and the compute share uniform in [0.1, 1], both
        redrawn every `fluctuation_step_s`; the same traces for every policy."""
        cfg = self.config
        balance = self._balance
        horizon = 4 * self._compute_s  # longer than any policy takes; the traces then hold their last value
        bandwidth = BandwidthTrace.random(0.0, 2 * balance, cfg.fluctuation_step_s, horizon, seed=cfg.seed)
        shares = BandwidthTrace.random(0.1, 1.0, cfg.fluctuation_step_s, horizon, seed=cfg.seed + 1)
        out: dict[str, Any] = {
            "step_s": cfg.fluctuation_step_s,
            "bandwidth": bandwidth.steps,
            "share": shares.steps,
        }
        self.log(f"fluctuation run (bandwidth and compute share changing every {cfg.fluctuation_step_s} s)")
        for policy in (ComputeOnly(unit_chunks=1), LoadOnly(), TokenTwoPointer(cfg.compute_chunks)):
            shared = SharedCompute(self.backend, shares)
            store = ThrottledStore(self.inner, trace=bandwidth)
            restorer = Restorer(shared, store, cfg.chunk_size, load_lanes=cfg.load_lanes)
            shared.t0 = time.perf_counter()
            run = await self._ttft(restorer, policy)
            out[policy.name] = {
                "ttft_s": run.ttft_s,
                "computed": run.computed,
                "loaded": run.loaded,
                "first_token_ok": run.first_token_ok,
                "events": [asdict(e) for e in run.trace.events],
            }
            self.log(f"  {policy.name}: {run.ttft_s:.2f} s ({run.computed} computed, {run.loaded} loaded)")
            if isinstance(policy, TokenTwoPointer) and cfg.plot_path is not None:
                from kvrestore.tools.plot import plot_trace

                plot_trace(
                    run.trace,
                    cfg.plot_path,
                    bandwidth=bandwidth,
                    compute_share=shares.rate_at,
                    title=f"two-pointer under fluctuating bandwidth and compute ({cfg.n_tokens} tokens)",
                )
                self.log(f"wrote {cfg.plot_path}")
        return out
