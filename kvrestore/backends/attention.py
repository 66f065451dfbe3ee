"""Attention as the HF backend runs it: RoPE, causal masks, and which SDPA kernel a unit of new tokens
after a past gets (`attention_plan`), kept apart from the layer loop so the choice can be tested alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [1, heads, T, D] by cos/sin [1, T, D] (the HF convention: halves, not interleaved)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


# what flash attention runs on (it takes grouped K/V heads as they are; the memory-efficient kernel does not)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


def attention_plan(
    device_type: str, dtype: torch.dtype, head_dim: int, n_past: int, gqa: bool
) -> tuple[str, bool]:
    """How a unit of new tokens attends over itself and `n_past` cached tokens: (mode, expand_kv).

    mode is "causal" without a past (SDPA's `is_causal=True`), "lower_right" on CUDA with a past (SDPA
    with `torch.nn.attention.bias.causal_lower_right`: the flash or memory-efficient kernel runs with
    the causal diagonal moved to the bottom right, no mask tensor), or "mask" elsewhere with a past
    (one boolean mask per unit; exact on CPU). expand_kv says whether grouped K/V heads are repeated
    to the query heads first (a copy): only where the kernel that will run cannot take them as they are
    -- torch without `enable_gqa`, or the lower-right path in a dtype (float32) or head size flash
    attention does not run, where `CausalBias` picks the memory-efficient kernel, which has no GQA.
    """
    if n_past == 0:
        mode = "causal"
    elif device_type == "cuda":
        mode = "lower_right"
    else:
        mode = "mask"
    if not gqa:
        return mode, False
    if not _SDPA_GQA:
        return mode, True
    flash = dtype in _FLASH_DTYPES and head_dim <= _FLASH_MAX_HEAD_DIM
    return mode, mode == "lower_right" and not flash


def attend_fn(
    n_new: int, n_past: int, plan: tuple[str, bool], rep: int, scale: float, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """attend(q [1, heads, n_new, D], k, v [1, H, n_past + n_new, D]) -> [1, heads, n_new, D]: causal
    attention of a unit's queries over its past and itself, as `plan` (`attention_plan`) says, with
    `rep` query heads per K/V head, set up once per unit (mask or bias built here, not per layer;
    nothing that waits for the device)."""
    mode, expand = plan
    kwargs: dict[str, Any] = {"scale": scale}
    if mode == "causal":
        kwargs["is_causal"] = True
    elif mode == "lower_right":
        kwargs["attn_mask"] = causal_lower_right(n_new, n_past + n_new)
    else:  # boolean [n_new, n_past + n_new]: query i sees keys up to position n_past + i
        q = torch.arange(n_new, device=device).unsqueeze(1) + n_past
        kwargs["attn_mask"] = torch.arange(n_past + n_new, device=device).unsqueeze(0) <= q
    if rep > 1 and not expand:
        kwargs["enable_gqa"] = True
    sdpa = F.scaled_dot_product_attention

    if rep == 1 or not expand:
        return lambda q, k, v: sdpa(q, k, v, **kwargs)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), **kwargs)

    return attend


def row_groups(
    upper: Sequence[int], n_keys: int, max_groups: int, min_rows: int
) -> list[tuple[int, int, int]]:
    """Split the sorted rows of a selective layer's queries into groups that attend over key prefixes.

    Row r is a token at a sequence position of at most `upper[r]` (non-decreasing; the exact positions
    or bounds known on the host, see `kvrestore.blend.select.SelectionBounds`). Under the causal mask it
    sees no key past that, so a group of rows [a, b) needs only keys [0, upper[b-1] + 1). Returns
    (a, b, n_keys of the group) for up to `max_groups` groups of at least `min_rows` rows (one group
    over all `n_keys` keys if the rows are too few): on average about (1 + 1/G) / 2 of the attention of
    one masked call, for G - 1 more calls.
    """
    s = len(upper)
    g = max(1, min(max_groups, s // max(1, min_rows)))
    if g == 1:
        return [(0, s, n_keys)] if s else []
    cuts = [round(s * i / g) for i in range(g + 1)]
    return [(a, b, min(n_keys, upper[b - 1] + 1)) for a, b in zip(cuts, cuts[1:], strict=False)]


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [1, heads, S, D] over k, v [1, heads, K, D] (K/V heads already expanded to the
    query heads) under an optional additive bias [S, K] in q's dtype, with each row's log-sum-exp of
    its scaled, biased scores [1, heads, S] in float32: what `merge_attention` needs to join the
    attention over two disjoint key sets.

    SDPA's public call returns no log-sum-exp; its kernels do. On CUDA: flash attention without a bias
    in half precision, else the memory-efficient kernel (the bias broadcast over the batch and heads,
    as SDPA itself passes it); on a CPU the CPU flash kernel. Every row must see at least one key.
    """
    if q.device.type == "cuda":
        if bias is None and q.dtype in _FLASH_DTYPES:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        else:
            full = None if bias is None else bias.expand(q.shape[0], q.shape[1], *bias.shape)
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, full, True, 0.0, False, scale=scale
            )
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
    return res[0], res[1][..., : q.shape[2]].float()  # the memory-efficient kernel pads rows of its LSE


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """The attention over the union of two disjoint key sets, from each set's attention [1, heads, S, D]
    and log-sum-exp [1, heads, S] (`attention_lse`): each part weighs by its share of the softmax
    denominator, exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b). The weight is rounded
    to the outputs' dtype (in bf16 an error of at most one rounding of the output's own size): three
    device ops in float32, four in half precision."""
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1).to(out_a.dtype)
    return torch.lerp(out_b, out_a, w)


class SharedSdpaRestriction:
    """`sdpa_kernel(backends)` that threads can hold at once without corrupting the process's flags.

    `sdpa_kernel` sets process-wide flags and, on exit, puts back what it found on entry. Two threads
    whose blocks overlap (A in, B in, A out, B out) would end with B putting back A's restriction: flash
    and cuDNN attention off for the rest of the process. Here the first holder enters `sdpa_kernel`,
    later holders only count, and the last one out restores the flags. Attention in other threads
    meanwhile runs under the same restriction (every backend computes the same attention).
    """

    def __init__(self, backends: list[SDPBackend]) -> None:
        self.backends = backends
        self._lock = threading.Lock()
        self._holders = 0
        self._held: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                held = contextlib.ExitStack()
                held.enter_context(sdpa_kernel(self.backends))
                self._held = held
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._held is not None:
                    self._held.close()
                    self._held = None


# CacheBlend's masked attention on CUDA: every backend but cuDNN's, which would build a new execution
# plan for every new number of selected rows. Flash attention takes no mask, so the masked call gets the
# memory-efficient kernel (MATH only where that cannot run); attention in other threads meanwhile keeps
# flash (without it, a long grouped-query prefill would fall to MATH and its full score matrix).
without_cudnn_attention = SharedSdpaRestriction(
    [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
)
