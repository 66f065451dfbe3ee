"""HKVD token selection (CacheBlend §4.3): KV deviation and gradual filtering.

On each layer i >= 1 the candidates are the tokens recomputed on layer i-1 (all tokens for layer 1).
Their K/V on layer i are projected from their fresh hidden states and compared with the loaded K/V;
the `size` reused tokens with the highest deviation, plus every forced token (the new suffix, chunks
that could not be loaded), are recomputed on layer i and become the next layer's candidates. The sets
therefore shrink monotonically and the forced tokens are in every one of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrestore.core.errors import InvalidInputError


def kv_deviation(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, kind: str = "kv"
) -> torch.Tensor:
    """Per-token squared L2 distance [T] between fresh and loaded K/V ([H, T, D] each)."""
    dev = torch.zeros(k_new.shape[1], dtype=torch.float32, device=k_new.device)
    if kind in ("kv", "k"):
        dev += (k_new.float() - k_old.float()).square().sum(dim=(0, 2))
    if kind in ("kv", "v"):
        dev += (v_new.float() - v_old.float()).square().sum(dim=(0, 2))
    return dev


def select_hkvd(
    deviation: torch.Tensor, forced: torch.Tensor, size: int, n_forced: int | None = None
) -> torch.Tensor:
    """Local indices (sorted) of the candidates to recompute: every forced one plus the `size`
    non-forced ones with the highest deviation (fewer if there are fewer).

    With `n_forced` (how many of `forced` are set, known to the caller) nothing here waits for the
    device: one top-k over the deviations with the forced ones set to +inf, then a sort.
    """
    if deviation.shape != forced.shape:
        raise InvalidInputError(f"deviation {tuple(deviation.shape)} and forced {tuple(forced.shape)} differ")
    if n_forced is None:
        n_forced = int(forced.sum())
    size = max(0, min(size, deviation.numel() - n_forced))
    top = torch.finfo(torch.float32).max  # a finite ceiling: a huge deviation never outranks a forced token
    score = deviation.float().nan_to_num(nan=0.0, posinf=top, neginf=0.0).masked_fill(forced, float("inf"))
    return score.topk(n_forced + size, sorted=False).indices.sort().values


def selection_sizes(schedule: Sequence[float], n_reused: int) -> list[int]:
    """How many reused tokens each layer 1..L-1 recomputes, non-increasing (gradual filtering)."""
    sizes: list[int] = []
    for r in schedule:
        n = min(n_reused, max(0, round(r * n_reused)))
        sizes.append(min(n, sizes[-1]) if sizes else n)
    return sizes
