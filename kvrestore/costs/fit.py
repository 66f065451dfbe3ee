"""The one fit every cost model here uses: non-negative least squares of the relative error."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
