"""The loading controller of CacheBlend (§5.1): pure functions of delay estimates, no clock, no tensor.

The fusor recomputes layer i while layer i+1 loads, so recompute is free as long as it takes at most as
long as loading a layer. Two questions follow:

* given one store, which recompute ratio? The largest whose per-layer recompute time still hides behind
  the per-layer load time -- but never below the quality floor (`choose_ratio`);
* given several stores and a fixed ratio, where to keep the KV? The cheapest store whose per-layer load
  time is at most the recompute time, i.e. that adds no delay (`choose_store`).

Estimators (the paper's footnotes 5 and 6): T_recompute(r) = r x T_prefill_layer(L) and
T_load = KV bytes per token per layer x L / bandwidth (plus one round trip: a layer of every chunk is
read at once). `kvrestore.blend.placement` measures these inputs on real stores and a real model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvrestore.core.errors import InvalidInputError


@dataclass(frozen=True)
class StoreOption:
    """A place the chunks' KV could live: its read bandwidth (and round trip) and what keeping bytes
    there costs."""

    name: str
    bandwidth_bytes_per_s: float
    cost_per_gb: float  # any unit, e.g. $ per GB-month; only the order matters
    latency_s: float = 0.0

    def load_seconds_per_layer(self, kv_bytes_per_token_layer: float, n_tokens: int) -> float:
        """T_load of one layer of `n_tokens` tokens' KV from this store."""
        return self.latency_s + load_seconds_per_layer(
            kv_bytes_per_token_layer, n_tokens, self.bandwidth_bytes_per_s
        )


def load_seconds_per_layer(
    kv_bytes_per_token_layer: float, n_tokens: int, bandwidth_bytes_per_s: float
) -> float:
    """T_load of one layer of `n_tokens` tokens' KV at a bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise InvalidInputError(f"bandwidth must be positive, got {bandwidth_bytes_per_s!r}")
    return kv_bytes_per_token_layer * n_tokens / bandwidth_bytes_per_s


def recompute_seconds_per_layer(ratio: float, prefill_seconds_per_layer: float) -> float:
    """T_recompute(r) of one layer: r times a full prefill of that layer (selective compute is linear)."""
    return ratio * prefill_seconds_per_layer


def choose_ratio(
    load_s_per_layer: float, prefill_s_per_layer: float, floor: float = 0.15, ceiling: float = 1.0
) -> float:
    """The recompute ratio whose per-layer recompute time equals the per-layer load time, clamped to
    [floor, ceiling]: as much quality as loading hides for free, and never less than the floor."""
    if not 0.0 <= floor <= ceiling <= 1.0:
        raise InvalidInputError(f"need 0 <= floor <= ceiling <= 1, got {floor!r}, {ceiling!r}")
    if load_s_per_layer < 0 or prefill_s_per_layer < 0:
        raise InvalidInputError("delay estimates must be non-negative")
    if prefill_s_per_layer == 0:
        return ceiling
    hidden = load_s_per_layer / prefill_s_per_layer
    return min(ceiling, max(floor, hidden)) if math.isfinite(hidden) else ceiling


def choose_store(
    options: Sequence[StoreOption],
    ratio: float,
    n_tokens: int,
    kv_bytes_per_token_layer: float,
    prefill_s_per_layer: float,
) -> StoreOption:
    """The cheapest store whose per-layer load hides behind recompute at `ratio` (adds no delay).

    When none is fast enough, the fastest one (the least added delay). Ties on cost go to the faster.
    A store's per-layer load time counts its round trip (`StoreOption.latency_s`) as well as its bandwidth.
    """
    if not options:
        raise InvalidInputError("no store options to choose from")
    budget = recompute_seconds_per_layer(ratio, prefill_s_per_layer)

    def load(o: StoreOption) -> float:
        return o.load_seconds_per_layer(kv_bytes_per_token_layer, n_tokens)

    ok = [o for o in options if load(o) <= budget]
    if ok:
        return min(ok, key=lambda o: (o.cost_per_gb, load(o)))
    return min(options, key=load)
