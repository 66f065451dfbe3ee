"""Costs learned from the work itself: the cost model of a `Restorer` that has no profile.

`kvrestore profile` measures a machine once (about 50 s per machine, model, dtype and store). A
restorer without one learns the same model from what it does anyway:

* every compute unit of every save and restore: n tokens prefilled after p tokens of past KV, in
  seconds (token-wise units), or one decoder layer over N tokens (layer-wise units);
* every load (the link: `links.LinkEstimate` follows the delivery rate and estimates the per-request
  latency);
* how each strategy's restores compared with the predictions (`calibration.Calibration`).

Until it has seen both a compute unit and a load, `Auto` explores with a policy that adapts by itself
(the layer-wise two-pointer for a short stored prefix, the token-wise one for a long one) and learns
from its trace. `CostLearner.profile()` then fits the samples into a `Profile`, the same cost model a
measured profile is, so the planner predicts with one or the other alike.

What was learned is kept per machine, model, dtype, device and store: `save`/`load` a small JSON file
under the cache directory (`learned_path`), so the next restorer of the same process or machine starts
where this one stopped.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.spec import ModelSpec, dtype_name
from kvrestore.costs.bounds import (
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
from kvrestore.costs.links import LinkCost
from kvrestore.costs.profile import Profile, machine_id, profile_dir, profile_key

log = logging.getLogger("kvrestore.costs.learned")

LEARNED_VERSION = 1
#: the most recent samples of each kind kept (older ones age out, so the model follows the machine)
MAX_SAMPLES = 256


class LearnedState(msgspec.Struct):
    """What a `CostLearner` has seen: its samples, link and calibration (the persisted form)."""

    machine: str
    fingerprint: str
    dtype: str
    device: str
    store: str
    #: [n tokens, past tokens, seconds] of token-wise compute units
    chunk: list[list[float]] = msgspec.field(default_factory=list)
    #: [N tokens, seconds per layer] of layer-wise compute units
    layer: list[list[float]] = msgspec.field(default_factory=list)
    link: LinkCost | None = None
    loads: int = 0  # restores (or saves) whose loads moved the link estimate
    restores: int = 0
    #: the calibration's log(measured / predicted) per strategy, and its observation counts
    calibration: dict[str, float] = msgspec.field(default_factory=dict)
    calibrated: dict[str, int] = msgspec.field(default_factory=dict)
    version: int = LEARNED_VERSION


def store_name(store: object) -> str:
    """A store's identity for the learned link: its repr (the wrapper chain and URL), without object
    addresses."""
    return re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", repr(store))


def learned_dir() -> Path:
    """$KVRESTORE_LEARNED_DIR, else `learned/` beside the profiles in the cache directory."""
    env = os.environ.get("KVRESTORE_LEARNED_DIR")
    return Path(env) if env else profile_dir() / "learned"


def learned_path(spec: ModelSpec, device: torch.device | str, store: str) -> Path:
    """Where what was learned for this machine, model, dtype, device and store is kept."""
    key = profile_key(machine_id(), spec.fingerprint, dtype_name(spec.dtype), torch.device(device).type)
    digest = hashlib.blake2b(store.encode(), digest_size=6).hexdigest()
    return learned_dir() / f"{key}-{digest}.json"


class CostLearner:
    """Learns compute and link costs from the restorer's own work (see the module docstring)."""

    def __init__(self, spec: ModelSpec, device: torch.device | str, store: str) -> None:
        self.spec = spec
        self.state = LearnedState(
            machine_id(), spec.fingerprint, dtype_name(spec.dtype), torch.device(device).type, store
        )
        self._fitted: Profile | None = None  # cached fit, dropped when a sample arrives

    # -- observing ----------------------------------------------------------------------------------

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
            chunk = fit_prefill_cost(s.chunk) if s.chunk else None
            layer = _fit_layer(s.layer) if s.layer else None
            n_layers = self.spec.num_layers
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
                    chunk.fixed_s / n_layers,
                    chunk.per_token_s / n_layers,
                    chunk.per_token2_s / n_layers,
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

    # -- persisting ---------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        tmp.write_bytes(msgspec.json.encode(self.state))
        tmp.replace(target)
        return target

    def load(self, path: str | os.PathLike) -> bool:
        """Start from what was saved at `path` (if it is there and of this machine, model and store);
        whether it was. A damaged file is logged and ignored: learning starts again."""
        path = Path(path)
        try:
            state = msgspec.json.decode(path.read_bytes(), type=LearnedState)
        except FileNotFoundError:
            return False
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring learned costs at %s: %s", path, exc)
            return False
        mine = self.state
        same = (state.version, state.machine, state.fingerprint, state.dtype, state.device, state.store) == (
            LEARNED_VERSION,
            mine.machine,
            mine.fingerprint,
            mine.dtype,
            mine.device,
            mine.store,
        )
        if not same:
            log.info("learned costs at %s are of another machine, model or store: not used", path)
            return False
        problem = state_problem(state)
        if problem is not None:  # a file is a hint: one out of bounds is ignored, never used
            log.warning("ignoring learned costs at %s: %s", path, problem)
            return False
        self.state = state
        self._fitted = None
        return True


def state_problem(state: LearnedState) -> str | None:
    """What is out of bounds in learned costs read from a file (`costs.bounds`), or None."""
    return first_problem(
        samples_problem("token-wise", state.chunk, (TOKENS, TOKENS, UNIT_SECONDS)),
        samples_problem("layer-wise", state.layer, (TOKENS, UNIT_SECONDS)),
        None if len(state.chunk) <= MAX_SAMPLES and len(state.layer) <= MAX_SAMPLES else "too many samples",
        link_problem(state.link),
        counts_problem("restore", [state.loads, state.restores, *state.calibrated.values()]),
        calibration_problem(state.calibration),
    )


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


def fit_prefill_cost(samples: Sequence[Sequence[float]]) -> ChunkCost:
    """``fixed + n per_token + n (p + n/2) per_pair``: attention over the past and over the unit's own
    tokens (causal: n^2 / 2 pairs) cost alike per pair, so one term covers both and a few samples pin
    it."""
    rows = [[1.0, n, n * (p + n / 2)] for n, p, _ in samples]
    shapes = _distinct([(n, p) for n, p, _ in samples])
    fixed, per_token, per_pair = _fit_terms(rows, [s for _, _, s in samples], shapes)
    return ChunkCost.per_pair(fixed, per_token, per_pair)


#: a step of fewer new tokens than this is a decode step (or a tiny prefill): it says little about prefill
MIN_PREFILL_TOKENS = 16


def fit_prefill_steps(samples: Sequence[Sequence[float]]) -> ChunkCost | None:
    """A serving engine's prefill cost from its steps, [n new tokens, past, seconds]; None without a
    prefill (n >= `MIN_PREFILL_TOKENS`) to learn from. With fewer than three distinct prefills the
    attention term is not separable: a per-token cost (plus the decode steps' fixed cost) only."""
    prefills = [s for s in samples if s[0] >= MIN_PREFILL_TOKENS]
    if not prefills:
        return None
    rows = [list(s) for s in samples if s[2] > 0]
    if len({(int(n), int(p)) for n, p, _ in prefills}) < 3:
        small = any(n < MIN_PREFILL_TOKENS for n, _, _ in rows)
        fixed = min((s for _, _, s in rows), default=0.0) if small else 0.0
        per = max(0.0, sum(s - fixed for _, _, s in prefills) / sum(n for n, _, _ in prefills))
        return ChunkCost.per_pair(fixed, per, 0.0)
    return fit_prefill_cost(rows)


def _fit_layer(samples: Sequence[Sequence[float]]) -> LayerCost:
    """``fixed + N per_token + N^2 per_token2`` per layer."""
    rows = [[1.0, n, n * n] for n, _ in samples]
    return LayerCost(*_fit_terms(rows, [s for _, s in samples], _distinct([(n,) for n, _ in samples])))


def check_learn(learn: object) -> bool | Path:
    """`Restorer(learn=...)`: True (persist under the cache directory), False (in memory only) or a
    path to persist at."""
    if isinstance(learn, bool):
        return learn
    if isinstance(learn, (str, os.PathLike)):
        return Path(learn)
    raise InvalidInputError(f"learn must be True, False or a path, got {learn!r}")


__all__ = [
    "CostLearner",
    "LearnedState",
    "check_learn",
    "fit_prefill_cost",
    "learned_dir",
    "learned_path",
    "store_name",
]
