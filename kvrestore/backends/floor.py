"""The least time a prefill can take on this device: its matmul FLOPs at the best matmul rate measured here.

A restorer that has seen no compute unit yet (no profile, nothing learned) must still tell whether its
loads will land the whole prompt before computing the first chunk could end. On a store faster than
computing, a unit started only to learn the cost is overtaken by the fetches anyway, and it costs a
layer of compute beside the loads (the CPU, the GIL, the memory bandwidth they need).

The decoder layers' linear weights fix the FLOPs per token (two per weight); one timed matmul, over
the model's largest layer weight at a chunk's number of rows, fixes the device's rate. Computing can
only be slower (attention, norms, the smaller projections, launches, a shared device), so the estimate
is a floor: on the 2-core CPU here SmolLM2 prefills at about half the rate of the calibration matmul.
Too high a floor would only make a restore hold its compute lane while the loads land everything
before one chunk could be computed, where computing has little to add; too low a floor starts a unit
the fetches overtake, which costs a layer of compute beside the loads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

#: tokens (rows) of the calibration matmul: a prefill chunk's order of size
CALIBRATION_TOKENS = 1024
#: timed repeats of the calibration matmul (the fastest counts), after one untimed
REPEATS = 3


class ComputeFloor:
    """Seconds below which computing n tokens cannot end on the device it was measured on."""

    def __init__(self, flops_per_token: float, flops_per_s: float) -> None:
        self.flops_per_token = flops_per_token
        self.flops_per_s = flops_per_s

    def seconds(self, n_tokens: int) -> float:
        return n_tokens * self.flops_per_token / self.flops_per_s

    def __repr__(self) -> str:
        return f"ComputeFloor({self.flops_per_token / 1e9:.3f} GFLOP/token at {self.flops_per_s / 1e9:.1f} GFLOP/s)"


def measure_floor(
    layers: Sequence[torch.nn.Module], dtype: torch.dtype, device: torch.device
) -> ComputeFloor:
    """The floor of a decoder stack `layers` on `device` in `dtype` (one matmul, a few milliseconds)."""
    weights = [p for layer in layers for p in layer.parameters() if p.dim() == 2]
    widest = max(weights, key=lambda w: w.numel())
    x = torch.randn(CALIBRATION_TOKENS, widest.shape[1], dtype=dtype, device=device)
    best = math.inf
    with torch.inference_mode():
        for i in range(REPEATS + 1):
            _sync(device)
            t0 = time.perf_counter()
            x @ widest.T
            _sync(device)
            if i:
                best = min(best, time.perf_counter() - t0)
    flops = 2 * CALIBRATION_TOKENS * widest.numel()
    return ComputeFloor(2 * sum(w.numel() for w in weights), flops / max(best, 1e-9))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["ComputeFloor", "measure_floor"]
