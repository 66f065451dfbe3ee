"""The measured cost model of one machine, model and store: what the planner predicts restores with.

`profile(backend, store)` (or `kvrestore profile` on the command line) measures

* the compute time of a prefill of n tokens after p tokens of past KV, at every chunk index of a long
  prompt and for whole prompts of several lengths, fitted to
  ``fixed + n * (per_token + per_token_past * (p + n / 2))`` (attention makes a token's cost grow with
  its position: Cake's "chunk prefill time grows linearly with chunk index");
* the compute time of one decoder layer over N tokens at once, fitted to ``fixed + a N + b N^2``;
* the store's bandwidth and per-request latency, from reads of a few sizes, fitted to
  ``latency + bytes / bandwidth``.

The result is a `Profile`, saved as msgspec JSON under the cache directory, keyed by machine, model
fingerprint, dtype and device, so a `Restorer` on the same machine and model finds it. A profile's
link is a starting point only: `LinkEstimate` moves it toward what the restores' own loads show.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.paths import cache_root
from kvrestore.core.spec import ModelSpec, dtype_name
from kvrestore.core.trace import Trace
from kvrestore.stores.base import ChunkStore

PROFILE_VERSION = 1


class ChunkCost(msgspec.Struct, frozen=True):
    """Seconds to prefill `n` tokens after `past` tokens whose KV is known (one call of the backend):
    ``fixed + n * per_token + n * past * per_token_past + n^2 * per_token2``. The past and the new
    tokens' own attention get separate terms: a whole-prompt prefill runs causal attention far more
    efficiently than a chunk attending to a past does."""

    fixed_s: float
    per_token_s: float
    per_token_past_s: float
    per_token2_s: float = 0.0

    def seconds(self, n_tokens: int, past: int = 0) -> float:
        n = n_tokens
        return (
            self.fixed_s + n * self.per_token_s + n * past * self.per_token_past_s + n * n * self.per_token2_s
        )


class LayerCost(msgspec.Struct, frozen=True):
    """Seconds to run one decoder layer over `n` tokens at once (no past)."""

    fixed_s: float
    per_token_s: float
    per_token2_s: float

    def seconds(self, n_tokens: int) -> float:
        return self.fixed_s + n_tokens * self.per_token_s + n_tokens * n_tokens * self.per_token2_s


class LinkCost(msgspec.Struct, frozen=True):
    """A store read: a round trip of `latency_s`, then the bytes at `bytes_per_s`."""

    bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


class Profile(msgspec.Struct, frozen=True):
    """What restores cost on one machine, for one model and dtype (and, optionally, one store)."""

    machine: str
    model: str
    fingerprint: str
    dtype: str
    device: str
    chunk: ChunkCost
    layer: LayerCost
    link: LinkCost | None = None
    store: str | None = None  # what `link` was measured on
    created: str = ""
    version: int = PROFILE_VERSION
    #: raw measurements: "chunk": [n, past, s], "layer": [n, s per layer], "link": [bytes, s]
    samples: dict[str, list[list[float]]] = {}

    @property
    def key(self) -> str:
        return profile_key(self.machine, self.fingerprint, self.dtype, self.device)

    def matches(self, spec: ModelSpec, device: torch.device | str) -> bool:
        """Whether this profile describes `spec` (model and dtype) on `device`."""
        return (
            self.fingerprint == spec.fingerprint
            and self.dtype == dtype_name(spec.dtype)
            and self.device == torch.device(device).type
        )

    def with_link(self, link: LinkCost | None, store: str | None = None) -> Profile:
        return msgspec.structs.replace(self, link=link, store=store if link is not None else None)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profile (msgspec JSON) to `path`, by default its place in the cache directory."""
        target = Path(path) if path is not None else profile_dir() / f"{self.key}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=1))
        tmp.replace(target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidInputError(f"cannot read profile {path}: {exc}") from None
        try:
            profile = msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise InvalidInputError(f"{path} is not a kvrestore profile: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InvalidInputError(f"{path} is not valid JSON: {exc}") from None
        if profile.version != PROFILE_VERSION:
            raise InvalidInputError(
                f"{path} is a version {profile.version} profile; this kvrestore reads version "
                f"{PROFILE_VERSION}: run `kvrestore profile` again"
            )
        return profile

    @classmethod
    def find(
        cls, spec: ModelSpec, device: torch.device | str, directory: str | os.PathLike | None = None
    ) -> Profile | None:
        """The saved profile of this machine for `spec` on `device`, if `kvrestore profile` made one."""
        key = profile_key(machine_id(), spec.fingerprint, dtype_name(spec.dtype), torch.device(device).type)
        path = Path(directory) if directory is not None else profile_dir()
        path = path / f"{key}.json"
        return cls.load(path) if path.exists() else None

    def summary(self) -> str:
        c, layer = self.chunk, self.layer
        lines = [
            f"profile of {self.model} ({self.dtype}, {self.device}) on machine {self.machine}",
            f"  prefill n tokens after p: {c.fixed_s * 1e3:.2f} ms + {c.per_token_s * 1e6:.1f} us x n"
            f" + {c.per_token_past_s * 1e9:.2f} ns x n p + {c.per_token2_s * 1e9:.2f} ns x n^2",
            f"  one layer over N tokens:  {layer.fixed_s * 1e3:.3f} ms + {layer.per_token_s * 1e6:.2f} us x N"
            f" + {layer.per_token2_s * 1e9:.4f} ns x N^2",
        ]
        if self.link is not None:
            lines.append(
                f"  store {self.store or ''}: {self.link.bytes_per_s / 1e6:.1f} MB/s, "
                f"{self.link.latency_s * 1e3:.2f} ms per request"
            )
        return "\n".join(lines)


# -- where profiles live ---------------------------------------------------------------------------


def machine_id() -> str:
    """A stable name for this machine's compute: host, CPU model and count, GPU, torch threads."""
    parts = [
        platform.node(),
        platform.machine(),
        cpu_model(),
        str(os.cpu_count()),
        str(torch.get_num_threads()),
    ]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def profile_key(machine: str, fingerprint: str, dtype: str, device: str) -> str:
    return f"{machine}-{fingerprint[:16]}-{dtype}-{device}"


def profile_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "profiles"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# -- fitting ----------------------------------------------------------------------------------------


def fit_nonnegative(features: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least squares of the relative error, every coefficient >= 0 (a cost model has no negative
    costs): features whose coefficient comes out negative are dropped and the rest refitted. Relative,
    so that a 128-token prompt is predicted as well as a 4096-token one."""
    y = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
    weight = 1.0 / y.clamp_min(1e-9)
    x = torch.tensor(features, dtype=torch.float64) * weight
    y = y * weight
    active = list(range(x.shape[1]))
    coef = [0.0] * x.shape[1]
    while active:
        # scale columns so that tiny per-token costs and the fixed cost are fitted alike
        cols = x[:, active]
        scale = cols.abs().amax(dim=0).clamp_min(1e-300)
        sol = torch.linalg.lstsq(cols / scale, y).solution.squeeze(1) / scale
        if (sol >= 0).all():
            for i, c in zip(active, sol.tolist(), strict=True):
                coef[i] = c
            return coef
        active = [i for i, c in zip(active, sol.tolist(), strict=True) if c >= 0]
    return coef


def fit_chunk_cost(samples: Sequence[Sequence[float]]) -> ChunkCost:
    """Fit [n, past, seconds] samples to `ChunkCost`."""
    feats = [[1.0, n, n * p, n * n] for n, p, _ in samples]
    return ChunkCost(*fit_nonnegative(feats, [s for _, _, s in samples]))


def fit_layer_cost(samples: Sequence[Sequence[float]]) -> LayerCost:
    """Fit [n, seconds per layer] samples to `LayerCost`."""
    feats = [[1.0, n, n * n] for n, _ in samples]
    return LayerCost(*fit_nonnegative(feats, [s for _, s in samples]))


def fit_link(samples: Sequence[Sequence[float]]) -> LinkCost:
    """Fit [bytes, seconds] samples to `LinkCost`."""
    latency, per_byte = fit_nonnegative([[1.0, b] for b, _ in samples], [s for _, s in samples])
    return LinkCost(1.0 / max(per_byte, 1e-15), latency)


# -- measuring --------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of `repeats` calls (on CUDA, to the end of the queued kernels)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sample_tokens(backend: Any, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, backend.spec.vocab_size, (n,), generator=g)


def measure_chunks(backend: Any, max_tokens: int, chunk_size: int, repeats: int = 2) -> list[list[float]]:
    """[n, past, seconds] of prefills: the chunks (of one and two `chunk_size`s) of a `max_tokens`
    prompt after their past, and whole prompts of doubling lengths (compute-only's one unit)."""
    tokens = _sample_tokens(backend, max_tokens)
    backend.prefill_chunk(tokens[:chunk_size], None, 0)  # warm-up
    t0 = time.perf_counter()
    full = backend.prefill_chunk(tokens, None, 0).data  # the past every chunk below is computed after
    prefill_into = getattr(backend, "prefill_into", None)
    samples = [[max_tokens, 0, time.perf_counter() - t0]]
    for start in range(0, max_tokens, chunk_size):
        sizes = (chunk_size, 2 * chunk_size) if (start // chunk_size) % 2 else (chunk_size,)
        for n in sizes:
            end = min(start + n, max_tokens)
            past = full[:, :, :, :start] if start else None

            def unit(start: int = start, end: int = end, past: torch.Tensor | None = past) -> None:
                if prefill_into is not None:  # what a restore runs: into the cache, over its past
                    prefill_into(tokens[start:end], full, start)  # rewrites [start, end) with its own KV
                else:
                    backend.prefill_chunk(tokens[start:end], past, start)

            samples.append([end - start, start, _timed(unit, repeats)])
    for n in _doublings(chunk_size // 2, max_tokens // 2):
        samples.append([n, 0, _timed(lambda n=n: backend.prefill_chunk(tokens[:n], None, 0), repeats)])
    return samples


def measure_layers(backend: Any, lengths: Sequence[int], repeats: int = 2) -> list[list[float]]:
    """[n, seconds per layer] of running every decoder layer, one at a time, over n tokens at once.

    All of them, not a few: a few layers' weights stay in the CPU's caches, the whole stack's do not,
    and the per-layer time of the whole stack is what a layer-wise restore pays (by 20% on SmolLM2)."""
    num_layers = backend.spec.num_layers
    samples = []
    for i, n in enumerate(lengths):
        tokens = _sample_tokens(backend, n)
        positions = torch.arange(n)

        def stack(tokens: torch.Tensor = tokens, positions: torch.Tensor = positions) -> None:
            hidden = backend.embed(tokens)
            for layer in range(num_layers):
                hidden, _, _ = backend.run_layer(layer, hidden, None, None, positions)

        if i == 0:
            stack()  # warm-up
        samples.append([n, _timed(stack, repeats) / num_layers])
    return samples


async def measure_link(
    store: ChunkStore, sizes: Sequence[int] = (4096, 256 << 10, 4 << 20), repeats: int = 3
) -> list[list[float]]:
    """[bytes, seconds] of reads from `store` of objects it is given for the purpose (then deleted)."""
    samples = []
    keys = []
    try:
        for size in sizes:
            key = "ff" + secrets.token_hex(19)  # a valid store key nobody else uses
            keys.append(key)
            await store.put(key, os.urandom(size))
            await store.get(key)  # warm-up (and connection setup)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                data = await store.get(key)
                times.append(time.perf_counter() - t0)
                if data is None or len(data) != size:
                    raise StoreError(f"the store lost a {size}-byte test object while being profiled")
            samples.append([float(size), statistics.median(times)])
    finally:
        with anyio.CancelScope(shield=True):
            for key in keys:
                await store.delete(key)
    return samples


async def profile(
    backend: Any,
    store: ChunkStore | None = None,
    *,
    max_tokens: int = 2048,
    chunk_size: int = 256,
    layer_lengths: Sequence[int] | None = None,
    repeats: int = 2,
    log: Callable[[str], None] | None = None,
) -> Profile:
    """Measure `backend` (and `store`, if given) on this machine; see the module docstring.

    Takes about 50 s for SmolLM2 (fp32) on a 2-core CPU with the defaults; a tiny model takes well under one.
    """
    if max_tokens < chunk_size or chunk_size <= 0:
        raise InvalidInputError(f"need 0 < chunk_size <= max_tokens, got {chunk_size} and {max_tokens}")
    say = log or (lambda _msg: None)
    lengths = list(layer_lengths or _doublings(chunk_size // 2, max_tokens))
    say(f"prefill cost: chunks of {chunk_size} tokens up to {max_tokens} tokens ...")
    chunk_samples = await anyio.to_thread.run_sync(measure_chunks, backend, max_tokens, chunk_size, repeats)
    say(f"layer cost: {backend.spec.num_layers} layers over {lengths} tokens ...")
    layer_samples = await anyio.to_thread.run_sync(measure_layers, backend, lengths, repeats)
    link_samples: list[list[float]] = []
    if store is not None:
        say(f"store: reads from {store!r} ...")
        layer_section = backend.spec.kv_bytes_per_token // backend.spec.num_layers * chunk_size
        chunk_bytes = backend.spec.kv_bytes_per_token * chunk_size
        link_samples = await measure_link(store, (4096, layer_section, chunk_bytes), repeats)
    spec = backend.spec
    return Profile(
        machine=machine_id(),
        model=spec.name,
        fingerprint=spec.fingerprint,
        dtype=dtype_name(spec.dtype),
        device=torch.device(backend.device).type,
        chunk=fit_chunk_cost(chunk_samples),
        layer=fit_layer_cost(layer_samples),
        link=fit_link(link_samples) if link_samples else None,
        store=repr(store) if store is not None else None,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        samples={"chunk": chunk_samples, "layer": layer_samples, "link": link_samples},
    )


def _doublings(lo: int, hi: int) -> list[int]:
    out, n = [], max(1, lo)
    while n <= hi:
        out.append(n)
        n *= 2
    return out


# -- the live link estimate --------------------------------------------------------------------------


class LinkEstimate:
    """A store's link as restores see it: starts from a profile's, then follows the loads (EWMA).

    After each restore, the bytes its loads brought over the time the load lanes were busy give the
    delivery rate; `weight` is how much one restore moves the estimate. Without a starting link (no
    profile), the per-request latency is estimated from the loads too (`_latency`).
    """

    def __init__(self, link: LinkCost | None = None, weight: float = 0.5) -> None:
        if not 0 < weight <= 1:
            raise InvalidInputError(f"weight must be in (0, 1], got {weight}")
        self.current = link
        self.weight = weight
        self.observations = 0
        self.measured_latency = link is not None  # a profile measured it: keep it

    def observe(self, trace: Trace) -> bool:
        """Move the estimate toward what `trace`'s loads show; whether there were loads to learn from."""
        loads = [e for e in trace.of_kind("load") if e.nbytes > 0]
        busy = _busy_seconds([(e.start_s, e.end_s) for e in loads])
        if not loads or busy <= 0:
            return False
        latency = self.current.latency_s if self.current is not None else 0.0
        fitted = None if self.measured_latency else _fit_shared(loads)
        if fitted is not None:  # loads of different sizes (or sharing the link differently): both terms
            rate, seen = fitted.bytes_per_s, fitted.latency_s
            latency = seen if self.current is None else (1 - self.weight) * latency + self.weight * seen
        else:
            # the busy time starts with one round trip before the first bytes move (more lanes overlap
            # the later ones): the rest is the link's delivery time
            rate = sum(e.nbytes for e in loads) / max(busy - latency, busy / 2)
        if self.current is None:
            self.current = LinkCost(rate, latency)
        else:
            mixed = (1 - self.weight) * self.current.bytes_per_s + self.weight * rate
            self.current = LinkCost(mixed, latency)
        self.observations += 1
        return True


def _fit_shared(loads: Sequence[Any]) -> LinkCost | None:
    """The link from loads that share it: a load's time is a round trip plus its bytes times the
    number of loads in flight at its midpoint, over the link's rate (`fit_link`). None when the loads
    do not differ enough (a fifth, in bytes times sharing) to tell the round trip from the rate."""
    spans = [(e.start_s, e.end_s) for e in loads]
    samples = []
    for e in loads:
        mid = (e.start_s + e.end_s) / 2
        sharing = sum(1 for a, b in spans if a <= mid < b)
        samples.append([e.nbytes * max(1, sharing), e.end_s - e.start_s])
    sizes = [x for x, _ in samples]
    if len(samples) < 3 or max(sizes) < 1.2 * min(sizes):
        return None
    link = fit_link(samples)
    return link if math.isfinite(link.bytes_per_s) and link.bytes_per_s < 1e14 else None


def _busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Calibration:
    """How each strategy's restores actually compare with the profile's predictions (EWMA of the log
    ratio measured / predicted, per policy name).

    The profile measures compute and the link one at a time; a restore runs them together on the same
    machine, and a hybrid pays for that (threads competing for cores, memory traffic) in its own way. A
    restorer observes every restore it runs and `Auto` scales each strategy's prediction by its factor,
    so a strategy the model flatters stops being picked after a few restores. Factors stay within
    [1 / `limit`, `limit`]; a strategy never observed has factor 1.
    """

    def __init__(self, weight: float = 0.5, limit: float = 2.0) -> None:
        if not 0 < weight <= 1:
            raise InvalidInputError(f"weight must be in (0, 1], got {weight}")
        if limit < 1:
            raise InvalidInputError(f"limit must be >= 1, got {limit}")
        self.weight = weight
        self.limit = limit
        self._log: dict[str, float] = {}
        self.observations: dict[str, int] = {}

    def observe(self, name: str, predicted_s: float, measured_s: float) -> None:
        if not (
            predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s)
        ):
            return
        x = math.log(measured_s / predicted_s)
        old = self._log.get(name)
        self._log[name] = x if old is None else (1 - self.weight) * old + self.weight * x
        self.observations[name] = self.observations.get(name, 0) + 1

    def factor(self, name: str) -> float:
        x = self._log.get(name, 0.0)
        bound = math.log(self.limit)
        return math.exp(min(bound, max(-bound, x)))

    def factors(self) -> dict[str, float]:
        return {name: self.factor(name) for name in self._log}

    def logs(self) -> dict[str, float]:
        """log(measured / predicted) per strategy (what `resume` takes back)."""
        return dict(self._log)

    def resume(self, logs: dict[str, float], observations: dict[str, int]) -> None:
        """Continue from what an earlier calibration learned (`logs`, `observations`)."""
        self._log = dict(logs)
        self.observations = dict(observations)
