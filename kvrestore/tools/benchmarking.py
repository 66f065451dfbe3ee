"""Shared helpers for the benchmarks (`benchmarks/*.py`, `kvrestore bench`).

The rules every script follows (ARCHITECTURE.md, "Measuring on these machines"): warm up once, interleave
the compared cases in every round (A B C A B C ... rather than all A then all B), run at least three
rounds, report medians, and state results as ratios taken within one run.

    cases = {"full": run_full, "compute-only": run_compute_only}   # callables returning a Sample
    raw = await interleave(cases, rounds=3)                         # {"full": [Sample, ...], ...}
    med = median([s.seconds for s in raw["full"]])

Scripts in `benchmarks/` import it as `_common` (a re-export); `kvrestore bench` imports it directly.
"""

from __future__ import annotations

import gc
import importlib.metadata
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvrestore.costs.profile import cpu_model

if TYPE_CHECKING:
    import torch

    from kvrestore.backends.hf import HFBackend
    from kvrestore.restorer import Restorer

# -- samples and interleaving ----------------------------------------------------------------------


@dataclass
class Sample:
    """One timed run of one case: wall seconds plus whatever else the case counted (bytes, ...)."""

    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


CaseFn = Callable[[], "Sample | float | Awaitable[Sample | float]"]


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence (NaN for an empty one, so a missing case shows, not crashes)."""
    return float(statistics.median(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1] (with 8 samples, P99 is the largest); NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))])


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is zero or NaN."""
    return a / b if b and b == b else float("nan")


async def _call(fn: CaseFn) -> Sample:
    out = fn()
    if inspect.isawaitable(out):
        out = await out
    if isinstance(out, Sample):
        return out
    return Sample(float(out))


def timed(fn: Callable[[], Any]) -> Callable[[], Awaitable[Sample]]:
    """Wrap a plain (sync or async) callable so its wall time becomes the Sample."""

    async def run() -> Sample:
        t0 = time.perf_counter()
        out = fn()
        if inspect.isawaitable(out):
            await out
        return Sample(time.perf_counter() - t0)

    return run


async def interleave(
    cases: Mapping[str, CaseFn],
    rounds: int,
    *,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
    collect: bool = False,
) -> dict[str, list[Sample]]:
    """Run every case `warmup` times (discarded), then `rounds` rounds of A B C ... in the given order.

    Each case is a callable returning a Sample, a float (seconds), or an awaitable of either. Returns
    the kept samples per case, in round order. `log` (e.g. print) gets one line per run. With
    `collect`, Python's garbage is collected before each run, so no run pays for the objects the runs
    before it left (a full collection in a large process takes tens of milliseconds).
    """
    out: dict[str, list[Sample]] = {name: [] for name in cases}
    for r in range(-warmup, rounds):
        tag = "warm-up" if r < 0 else f"round {r + 1}/{rounds}"
        for name, fn in cases.items():
            if collect:
                gc.collect()
            s = await _call(fn)
            if r >= 0:
                out[name].append(s)
            if log is not None:
                log(f"  [{tag}] {name}: {s.seconds:.3f} s")
    return out


def summarize(samples: Sequence[Sample]) -> dict[str, Any]:
    """Raw seconds and their median (plus min/max) for the JSON output."""
    secs = [s.seconds for s in samples]
    return {
        "seconds": secs,
        "median_s": median(secs),
        "min_s": min(secs) if secs else float("nan"),
        "max_s": max(secs) if secs else float("nan"),
        "extra": [s.extra for s in samples],
    }


# -- machine info ----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Where the numbers came from: platform, Python, torch and its threads, CPUs, load, GPU if any."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": cpu_model(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_at_start"] = list(os.getloadavg())
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["torch_interop_threads"] = torch.get_num_interop_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for dist in ("transformers", "zstandard", "anyio", "fsspec", "numpy"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    return info


# -- output ----------------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None  # NaN is not JSON
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` (dataclasses, Paths and NaN handled) as indented JSON, creating parent folders."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2) + "\n")
    os.replace(tmp, p)
    return p


def run_to_json(run: Callable[[Any], Awaitable[Any]], args: Any, out: str | os.PathLike) -> int:
    """A benchmark script's last step: `run(args)` on an event loop, its result written to `out` as
    JSON (`write_json`), where it went said on stderr; returns the exit status (0)."""
    import anyio

    write_json(out, anyio.run(run, args))
    print(f"wrote {out}", file=sys.stderr, flush=True)
    return 0


def fmt(x: Any, digits: int = 3) -> str:
    """A table cell: floats to `digits` significant-ish decimals, None/NaN as '-'."""
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, bool):
        return "PASS" if x else "FAIL"
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}"
    return str(x)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain aligned text table; numbers right-aligned."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows if r[i] is not None)
        for i in range(len(headers))
    ]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if numeric[i] else v.ljust(w)
            for i, (v, w) in enumerate(zip(vals, widths, strict=True))
        )

    out = []
    if title:
        out.append(title)
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Print (and return) `format_table`."""
    text = format_table(headers, rows, title)
    print(text, flush=True)
    return text


__all__ = [
    "CaseFn",
    "Sample",
    "fmt",
    "format_table",
    "interleave",
    "machine_info",
    "median",
    "percentile",
    "print_table",
    "ratio",
    "run_to_json",
    "summarize",
    "timed",
    "write_json",
]


async def next_token_logits(
    restorer: Restorer, backend: HFBackend, tokens: torch.Tensor, past: torch.Tensor | None, start: int
) -> torch.Tensor:
    """The logits after `tokens` at [start, ...) on top of `past`, computed on the restorer's compute lane
    (the first token of an answer: what a time to first token ends with)."""

    def run() -> torch.Tensor:
        _, logits = backend.forward(tokens, past, start, logits=True)
        assert logits is not None  # asked for
        return logits

    return cast("torch.Tensor", await restorer.engine.compute(run))
