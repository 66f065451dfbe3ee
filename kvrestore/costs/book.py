"""The cost book an engine's connector learns through and plans with (the vLLM connector's scheduler and
worker sides): an engine's prefill steps (fitted by `learned.fit_prefill_steps`), whole loads per store
link (`links.link_from_loads`), and how much slower the engine computes while a load runs beside it
(`loading_factor`). One small JSON file per model and machine, shared by the processes that learn and
plan (`CostBook`). A `Restorer` learns through `learned.CostLearner` instead: its units and loads are
its own, timed by its driver."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvrestore.core.paths import cache_root
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.learned import fit_prefill_steps
from kvrestore.costs.links import LinkCost, link_from_loads
from kvrestore.costs.profile import machine_id

log = logging.getLogger("kvrestore.costs.book")

#: the range a learned `loading_factor` is kept in
LOADING_FACTOR_RANGE = (0.5, 20.0)
#: the fewest new tokens a step that loaded must compute to be a sample of `loading_factor`
LOADING_MIN_TOKENS = 256


def loading_factor(samples: Sequence[Sequence[float]], compute: ChunkCost) -> float | None:
    """How much slower a step's compute runs while a load runs beside it (its reads, checks and page
    copies share the host with vLLM's kernels), from steps that loaded: [n new, past, load seconds, step
    seconds, layers]. A step computes after its loaded layers arrive, so it ends about ``load / layers``
    after its compute would, or a layer's compute after the load. Where the compute ended last (the step
    outlasted its load by more than half its predicted compute) and was a sizeable part of the step (at
    least a quarter of the load and of the whole step), ``(step - load / layers) / compute`` is what the
    compute took against what it takes alone. The median of those; None without one.

    A few tokens computed after a load (fewer than `LOADING_MIN_TOKENS`: a load-all step) tell nothing
    of it: their step is mostly a step's fixed costs, which no per-token model predicts well, and taken
    as a ratio they made every split look two to twenty times dearer than it was."""
    ratios = []
    for n_new, past, load_s, step_s, layers in samples:
        c = compute.seconds(int(n_new), int(past))
        if (
            n_new < LOADING_MIN_TOKENS
            or c <= 0
            or c < 0.25 * max(load_s, step_s)
            or step_s - load_s < 0.5 * c
        ):
            continue
        ratios.append((step_s - load_s / max(layers, 1.0)) / c)
    if not ratios:
        return None
    lo, hi = LOADING_FACTOR_RANGE
    return min(hi, max(lo, statistics.median(ratios)))


class CostBook:
    """What a connector has measured, kept across processes in one small JSON file per model and
    machine: the engine's prefill steps ([n, past, seconds]) and, per store link, whole loads ([bytes,
    seconds]; loads that share the link, as a step's do, are one sample: their bytes over the longest).
    A scheduler and a worker in one process share one book (`CostBook.shared`); in separate
    processes the scheduler re-reads the file when the worker has written it: at once for the first
    sample of a kind, then at most every `WRITE_EVERY_S`, and at `flush` (shutdown, exit)."""

    MAX_PREFILLS = 32
    MAX_SMALL = 8
    MAX_LOADS = 16
    MAX_LOADING = 16
    WRITE_EVERY_S = 5.0

    _shared: dict[str, CostBook] = {}
    _shared_lock = threading.Lock()

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.compute: list[list[float]] = []
        self.links: dict[str, list[list[float]]] = {}
        self.loading: list[list[float]] = []  # steps that loaded: [n new, past, load s, step s, layers]
        self._mtime = 0.0
        self._written_at = 0.0
        self._lock = threading.Lock()
        self._due = False  # learned since the last write
        self.refresh()

    @classmethod
    def shared(cls, fingerprint: str, cost_dir: str | os.PathLike | None = None) -> CostBook:
        root = Path(cost_dir) if cost_dir is not None else cache_root() / "vllm"
        # not by this process's threads: the scheduler's process reads what the worker's learned
        path = root / f"costs-{fingerprint[:16]}-{machine_id(threads=False)}.json"
        with cls._shared_lock:
            book = cls._shared.get(str(path))
            if book is None:
                book = cls._shared[str(path)] = cls(path)
                atexit.register(book.flush)  # what a process that is not shut down learned last
            return book

    def refresh(self) -> None:
        """Re-read the file if another process wrote it since."""
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._mtime:
                return
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        with self._lock:
            self._mtime = mtime
            self.compute = [list(map(float, s)) for s in data.get("compute", [])]
            self.links = {k: [list(map(float, s)) for s in v] for k, v in data.get("links", {}).items()}
            self.loading = [list(map(float, s)) for s in data.get("loading", [])]

    def add_compute(self, n_tokens: int, past: int, seconds: float) -> None:
        with self._lock:
            small = n_tokens < 16
            same = [s for s in self.compute if (s[0] < 16) == small]
            if len(same) >= (self.MAX_SMALL if small else self.MAX_PREFILLS):
                self.compute.remove(same[0])
            first = not small and not any(s[0] >= 16 for s in self.compute)
            self.compute.append([float(n_tokens), float(past), float(seconds)])
        self._learned(first)

    def add_load(self, link_key: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            rows = self.links.setdefault(link_key, [])
            first = not rows
            rows.append([float(nbytes), float(seconds)])
            del rows[: -self.MAX_LOADS]
        self._learned(first)

    def add_loading_step(self, n_new: int, past: int, load_s: float, step_s: float, num_layers: int) -> None:
        """A step that computed `n_new` tokens after a `past` it loaded in `load_s`, taking `step_s`."""
        with self._lock:
            first = not self.loading
            self.loading.append([float(n_new), float(past), float(load_s), float(step_s), float(num_layers)])
            del self.loading[: -self.MAX_LOADING]
        self._learned(first)

    def loading_factor(self) -> float | None:
        """How much slower vLLM computes beside a load than the compute model says (`loading_factor`)."""
        compute = self.compute_cost()
        with self._lock:
            samples = list(self.loading)
        return None if compute is None else loading_factor(samples, compute)

    def compute_cost(self) -> ChunkCost | None:
        with self._lock:
            return fit_prefill_steps(self.compute)

    def link(self, link_key: str) -> LinkCost | None:
        with self._lock:
            return link_from_loads(self.links.get(link_key, []))

    def _learned(self, first: bool) -> None:
        """Note a new sample: written at once if it is the first of its kind (another process's planner
        has nothing to go on without it), else at most every `WRITE_EVERY_S` (each write is a file
        replaced on the step's thread) and at `flush`."""
        with self._lock:
            self._due = True
            due = first or time.monotonic() - self._written_at > self.WRITE_EVERY_S
        if due:
            self.flush()

    def flush(self) -> None:
        """Write what was learned since the last write, now (at shutdown, or for another process)."""
        if self.path is None:
            return
        with self._lock:
            if not self._due:
                return
            self._due = False
            data = json.dumps({"compute": self.compute, "links": self.links, "loading": self.loading})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)
            self._mtime = self.path.stat().st_mtime
            self._written_at = time.monotonic()
        except OSError as exc:  # learning is best effort
            log.debug("could not persist learned costs to %s: %s", self.path, exc)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)
