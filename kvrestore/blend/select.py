"""HKVD token selection (CacheBlend §4.3): KV deviation and gradual filtering.

On each layer i >= 1 the candidates are the tokens recomputed on layer i-1 (all tokens for layer 1).
Their K/V on layer i are projected from their fresh hidden states and compared with the loaded K/V;
the `size` tokens of reused chunks with the highest deviation, plus every forced token (the new suffix, chunks
that could not be loaded), are recomputed on layer i and become the next layer's candidates. The sets
therefore shrink monotonically and the forced tokens are in every one of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from kvrestore.core.errors import InvalidInputError


def kv_deviation(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, kind: str = "kv"
) -> torch.Tensor:
    """Per-token squared L2 distance [T] between fresh and loaded K/V ([H, T, D] each), in float32."""
    return stacked_kv_deviation(torch.stack((k_new, v_new)), torch.stack((k_old, v_old)), kind)


_HALVES = {"kv": slice(0, 2), "k": slice(0, 1), "v": slice(1, 2)}


def stacked_kv_deviation(new: torch.Tensor, old: torch.Tensor, kind: str = "kv") -> torch.Tensor:
    """`kv_deviation` of K and V stacked, [2, H, T, D] each (as a layer's KV lies in a cache).

    Four device ops (a difference, a cast, a square, one reduction over K and V at once): it runs on
    every selective layer, where launches count.
    """
    if kind not in _HALVES:
        raise InvalidInputError(f"deviation kind must be one of {sorted(_HALVES)}, got {kind!r}")
    part = _HALVES[kind]
    return (new[part] - old[part]).float().square().sum(dim=(0, 1, 3))


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
    """How many tokens of reused chunks each layer 1..L-1 recomputes, non-increasing (gradual filtering)."""
    sizes: list[int] = []
    for r in schedule:
        n = min(n_reused, max(0, round(r * n_reused)))
        sizes.append(min(n, sizes[-1]) if sizes else n)
    return sizes


class SelectionBounds:
    """Upper bounds of each layer's selected positions, known on the host without waiting for the device.

    The selected positions bound the keys each recomputed row attends to (`row_groups`), so the host
    must know them before it queues the attention. On a CPU the selection itself is on the host. On
    CUDA reading it would wait for the device on every layer; instead each selection is copied to
    pinned host memory behind the layer's kernels (`record`), and a later layer uses the newest copy
    that has landed (polled, never waited for) -- all tokens before the first one. That is enough:
    every selection is a subset of the one before (gradual filtering), and if a sorted set of s
    positions is drawn from a sorted superset P of m, its r-th smallest is at most P[r + m - s] (at
    least s - 1 - r of its members lie above it). The bound is tight when the sets shrink slowly, as
    they do from layer 2 on.
    """

    def __init__(self, n_tokens: int, device: torch.device, exact: bool | None = None) -> None:
        self.exact = device.type != "cuda" if exact is None else exact
        self._n_tokens = n_tokens
        self._superset: Sequence[int] = range(n_tokens)
        self._pending: deque[tuple[torch.cuda.Event | None, torch.Tensor]] = deque()

    def upper(self, selection: torch.Tensor) -> Sequence[int]:
        """Non-decreasing upper bounds of the sorted positions in `selection` (one per row)."""
        if self.exact:
            return selection.tolist()
        landed = None
        while self._pending and (self._pending[0][0] is None or self._pending[0][0].query()):
            landed = self._pending.popleft()[1]
        if landed is not None:
            self._superset = landed.tolist()
        m, s = len(self._superset), selection.numel()
        if s > m:  # not drawn from the last set (never, in the fusor): every row may see every key
            return [self._n_tokens - 1] * s
        return self._superset[m - s :]

    def lower(self, selection: torch.Tensor) -> Sequence[int]:
        """Non-decreasing lower bounds of the sorted positions in `selection`, from the set the last
        `upper` used (call it first): the r-th smallest of a subset is at least the r-th smallest of
        its superset."""
        if self.exact:
            return selection.tolist()
        s = selection.numel()
        return self._superset[:s] if s <= len(self._superset) else [0] * s

    def record(self, selection: torch.Tensor) -> None:
        """Start copying a layer's selection to the host, for the bounds of the layers after it."""
        if self.exact:
            return
        if not selection.is_cuda:  # bounds from earlier layers on a CPU too (tests of the CUDA logic)
            self._pending.append((None, selection.clone()))
            return
        host = torch.empty(selection.shape, dtype=selection.dtype, pin_memory=True)
        host.copy_(selection, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host))
