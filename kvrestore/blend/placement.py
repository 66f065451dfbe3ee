"""Where to keep chunk KV for CacheBlend, measured (§5.1: "the cheapest storage device that adds no delay").

`controller.choose_store` is pure: it takes each store's bandwidth and one layer's prefill time. This
module measures both on the real parts, then asks it:

* each candidate store's read link: `measure.measure_link` writes a few objects of a small size and of
  one layer's KV of the blend, reads them back, deletes them, and `fit_link` turns that into a round
  trip and a bandwidth;
* one layer's full prefill over the blend's tokens: the restorer's profile (`LayerCost`) when it has
  one, else the model's whole layer stack timed here over that many tokens (`measure.measure_layers`).

The answer says why: every store's per-layer load time against the recompute time it must hide behind.
A store that cannot be measured (down, refusing writes, losing objects) is left out and named in the
answer; only when none can be measured is it an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio.to_thread

from kvrestore.blend.controller import StoreOption, choose_store, recompute_seconds_per_layer
from kvrestore.core.errors import LOAD_FAULTS, InvalidInputError, StoreError
from kvrestore.costs.compute import LayerCost
from kvrestore.costs.links import fit_link
from kvrestore.costs.measure import measure_layers, measure_link
from kvrestore.stores.base import ChunkStore

if TYPE_CHECKING:
    from kvrestore.backends.hf import HFBackend


@dataclass(frozen=True)
class StoreCandidate:
    """A store the chunks could be saved to, and what keeping a GB there costs (any unit)."""

    name: str
    store: ChunkStore
    cost_per_gb: float


@dataclass(frozen=True)
class StorePlacement:
    """The measured choice: `candidate` is where to `save_chunk`."""

    candidate: StoreCandidate
    options: list[StoreOption]  # the stores that could be measured, in the candidates' order
    ratio: float
    n_tokens: int
    kv_bytes_per_token_layer: int
    recompute_s_per_layer: float  # what a layer's load must hide behind: ratio x one layer's prefill
    unreachable: dict[str, str]  # candidates that could not be measured: name -> the error

    @property
    def option(self) -> StoreOption:
        return next(o for o in self.options if o.name == self.candidate.name)

    def load_s_per_layer(self, option: StoreOption) -> float:
        return option.load_seconds_per_layer(self.kv_bytes_per_token_layer, self.n_tokens)

    @property
    def adds_delay(self) -> bool:
        """True when no candidate's load hides behind recompute (the fastest was chosen)."""
        return self.load_s_per_layer(self.option) > self.recompute_s_per_layer

    def explain(self) -> str:
        lines = [
            f"{self.n_tokens} tokens at ratio {self.ratio:.2f}: recompute {self.recompute_s_per_layer * 1e3:.2f}"
            " ms per layer for the loads to hide behind"
        ]
        for o in self.options:
            load = self.load_s_per_layer(o)
            mark = "<- chosen" if o.name == self.candidate.name else ""
            fits = "hides" if load <= self.recompute_s_per_layer else "adds delay"
            # a store whose reads take no measurable time per byte (memory) fits to an absurd bandwidth
            bandwidth = o.bandwidth_bytes_per_s
            rate = "> 1 TB/s" if bandwidth >= 1e12 else f"{bandwidth / 1e6:.1f} MB/s"
            lines.append(
                f"  {o.name}: {rate}, round trip {o.latency_s * 1e3:.2f} ms, "
                f"load {load * 1e3:.2f} ms per layer ({fits}), cost {o.cost_per_gb:g} {mark}".rstrip()
            )
        lines += [
            f"  {name}: left out, could not be measured ({err})" for name, err in self.unreachable.items()
        ]
        return "\n".join(lines)


async def measure_store(
    candidate: StoreCandidate, kv_bytes_per_token_layer: int, n_tokens: int, repeats: int = 3
) -> StoreOption:
    """`candidate`'s read link, measured with a small object and one layer's KV of `n_tokens` tokens."""
    layer_bytes = max(kv_bytes_per_token_layer * n_tokens, 8192)
    samples = await measure_link(candidate.store, (4096, layer_bytes), repeats)
    link = fit_link(samples)
    return StoreOption(candidate.name, link.bytes_per_s, candidate.cost_per_gb, link.latency_s)


async def choose_blend_store(
    backend: HFBackend,
    candidates: Sequence[StoreCandidate],
    *,
    n_tokens: int,
    ratio: float = 0.15,
    layer_cost: LayerCost | None = None,
    repeats: int = 3,
) -> StorePlacement:
    """Measure every candidate store and one layer's prefill of `n_tokens` tokens, and pick the cheapest
    store whose per-layer load hides behind recomputing `ratio` of a layer (the fastest if none does).

    `layer_cost` (e.g. `restorer.planner.profile.layer`) saves timing the model here. Each store gets a few
    test objects written and deleted.
    """
    if not candidates:
        raise InvalidInputError("no candidate stores to choose from")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"candidate store names must differ, got {names}")
    if n_tokens <= 0:
        raise InvalidInputError(f"n_tokens must be positive, got {n_tokens!r}")
    if not 0.0 <= ratio <= 1.0:
        raise InvalidInputError(f"ratio must be in [0, 1], got {ratio!r}")
    spec = backend.spec
    per_token_layer = spec.kv_bytes_per_token // spec.num_layers
    if layer_cost is not None:
        prefill_s = layer_cost.seconds(n_tokens)
    else:
        [[_, prefill_s]] = await anyio.to_thread.run_sync(measure_layers, backend, [n_tokens], 1)
    options, unreachable = [], {}
    for c in candidates:
        try:
            options.append(await measure_store(c, per_token_layer, n_tokens, repeats))
        except LOAD_FAULTS as exc:
            unreachable[c.name] = f"{type(exc).__name__}: {exc}"
    if not options:
        raise StoreError(f"none of the candidate stores could be measured: {unreachable}")
    best = choose_store(options, ratio, n_tokens, per_token_layer, prefill_s)
    return StorePlacement(
        candidate=next(c for c in candidates if c.name == best.name),
        options=options,
        ratio=ratio,
        n_tokens=n_tokens,
        kv_bytes_per_token_layer=per_token_layer,
        recompute_s_per_layer=recompute_seconds_per_layer(ratio, prefill_s),
        unreachable=unreachable,
    )
