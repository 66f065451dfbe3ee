"""The one cost book (`CostLearner`): costs learned from the work itself, by a `Restorer` without a
profile (its planner and simulator predict with them) and by an engine's connector (vLLM's).

`kvrestore profile` measures a machine once (about 50 s per machine, model, dtype and store). A
restorer without one learns the same model from what it does anyway: every compute unit of every save
and restore (n tokens prefilled after p tokens of past KV, or one decoder layer over N tokens), every
load (`links.LinkEstimate` follows the link), and how each strategy's restores compared with the
predictions (`calibration.Calibration`). Until it has seen a compute unit and a load, `Auto` explores
with a policy that adapts by itself and learns from its trace; `CostLearner.profile()` then fits the
samples into a `Profile`, the same cost model a measured profile is. An engine learns from its own
steps: its prefill steps (`fit_prefill_steps`), whole loads per store link (`links.link_from_loads`),
and how much slower it computes while a load runs beside it (`loading_factor`).

What was learned is one `LearnedState` in one small JSON file, replaced atomically and ignored if
anything in it is out of bounds (`costs.bounds`): a restorer's per machine, model, dtype, device and
store (`learned_path`), so the next restorer starts where this one stopped; an engine's per model and
machine (`CostLearner.shared`), shared by the processes that learn and plan with it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import math
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import msgspec
import torch

from kvrestore.core.paths import cache_root
from kvrestore.core.settings import check_bool_or_path, check_path
from kvrestore.core.spec import ModelSpec, dtype_name
from kvrestore.costs.bounds import (
    BYTES,
    PAIRS,
    TOKENS,
    UNIT_SECONDS,
    calibration_problem,
    counts_problem,
    first_problem,
    link_problem,
    samples_problem,
)
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.fit import fit_nonnegative
from kvrestore.costs.links import LinkCost, link_from_loads
from kvrestore.costs.profile import Profile, machine_id, profile_dir, profile_key

log = logging.getLogger("kvrestore.costs.learned")

LEARNED_VERSION = 1
#: the device of an engine's book
ENGINE = "engine"
#: a cached fit that a new sample has made stale
_STALE = object()
#: the most recent samples of each kind kept (older ones age out, so the model follows the machine)
MAX_SAMPLES = 256
#: the range a learned `loading_factor` is kept in
LOADING_FACTOR_RANGE = (0.5, 20.0)
#: the fewest new tokens a step that loaded must compute to be a sample of `loading_factor`
LOADING_MIN_TOKENS = 256
#: how long past its load (as a share of its predicted compute) a step must end for its compute to
#: have ended it: a step whose load ends last ends a layer's compute and the step's fixed costs after
#: the load, a few hundredths of its compute
LOADING_LAST_BY = 0.2


class LearnedState(msgspec.Struct):
    """What a `CostLearner` has seen: its samples, links and calibration (the persisted form)."""

    machine: str
    fingerprint: str
    dtype: str
    device: str
    store: str
    #: [n tokens, past tokens, seconds] of a restorer's token-wise compute units
    chunk: list[list[float]] = msgspec.field(default_factory=list)
    #: [N tokens, seconds per layer] of a restorer's layer-wise compute units
    layer: list[list[float]] = msgspec.field(default_factory=list)
    link: LinkCost | None = None
    loads: int = 0  # restores (or saves) whose loads moved the link estimate
    restores: int = 0
    #: the calibration's log(measured / predicted) per strategy, and its observation counts
    calibration: dict[str, float] = msgspec.field(default_factory=dict)
    calibrated: dict[str, int] = msgspec.field(default_factory=dict)
    #: an engine's steps of one request, decode steps included: [n new tokens, past, seconds]
    steps: list[list[float]] = msgspec.field(default_factory=list)
    #: an engine's steps of several requests (`observe_pass`): [n new tokens, attention pairs, seconds]
    passes: list[list[float]] = msgspec.field(default_factory=list)
    #: an engine's whole loads per store link: [bytes, seconds] (a step's loads share the link: one
    #: sample, their bytes over the longest)
    links: dict[str, list[list[float]]] = msgspec.field(default_factory=dict)
    #: an engine's steps that loaded: [n new, past, load seconds, step seconds, layers]
    loading: list[list[float]] = msgspec.field(default_factory=list)
    version: int = LEARNED_VERSION


def store_name(store: object) -> str:
    """A store's identity for the learned link: its repr (the wrapper chain and URL), without object
    addresses."""
    return re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", repr(store))


def learned_dir() -> Path:
    """$KVRESTORE_LEARNED_DIR, else `learned/` beside the profiles in the cache directory."""
    env = os.environ.get("KVRESTORE_LEARNED_DIR")
    return Path(check_path("KVRESTORE_LEARNED_DIR", env)) if env else profile_dir() / "learned"


def learned_path(spec: ModelSpec, device: torch.device | str, store: str) -> Path:
    """Where what was learned for this machine, model, dtype, device and store is kept."""
    key = profile_key(machine_id(), spec.fingerprint, dtype_name(spec.dtype), torch.device(device).type)
    digest = hashlib.blake2b(store.encode(), digest_size=6).hexdigest()
    return learned_dir() / f"{key}-{digest}.json"


class CostLearner:
    """The cost book (see the module docstring) of a restorer on `device` over `store`, or of an engine
    (`ENGINE`), kept at `path` (None: in memory only), which it starts from if it is there and of this
    machine, model, dtype, device and store.

    A restorer's planner writes the file after each restore (`save`). An engine's samples are written
    behind them: at once for the first of a kind (another process's planner has nothing to go on
    without it), else at most every `WRITE_EVERY_S` (each write is a file replaced on the step's
    thread), and at `flush` (shutdown, exit). A connector's scheduler and worker in one process share
    one book (`shared`); in separate processes the scheduler re-reads the file when the worker has
    written it (`refresh`)."""

    MAX_PREFILLS = 32
    MAX_SMALL = 8
    MAX_LOADS = 16
    MAX_LOADING = 16
    WRITE_EVERY_S = 5.0

    _shared: dict[str, CostLearner] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self, spec: ModelSpec, device: torch.device | str = ENGINE, store: str = "", path: Path | None = None
    ) -> None:
        self.spec, self.path = spec, path
        kind = str(device).split(":")[0]  # a torch device's type; an engine's book is of the machine
        machine = machine_id(threads=kind != ENGINE)  # whatever its processes' threads (vLLM's differ)
        self.state = LearnedState(machine, spec.fingerprint, dtype_name(spec.dtype), kind, store)
        self._fitted: Profile | None = None  # cached fit, dropped when a sample arrives
        # an engine's fits (`step_cost`, `loading_factor`), asked at every scheduling of a request:
        # made once per sample that changes them, not once per question
        self._step_fit: ChunkCost | None | object = _STALE
        self._loading_fit: float | None | object = _STALE
        self._lock = threading.Lock()
        self._mtime = self._written_at = 0.0
        self._due = False  # an engine learned since the last write
        self.refresh()

    @classmethod
    def shared(cls, spec: ModelSpec, cost_dir: str | os.PathLike | None = None) -> CostLearner:
        """The one engine book of `spec` on this machine in this process, written at exit too."""
        root = Path(cost_dir) if cost_dir is not None else cache_root() / "vllm"
        path = root / f"costs-{spec.fingerprint[:16]}-{machine_id(threads=False)}.json"
        with cls._shared_lock:
            book = cls._shared.get(str(path))
            if book is None:
                book = cls._shared[str(path)] = cls(spec, path=path)
                atexit.register(book.flush)  # what a process that is not shut down learned last
            return book

    # -- a restorer's observations ------------------------------------------------------------------

    def observe_compute(self, n_tokens: int, past: int, seconds: float) -> None:
        """A token-wise compute unit: `n_tokens` prefilled after `past` tokens, in `seconds`."""
        if n_tokens > 0 and seconds > 0 and math.isfinite(seconds):
            _append(self.state.chunk, [float(n_tokens), float(past), float(seconds)])
            self._fitted = None

    def observe_layers(self, n_tokens: int, layers: int, seconds: float) -> None:
        """A layer-wise compute unit: `layers` decoder layers over `n_tokens` tokens, in `seconds`."""
        if n_tokens > 0 and layers > 0 and seconds > 0 and math.isfinite(seconds):
            _append(self.state.layer, [float(n_tokens), float(seconds) / layers])
            self._fitted = None

    def observe_link(self, link: LinkCost | None, moved: bool) -> None:
        """The restorer's link estimate after a restore (`moved`: its loads changed it)."""
        if link is not None:
            self.state.link = link
        self.state.loads += int(moved)

    def observe_restore(self) -> None:
        self.state.restores += 1

    # -- an engine's observations -------------------------------------------------------------------

    def observe_step(self, n_tokens: int, past: int, seconds: float) -> None:
        """An engine's step: `n_tokens` new tokens computed after `past`, in `seconds`. The latest
        `MAX_PREFILLS` prefills and `MAX_SMALL` decode steps are kept."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            steps = self.state.steps
            small = n_tokens < MIN_PREFILL_TOKENS
            same = [s for s in steps if (s[0] < MIN_PREFILL_TOKENS) == small]
            if len(same) >= (self.MAX_SMALL if small else self.MAX_PREFILLS):
                steps.remove(same[0])
            first = not small and not any(s[0] >= MIN_PREFILL_TOKENS for s in steps)
            steps.append([float(n_tokens), float(past), float(seconds)])
            self._step_fit = self._loading_fit = _STALE
        self._learned(first)

    def observe_pass(self, requests: Sequence[tuple[int, int]], seconds: float) -> None:
        """An engine's step that computed several requests, each (n new tokens, past), in `seconds`: one
        forward pass, so one sample of their tokens and their attention pairs (each request's new tokens
        attend to its own past and, causally, to each other). A step of one request is `observe_step`'s.
        The latest `MAX_PREFILLS` passes that computed a prefill's worth of tokens are kept."""
        if len(requests) == 1:
            self.observe_step(*requests[0], seconds)
            return
        n = sum(t for t, _ in requests)
        if not (seconds > 0 and math.isfinite(seconds)) or n < MIN_PREFILL_TOKENS:
            return
        with self._lock:
            first = not self.state.passes and not any(s[0] >= MIN_PREFILL_TOKENS for s in self.state.steps)
            self.state.passes.append([float(n), float(sum(pairs(t, p) for t, p in requests)), float(seconds)])
            del self.state.passes[: -self.MAX_PREFILLS]
            self._step_fit = self._loading_fit = _STALE
        self._learned(first)

    def observe_load(self, link_key: str, nbytes: int, seconds: float) -> None:
        """An engine's whole load of `nbytes` over the link `link_key`, in `seconds`."""
        if not (nbytes > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            rows = self.state.links.setdefault(link_key, [])
            first = not rows
            rows.append([float(nbytes), float(seconds)])
            del rows[: -self.MAX_LOADS]
        self._learned(first)

    def observe_loading(self, n_new: int, past: int, load_s: float, step_s: float, num_layers: int) -> None:
        """A step that computed `n_new` tokens after a `past` it loaded in `load_s`, taking `step_s`."""
        with self._lock:
            rows = self.state.loading
            first = not rows
            rows.append([float(n_new), float(past), float(load_s), float(step_s), float(num_layers)])
            del rows[: -self.MAX_LOADING]
            self._loading_fit = _STALE
        self._learned(first)

    # -- what was learned ---------------------------------------------------------------------------

    @property
    def compute_samples(self) -> int:
        return len(self.state.chunk) + len(self.state.layer)

    @property
    def ready(self) -> bool:
        """Whether there is enough to predict with: some compute unit seen, and a link estimate."""
        return self.compute_samples > 0 and self.state.link is not None

    def profile(self) -> Profile | None:
        """The learned cost model as a `Profile` (None until a compute unit has been seen)."""
        if self.compute_samples == 0:
            return None
        if self._fitted is None:
            s = self.state
            n_layers = self.spec.num_layers
            chunk = fit_prefill_cost(s.chunk) if s.chunk else None
            layer = _fit_layer(s.layer, chunk, n_layers) if s.layer else None
            if chunk is None:  # only layer-wise units seen: a whole prefill is every layer's
                assert layer is not None
                chunk = ChunkCost(
                    layer.fixed_s * n_layers,
                    layer.per_token_s * n_layers,
                    2 * layer.per_token2_s * n_layers,
                    layer.per_token2_s * n_layers,
                )
            if layer is None:  # only token-wise units: one layer is a prefill's share
                layer = LayerCost(
                    chunk.fixed_s / n_layers, chunk.per_token_s / n_layers, chunk.per_token2_s / n_layers
                )
            self._fitted = Profile(
                s.machine,
                self.spec.name,
                s.fingerprint,
                s.dtype,
                s.device,
                chunk,
                layer,
                s.link,
                s.store,
                created="learned",
            )
        if self._fitted.link != self.state.link:
            self._fitted = msgspec.structs.replace(self._fitted, link=self.state.link)
        return self._fitted

    def describe(self) -> str:
        """One line: what was learned, from how many observations."""
        s = self.state
        link = (
            f"link {s.link.bytes_per_s / 1e6:.1f} MB/s + {s.link.latency_s * 1e3:.2f} ms"
            if s.link is not None
            else "no load seen yet"
        )
        return (
            f"learned from the work itself (no profile): {len(s.chunk)} token-wise and {len(s.layer)} "
            f"layer-wise compute units, loads of {s.loads} restores ({link}), over {s.restores} restores"
        )

    def step_cost(self) -> ChunkCost | None:
        """An engine's prefill cost, fitted from its steps and passes (`fit_prefill_steps`)."""
        with self._lock:
            return self._step_cost()

    def _step_cost(self) -> ChunkCost | None:
        if self._step_fit is _STALE:
            self._step_fit = fit_prefill_steps(self.state.steps, self.state.passes)
        return cast("ChunkCost | None", self._step_fit)

    def link_cost(self, link_key: str) -> LinkCost | None:
        """The link `link_key` as an engine's whole loads over it saw it (`links.link_from_loads`)."""
        with self._lock:
            return link_from_loads(self.state.links.get(link_key, []))

    def loading_factor(self) -> float | None:
        """How much slower the engine computes beside a load than `step_cost` says (`loading_factor`)."""
        with self._lock:
            if self._loading_fit is _STALE:
                compute = self._step_cost()
                self._loading_fit = None if compute is None else loading_factor(self.state.loading, compute)
            return cast("float | None", self._loading_fit)

    # -- persisting ---------------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Start from the file if another process (or restorer) wrote it since it was last read, and it
        is of this machine, model and store; whether it was. A damaged file, or one with anything out of
        bounds (a file is a hint: `state_problem`), is logged and ignored: learning starts again."""
        if self.path is None:
            return False
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._mtime:
                return False
            self._mtime = mtime  # not read again (nor logged again) until it is rewritten
            state = msgspec.json.decode(self.path.read_bytes(), type=LearnedState)
        except FileNotFoundError:
            return False
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring learned costs at %s: %s", self.path, exc)
            return False
        if _identity(state) != _identity(self.state):
            log.info("learned costs at %s are of another machine, model or store: not used", self.path)
            return False
        problem = state_problem(state)
        if problem is not None:
            log.warning("ignoring learned costs at %s: %s", self.path, problem)
            return False
        with self._lock:
            self.state = state
            self._fitted = None
            self._step_fit = self._loading_fit = _STALE
        return True

    def save(self) -> None:
        """Write what was learned to the file now, replacing it atomically (a reader, in any process,
        never sees half of one). Raises OSError."""
        if self.path is None:
            return
        with self._lock:
            self._due = False
            data = msgspec.json.encode(self.state)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._mtime = self.path.stat().st_mtime
        self._written_at = time.monotonic()

    def flush(self) -> None:
        """Write what an engine learned since the last write, now (at shutdown, or for another
        process). Learning is best effort: a failure to write is logged."""
        if not self._due:
            return
        try:
            self.save()
        except OSError as exc:
            log.debug("could not persist learned costs to %s: %s", self.path, exc)

    def _learned(self, first: bool) -> None:
        """Note an engine's new sample: written at once if it is the first of its kind, else at most
        every `WRITE_EVERY_S`, and at `flush`."""
        with self._lock:
            self._due = True
            due = first or time.monotonic() - self._written_at > self.WRITE_EVERY_S
        if due:
            self.flush()


def state_problem(state: LearnedState) -> str | None:
    """What is out of bounds in learned costs read from a file (`costs.bounds`), or None."""
    rows = [state.chunk, state.layer, state.steps, state.passes, state.loading, *state.links.values()]
    return first_problem(
        samples_problem("token-wise", state.chunk, (TOKENS, TOKENS, UNIT_SECONDS)),
        samples_problem("layer-wise", state.layer, (TOKENS, UNIT_SECONDS)),
        samples_problem("step", state.steps, (TOKENS, TOKENS, UNIT_SECONDS)),
        samples_problem("pass", state.passes, (TOKENS, PAIRS, UNIT_SECONDS)),
        samples_problem("loading step", state.loading, (TOKENS, TOKENS, UNIT_SECONDS, UNIT_SECONDS, TOKENS)),
        *(samples_problem(f"load over {k}", v, (BYTES, UNIT_SECONDS)) for k, v in state.links.items()),
        None if all(len(r) <= MAX_SAMPLES for r in rows) else "too many samples",
        link_problem(state.link),
        counts_problem("restore", [state.loads, state.restores, *state.calibrated.values()]),
        calibration_problem(state.calibration),
    )


def _identity(s: LearnedState) -> tuple[object, ...]:
    return (s.version, s.machine, s.fingerprint, s.dtype, s.device, s.store)


def _append(samples: list[list[float]], sample: list[float]) -> None:
    samples.append(sample)
    del samples[:-MAX_SAMPLES]


def _distinct(points: Sequence[Sequence[float]]) -> int:
    return len({tuple(round(x) for x in p) for p in points})


def _fit_terms(rows: Sequence[Sequence[float]], targets: Sequence[float], shapes: int) -> list[float]:
    """Non-negative fit of [fixed, linear, quadratic] terms, keeping as many as there are distinct unit
    shapes (one shape: linear alone; two: no fixed term), since fewer shapes cannot tell them apart."""
    columns = {1: [1], 2: [1, 2]}.get(shapes, [0, 1, 2])
    coef = fit_nonnegative([[r[c] for c in columns] for r in rows], targets)
    full = [0.0, 0.0, 0.0]
    for c, v in zip(columns, coef, strict=True):
        full[c] = v
    return full


def pairs(n: float, past: float) -> float:
    """Attention pairs of `n` new tokens after `past`: each attends to the past and, causally, to the
    new tokens before it (n^2 / 2)."""
    return n * (past + n / 2)


def fit_prefill_cost(samples: Sequence[Sequence[float]]) -> ChunkCost:
    """``fixed + n per_token + n (p + n/2) per_pair``: attention over the past and over the unit's own
    tokens (causal: n^2 / 2 pairs) cost alike per pair, so one term covers both and a few samples pin
    it."""
    return _fit_pairs([(n, pairs(n, p), s) for n, p, s in samples])


def _fit_pairs(samples: Sequence[Sequence[float]]) -> ChunkCost:
    """`fit_prefill_cost` over [n, attention pairs, seconds]."""
    rows = [[1.0, n, a] for n, a, _ in samples]
    shapes = _distinct([(n, a) for n, a, _ in samples])
    fixed, per_token, per_pair = _fit_terms(rows, [s for _, _, s in samples], shapes)
    return ChunkCost.per_pair(fixed, per_token, per_pair)


#: a step of fewer new tokens than this is a decode step (or a tiny prefill): it says little about prefill
MIN_PREFILL_TOKENS = 16


def fit_prefill_steps(
    samples: Sequence[Sequence[float]], passes: Sequence[Sequence[float]] = ()
) -> ChunkCost | None:
    """A serving engine's prefill cost from its steps of one request, [n new tokens, past, seconds],
    and of several, [n new tokens, attention pairs, seconds]; None without a prefill (n >=
    `MIN_PREFILL_TOKENS`) to learn from. With fewer than three distinct prefills the attention term is
    not separable: a per-token cost (plus the decode steps' fixed cost) only."""
    rows = [(n, pairs(n, p), s) for n, p, s in samples if s > 0] + [(n, a, s) for n, a, s in passes if s > 0]
    prefills = [r for r in rows if r[0] >= MIN_PREFILL_TOKENS]
    if not prefills:
        return None
    if _distinct([(n, a) for n, a, _ in prefills]) < 3:
        small = any(n < MIN_PREFILL_TOKENS for n, _, _ in rows)
        fixed = min((s for _, _, s in rows), default=0.0) if small else 0.0
        per = max(0.0, sum(s - fixed for _, _, s in prefills) / sum(n for n, _, _ in prefills))
        return ChunkCost.per_pair(fixed, per, 0.0)
    return _fit_pairs(rows)


def loading_factor(samples: Sequence[Sequence[float]], compute: ChunkCost) -> float | None:
    """How much slower a step's compute runs while a load runs beside it (its reads, checks and page
    copies share the host with vLLM's kernels), from steps that loaded: [n new, past, load seconds, step
    seconds, layers]. A step computes after its loaded layers arrive, so it ends about ``load / layers``
    after its compute would, or a layer's compute after the load. Where the compute ended last (the step
    outlasted its load by more than `LOADING_LAST_BY` of its predicted compute: the steps of a balanced
    split, whose lanes were planned to end together, are such steps when computing beside the load is
    slower) and was a sizeable part of the step (at least a quarter of the load and of the whole step),
    ``(step - load / layers) / compute`` is what the compute took against what it takes alone. The
    median of those; None without one.

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
            or step_s - load_s < LOADING_LAST_BY * c
        ):
            continue
        ratios.append((step_s - load_s / max(layers, 1.0)) / c)
    if not ratios:
        return None
    lo, hi = LOADING_FACTOR_RANGE
    return min(hi, max(lo, statistics.median(ratios)))


def _fit_layer(
    samples: Sequence[Sequence[float]], chunk: ChunkCost | None = None, n_layers: int = 1
) -> LayerCost:
    """``fixed + N per_token + N^2 per_token2`` per layer. From fewer than three prompt lengths the
    attention term cannot be told from the others (a linear fit of one length would predict a prompt
    eight times as long eight times as dear, where its attention costs sixty-four times as much): it is
    then taken from the token-wise units (`chunk`, if any were fitted), whose attention pairs cost
    alike on either axis, a layer's share of them (1 / `n_layers`), and the rest is fitted per token."""
    rows = [[1.0, n, n * n] for n, _ in samples]
    shapes = _distinct([(n,) for n, _ in samples])
    if shapes >= 3 or chunk is None or chunk.per_token2_s <= 0:
        return LayerCost(*_fit_terms(rows, [s for _, s in samples], shapes))
    per_token2 = chunk.per_token2_s / n_layers
    _, per_token, _ = _fit_terms(rows, [s - n * n * per_token2 for n, s in samples], 1)
    return LayerCost(0.0, per_token, per_token2)


def check_learn(learn: object) -> bool | Path:
    """`Restorer(learn=...)`: True (persist under the cache directory), False (in memory only) or a
    path to persist at."""
    learn = check_bool_or_path("learn", learn)
    return learn if isinstance(learn, bool) else Path(learn)


__all__ = [
    "CostLearner",
    "LearnedState",
    "check_learn",
    "fit_prefill_cost",
    "pairs",
    "fit_prefill_steps",
    "learned_dir",
    "learned_path",
    "loading_factor",
    "store_name",
]
