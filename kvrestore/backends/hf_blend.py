"""CacheBlend's operations on an HF decoder: re-rotating cached keys to new positions and recomputing a
subset of tokens of a layer over blended KV.

`HFBlend` is a part of `HFBackend` (`backend.blend`), built by it over its model: it reads the
backend's layers, rotary module and dimensions and uses its projection helpers (`rotary`, `_project`,
`_project_normed`, `_mix`). The backend offers the operations CacheBlend calls as its own methods.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvrestore.backends.attention import (
    _SDPA_GQA,
    _rotate_half,
    attention_lse,
    merge_attention,
    row_groups,
    without_cudnn_attention,
)
from kvrestore.core.errors import UnsupportedModelError

if TYPE_CHECKING:
    from kvrestore.backends.hf import HFBackend

log = logging.getLogger("kvrestore.blend")

# RoPE variants whose frequencies do not depend on the sequence: cached keys can be moved exactly
REROTATABLE_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}

# the memory-efficient kernel takes an additive mask as it is when its row stride is a multiple of this
# many elements; else SDPA copies it into a padded one, on every call
MASK_ALIGNMENT = 16


def selected_rows_mask(index: torch.Tensor, n_keys: int, dtype: torch.dtype, additive: bool) -> torch.Tensor:
    """The causal mask [S, n_keys] of rows at sorted positions `index` [S]: row r sees keys 0..index[r].

    Boolean, or with `additive` (CUDA) the additive bias SDPA would make of it (0 where seen, -inf
    elsewhere) in `dtype`, allocated `MASK_ALIGNMENT`-wide and sliced to `n_keys`: each group's slice
    (`row_groups`) then goes to the memory-efficient kernel as it lies. Given a boolean mask, SDPA
    converts it (two kernels) and pads it (two more) on every call: per group, per layer.
    """
    if not additive:
        return torch.arange(n_keys, device=index.device)[None, :] <= index[:, None]
    width = -(-n_keys // MASK_ALIGNMENT) * MASK_ALIGNMENT
    unseen = torch.arange(width, device=index.device)[None, :] > index[:, None]
    bias = torch.zeros((index.numel(), width), dtype=dtype, device=index.device)
    return bias.masked_fill_(unseen, float("-inf"))[:, :n_keys]


class HFBlend:
    """CacheBlend's view of a decoder: keys moved between positions, layers run for selected tokens.

    Parameters
    ----------
    backend: HFBackend
        The backend whose model this runs.

    Attributes
    ----------
    attention_groups: int
        The selected rows' attention is split into up to this many groups over key prefixes
        (`row_groups`), of at least `group_rows` rows each, when the caller knows bounds of the rows'
        positions on the host (`run_layer_selective(upper=)`); 1 runs one masked call over all keys.
    group_rows: int
        The fewest rows of a group.
    attention_split: bool | None
        Whether each group is split block-causally (`_attention_split`), where the caller also knows
        lower bounds of the rows' positions (`run_layer_selective(lower=)`): the keys every row of the
        group sees go to an unmasked call, only the rest to the masked one. None (the default) splits
        on CUDA only: a CPU kernel gains nothing from a missing mask (measured: slower, for the extra
        call).
    split_min_work: int
        A group splits when its unmasked part holds at least this many (row, key) pairs: the split
        costs about five more launches (a second call and the merge), which pays on CUDA only when it
        moves some millions of pairs off the masked kernel onto flash attention (so 4 x 2k-token blends
        at 15% split no group, 4 x 4k most).
    """

    attention_groups: int = 4
    group_rows: int = 64
    attention_split: bool | None = None
    split_min_work: int = 1 << 21
    # whether the split's kernels (`attention_lse`) agree with the masked call, per device, dtype and
    # head shape: checked once on CUDA, where they are SDPA's internal ops (`_split_attention_works`)
    _split_checked: dict[tuple[str, torch.dtype, int, int], bool] = {}

    def __init__(self, backend: HFBackend) -> None:
        self.backend = backend
        self._layers = backend._layers
        self._rotary = backend._rotary
        self._head_dim, self._n_heads, self._n_kv = backend._head_dim, backend._n_heads, backend._n_kv
        self._scaling = backend._scaling
        self.device = backend.device

    def rope_inv_freq(self) -> torch.Tensor:
        """The model's own RoPE inverse frequencies [D/2], checked to make re-rotation exact.

        Keys are cached after RoPE, and RoPE is a rotation per frequency pair, so moving a key from
        position p to p + delta is one more rotation by delta * inv_freq -- exact whenever the
        frequencies do not depend on the position or sequence length (default, linear, Llama-3 and
        YaRN scaling; YaRN's attention factor is already inside the cached keys). Dynamic NTK and
        LongRoPE pick frequencies from the sequence length, so a key cached alone cannot be moved
        exactly: they raise UnsupportedModelError, as does a rotary module without `inv_freq`.
        """
        rope_type = getattr(self._rotary, "rope_type", "default")
        inv_freq = getattr(self._rotary, "inv_freq", None)
        if rope_type not in REROTATABLE_ROPE_TYPES or inv_freq is None:
            raise UnsupportedModelError(
                f"cannot re-rotate cached keys of a {rope_type!r} RoPE model exactly (its frequencies "
                f"depend on the sequence length); CacheBlend supports {sorted(REROTATABLE_ROPE_TYPES)}"
            )
        if inv_freq.numel() * 2 != self._head_dim:
            raise UnsupportedModelError(
                f"partial rotary embedding ({inv_freq.numel() * 2} of {self._head_dim} dims) is not supported"
            )
        return inv_freq

    @torch.inference_mode()
    def rerotate_keys(
        self,
        k: torch.Tensor,
        old_pos: torch.Tensor | int,
        new_pos: torch.Tensor | int,
        rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Keys k [..., T, D] cached (after RoPE) at `old_pos` moved to `new_pos` (ints or [T] tensors).

        Returns a new tensor; R(new) = R(new - old) . R(old), with the delta angle computed in float64.
        `rotation` is `rerotation(k, old_pos, new_pos)` made before (the same for every layer).
        """
        cos, sin = rotation if rotation is not None else self.rerotation(k, old_pos, new_pos)
        return k * cos + _rotate_half(k) * sin

    def rerotation(
        self, k: torch.Tensor, old_pos: torch.Tensor | int, new_pos: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D] in k's dtype and device that move keys like k from `old_pos` to `new_pos`."""
        inv_freq = self.rope_inv_freq().to(device=k.device, dtype=torch.float64)
        t = k.shape[-2]
        old = torch.as_tensor(old_pos, device=k.device, dtype=torch.float64).expand(t)
        new = torch.as_tensor(new_pos, device=k.device, dtype=torch.float64).expand(t)
        angles = (new - old)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(k.dtype), emb.sin().to(k.dtype)

    @torch.inference_mode()
    def project_candidates(
        self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed inputs [1, T, hidden], and K (after RoPE) and V [H, T, D], that `layer` makes of
        `hidden` [1, T, hidden], with no attention: CacheBlend measures candidate tokens' KV deviation
        with them, and `run_layer_selective` takes the selected tokens' rows of all three
        (`projected=`) instead of projecting them again."""
        mod = self._layers[layer]
        x = mod.input_layernorm(hidden)
        _, k, v = self.backend._project_normed(mod, x, *rope, with_q=False)
        assert k is not None and v is not None
        return x, k[0], v[0]

    @torch.inference_mode()
    def run_layer_selective(
        self,
        layer: int,
        hidden: torch.Tensor,
        index: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        upper: Sequence[int] | None = None,
        lower: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer for a subset of tokens of a sequence whose KV for this layer is `k`, `v`.

        `hidden` [1, S, hidden] are the inputs of the tokens at sequence positions `index` [S] (sorted,
        position = index: the sequence starts at 0). `k`, `v` [H, N, D] hold the layer's KV for all N
        tokens; the selected rows are **overwritten in place** with the recomputed ones before the
        attention runs, so each selected query attends over the blended KV with a causal mask at its
        position. Returns (hidden out [1, S, hidden], K rows [H, S, D], V rows [H, S, D]). With
        `projected` (the tokens' normed inputs [1, S, hidden], K and V rows [H, S, D] from
        `project_candidates`) only their queries are projected here. With `upper` (for each row, a
        host-side upper bound of its position, non-decreasing: `index` itself, or bounds that need no
        device sync) the attention runs in groups of rows over key prefixes (`row_groups`): the same
        result, for about half the attention work. With `lower` too (host-side lower bounds of the
        positions, non-decreasing) each group is split block-causally (`_attention_split`): the keys all
        its rows see attend without a mask, only the rest under it.
        """
        index = index.to(self.device)
        cos, sin = rope if rope is not None else self.backend.rotary(hidden, index)
        mod = self._layers[layer]
        if projected is None:
            q, kr, vr = self.backend._project(mod, hidden, cos, sin)
        else:
            x, k_rows, v_rows = projected
            q_only, _, _ = self.backend._project_normed(mod, x, cos, sin, with_kv=False)
            assert q_only is not None
            q = q_only
            kr, vr = k_rows[None], v_rows[None]
        k.index_copy_(1, index, kr[0])
        v.index_copy_(1, index, vr[0])
        out = self._attention_selected(q, k.unsqueeze(0), v.unsqueeze(0), index, upper, lower)
        return self.backend._mix(mod, hidden, out), kr[0], vr[0]

    @torch.inference_mode()
    def attention_probs(
        self, layer: int, hidden: torch.Tensor, k: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """Attention probabilities [heads, S, N] of the tokens at `index` (inputs `hidden` [1, S, hidden])
        over a layer's keys `k` [H, N, D], causal at each token's position: the forward attention matrix
        rows that CacheBlend's attention deviation compares."""
        index = index.to(self.device)
        cos, sin = self.backend.rotary(hidden, index)
        mod = self._layers[layer]
        q, _, _ = self.backend._project_normed(mod, mod.input_layernorm(hidden), cos, sin, with_kv=False)
        assert q is not None
        keys = k.repeat_interleave(self._n_heads // self._n_kv, dim=0)
        scores = (q[0].float() @ keys.float().transpose(1, 2)) * self._scaling
        mask = torch.arange(k.shape[1], device=self.device)[None, :] <= index[:, None]
        return scores.masked_fill(~mask, float("-inf")).softmax(-1)

    def _attention_selected(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        upper: Sequence[int] | None = None,
        lower: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Attention of scattered rows q [1, heads, S, D] at sorted positions `index` [S] over k, v
        [1, H, N, D], each row causal at its position; in groups over key prefixes when `upper` bounds
        the positions on the host, each group split block-causally when `lower` bounds them too (see
        `run_layer_selective`). Grouped-query heads are expanded once on CUDA, and on a CPU where a group
        splits (see `_attention_masked`, `attention_lse`); each group's keys are a view of them."""
        n = k.shape[2]
        if upper is None:
            groups = [(0, q.shape[2], n)]
        else:
            groups = row_groups(upper, n, self.attention_groups, self.group_rows)
        last = groups[-1][2]  # the key counts do not decrease
        k, v = k[:, :, :last], v[:, :, :last]
        cuda = q.device.type == "cuda"
        starts = self._unmasked_keys(groups, lower, q.device, q.dtype)
        split = any(starts)
        if (cuda or split) and self._n_heads != self._n_kv:
            rep = self._n_heads // self._n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = selected_rows_mask(index, last, q.dtype, additive=cuda or split)  # sliced per group
        outs = []
        with without_cudnn_attention() if cuda else contextlib.nullcontext():
            for (a, b, kl), c in zip(groups, starts, strict=True):
                part = (q[:, :, a:b], k[:, :, :kl], v[:, :, :kl], mask[a:b, :kl])
                outs.append(self._attention_split(*part, c) if c else self._attention_masked(*part))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _unmasked_keys(
        self,
        groups: list[tuple[int, int, int]],
        lower: Sequence[int] | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> list[int]:
        """For each group (a, b, n_keys): how many leading keys every one of its rows sees, so they need
        no mask -- the lower bound of its first row's position, rounded down to `MASK_ALIGNMENT` (the
        masked part's slice of the additive mask then starts aligned) -- or 0 where the group does not
        split (no `lower`, the split off here, fewer than `split_min_work` (row, key) pairs in the
        unmasked part, or the split unavailable)."""
        split = device.type == "cuda" if self.attention_split is None else self.attention_split
        if lower is None or not split:
            return [0] * len(groups)
        starts = [min(lower[a], kl - 1) // MASK_ALIGNMENT * MASK_ALIGNMENT for a, _, kl in groups]
        work = max(1, self.split_min_work)
        starts = [c if c * (b - a) >= work else 0 for c, (a, b, _) in zip(starts, groups, strict=True)]
        if any(starts) and not self._split_attention_works(device, dtype):
            return [0] * len(groups)
        return starts

    def _attention_split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, c: int
    ) -> torch.Tensor:
        """`_attention_masked` of one group whose rows all see keys [0, c): those keys in one call
        without a mask (flash attention on CUDA in half precision), keys [c, n) under the mask's slice,
        joined by their log-sum-exps (`merge_attention`). Every row sees its own key, which is at c or
        past it, so neither part has a row with no key. K/V heads are expanded; `mask` is additive."""
        out_a, lse_a = attention_lse(q, k[:, :, :c], v[:, :, :c], None, self._scaling)
        out_b, lse_b = attention_lse(q, k[:, :, c:], v[:, :, c:], mask[:, c:], self._scaling)
        return merge_attention(out_a, lse_a, out_b, lse_b)

    def _split_attention_works(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether `_attention_split` gives `_attention_masked`'s result here, checked once per device,
        dtype and head shape on a small random group (on CUDA its kernels are SDPA's internal ops, whose
        signatures a torch release may change); False, with a warning, sends every group to the masked
        call."""
        if device.type != "cuda":
            return True
        key = (str(device), dtype, self._n_heads, self._head_dim)
        if key not in self._split_checked:
            self._split_checked[key] = self._check_split_attention(device, dtype)
        return self._split_checked[key]

    def _check_split_attention(self, device: torch.device, dtype: torch.dtype) -> bool:
        gen = torch.Generator().manual_seed(0)
        h, d, n, c = self._n_heads, self._head_dim, 3 * MASK_ALIGNMENT + 5, MASK_ALIGNMENT
        later = c + 1 + torch.randperm(n - c - 1, generator=gen)[:20].sort().values
        index = torch.cat([torch.tensor([c]), later])  # rows at c and after: each sees a key past c
        q, k, v = (torch.randn(1, h, m, d, generator=gen).to(device, dtype) for m in (index.numel(), n, n))
        mask = selected_rows_mask(index.to(device), n, dtype, additive=True)
        try:
            with without_cudnn_attention():
                want = self._attention_masked(q, k, v, mask)
                got = self._attention_split(q, k, v, mask, c)
            ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            why = "its result differs from the masked call's"
        except Exception as exc:  # an internal op missing or changed in this torch: no split, not a failure
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            log.warning(
                "block-causal split attention unavailable on %s %s (%s): masked calls only",
                device,
                dtype,
                why,
            )
        return ok

    def _attention_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention under an arbitrary mask (CacheBlend's scattered rows; see `selected_rows_mask`). On
        CUDA the caller holds `without_cudnn_attention`, so it runs on the memory-efficient kernel (flash
        takes no mask), over K/V heads already expanded to the query heads (that kernel has no grouped-
        query support): cuDNN's attention would build a new execution plan (tens of milliseconds) for
        every new number of selected rows, and the selection shrinks layer by layer. On a CPU grouped-query
        heads are taken as they are where torch can (`enable_gqa`), else expanded here."""
        kwargs: dict[str, Any] = {}
        if q.device.type != "cuda" and self._n_heads != self._n_kv:
            if _SDPA_GQA:
                kwargs["enable_gqa"] = True
            else:
                rep = self._n_heads // self._n_kv
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self._scaling, **kwargs)
