"""Blend: the CacheBlend plan (EuroSys 2025, §4-§5) for prompts made of reusable chunks plus a new suffix.

Unlike the prefix policies (`base.Policy`), Blend does not choose between computing and loading whole
chunks: every stored chunk is loaded, and on each layer a fraction of its tokens is recomputed. This
object only holds the numbers that decide how much: the average recompute ratio, the quality floor and
ceiling the loading controller keeps to, and the gradual-filtering schedule over layers. It is pure
(no tensor, no clock); `kvrestore.blend` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.settings import check_bool, check_choice, check_number

DEVIATIONS = ("kv", "k", "v")


@dataclass(frozen=True)
class Blend:
    """How much of the reused KV to recompute (CacheBlend), for `Restorer.restore_blend`.

    The new suffix (the question) and the tokens of chunks that could not be loaded are recomputed on
    every layer, on top of the ratio.

    Parameters
    ----------
    recompute_ratio: float | None
        Average fraction of the reused (chunk) tokens recomputed per layer, over layers 1..L-1 (layer
        0 is always recomputed fully: it is cheap and gives every token the hidden state the first
        HKVD check needs). None lets the loading controller pick it from the measured load and compute
        times (§5.1), within [`min_ratio`, `max_ratio`].
    min_ratio, max_ratio: float
        The bounds the controller picks within; `min_ratio` is the quality floor (the paper's 15%).
    spread: float
        Gradual filtering (§4.3): layer 1 recomputes ratio x (1 + spread) of the tokens, the last
        layer ratio x (1 - spread), linearly in between, so the ratios fall layer by layer and average
        `recompute_ratio`. Each layer's set is taken from the previous layer's by KV deviation.
    deviation: "kv" | "k" | "v"
        What the KV deviation compares.
    update_candidates: bool
        On layer i the K/V of every candidate (the tokens recomputed on layer i-1; all tokens on layer
        1) are projected from their fresh hidden states to measure the deviation. False (as LMCache's
        blender) writes only the K/V of the tokens the layer then recomputes; True keeps the fresh K/V
        of all candidates (§4.3): no extra compute, and layer 1's KV is exact for every token. On the
        SmolLM2 benchmark it helped at a 50% ratio and was neutral to slightly worse at 5-25%.

    Raises
    ------
    InvalidInputError
        A ratio outside [0, 1], `min_ratio > max_ratio`, or an unknown `deviation`.
    """

    recompute_ratio: float | None = 0.15
    min_ratio: float = 0.15
    max_ratio: float = 1.0
    spread: float = 0.5
    deviation: str = "kv"
    update_candidates: bool = False

    name = "blend"

    def __post_init__(self) -> None:
        if self.recompute_ratio is not None:
            check_number("recompute_ratio", self.recompute_ratio, 0, 1)  # (None: the controller picks)
        for name in ("min_ratio", "max_ratio", "spread"):
            check_number(name, getattr(self, name), 0, 1)
        check_bool("update_candidates", self.update_candidates)
        if not self.min_ratio <= self.max_ratio:
            raise InvalidInputError(
                f"need 0 <= min_ratio <= max_ratio <= 1, got min_ratio={self.min_ratio!r}, "
                f"max_ratio={self.max_ratio!r}"
            )
        check_choice("deviation", self.deviation, DEVIATIONS)

    @property
    def auto(self) -> bool:
        return self.recompute_ratio is None

    def schedule(self, ratio: float, num_layers: int) -> list[float]:
        """Recompute ratios of layers 1..num_layers-1 (see `ratio_schedule`)."""
        return ratio_schedule(ratio, num_layers, self.spread)


def ratio_schedule(ratio: float, num_layers: int, spread: float = 0.5) -> list[float]:
    """Per-layer ratios r_1 >= r_2 >= ... >= r_{L-1} for layers 1..L-1, linear, averaging `ratio`.

    The spread is narrowed where needed so that r_1 <= 1 (and r_{L-1} >= 0), which keeps the mean
    exact: ratio 1.0 recomputes everything on every layer, ratio 0.0 nothing (full KV reuse).
    """
    if not 0.0 <= ratio <= 1.0:
        raise InvalidInputError(f"ratio must be in [0, 1], got {ratio!r}")
    m = num_layers - 1
    if m <= 0:
        return []
    if m == 1 or ratio in (0.0, 1.0):
        return [ratio] * m
    s = min(spread, (1.0 - ratio) / ratio, 1.0)
    return [ratio * (1.0 + s * (1.0 - 2.0 * j / (m - 1))) for j in range(m)]
