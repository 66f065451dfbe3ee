"""KV containers.

Both hold one tensor laid out [layers, 2 (K, V), kv_heads, tokens, head_dim], keys stored after RoPE (as
transformers stores them). `KVChunk` is the KV of one token range; `KVCache` is a preallocated buffer for
a whole prompt that chunks are written into in any order (the two-pointer restores fill it from both
ends); which chunks are in place is the engine's business (`policies.Progress`), not the buffer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.spec import ModelSpec


@dataclass
class KVChunk:
    """KV of tokens [start, start + n_tokens) for every layer."""

    start: int
    data: torch.Tensor  # [L, 2, H, T, D]

    @property
    def n_tokens(self) -> int:
        return int(self.data.shape[3])

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of layer i, each [H, T, D]."""
        return self.data[i, 0], self.data[i, 1]


@dataclass
class KVCache:
    """KV of a whole prompt, assembled chunk by chunk."""

    spec: ModelSpec
    data: torch.Tensor  # [L, 2, H, N, D]

    @classmethod
    def empty(cls, spec: ModelSpec, n_tokens: int, device: torch.device | str = "cpu") -> KVCache:
        data = torch.empty(
            (spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim), dtype=spec.dtype, device=device
        )
        return cls(spec, data)

    @property
    def n_tokens(self) -> int:
        return int(self.data.shape[3])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, chunk: KVChunk) -> None:
        """Copy a chunk into its token range."""
        if chunk.end > self.n_tokens or chunk.start < 0:
            raise InvalidInputError(
                f"chunk [{chunk.start}, {chunk.end}) outside cache of {self.n_tokens} tokens"
            )
        if (
            tuple(chunk.data.shape[:3]) != tuple(self.data.shape[:3])
            or chunk.data.shape[4] != self.data.shape[4]
        ):
            raise InvalidInputError(
                f"chunk shape {tuple(chunk.data.shape)} does not fit cache {tuple(self.data.shape)}"
            )
        self.data[:, :, :, chunk.start : chunk.end].copy_(chunk.data, non_blocking=True)

    def prefix(self, n_tokens: int) -> torch.Tensor:
        """View of the KV of tokens [0, n_tokens): [L, 2, H, n, D]."""
        return self.data[:, :, :, :n_tokens]

    def chunk(self, start: int, end: int) -> KVChunk:
        """A view of tokens [start, end) as a chunk (no copy); writing to it writes the cache."""
        return KVChunk(start, self.data[:, :, :, start:end])

    def fits(self, spec: ModelSpec, n_tokens: int) -> bool:
        """Whether this buffer can hold `n_tokens` of KV for `spec` (to reuse it for another restore)."""
        return (
            self.spec.fingerprint == spec.fingerprint
            and self.data.dtype == spec.dtype
            and self.n_tokens >= n_tokens
        )

    def head(self, n_tokens: int) -> KVCache:
        """The first `n_tokens` as a KVCache sharing this buffer."""
        return self if n_tokens == self.n_tokens else KVCache(self.spec, self.data[:, :, :, :n_tokens])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of layer i, each [H, N, D]."""
        return self.data[i, 0], self.data[i, 1]

    def to_hf(self, config: Any | None = None, n_tokens: int | None = None) -> Any:
        """A transformers `DynamicCache` holding this KV (batch 1), ready for `model.generate()`.

        `n_tokens` keeps only the first n tokens (generate() needs at least one uncached input token).
        The cache holds copies: generation appends to it without touching this buffer.
        """
        n = self.n_tokens if n_tokens is None else n_tokens
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=config) if config is not None else DynamicCache()
        except TypeError:  # older transformers without the config argument
            cache = DynamicCache()
        for i in range(self.spec.num_layers):
            k, v = self.layer(i)
            cache.update(k[None, :, :n].clone(), v[None, :, :n].clone(), i)
        return cache

    @classmethod
    def from_hf(cls, spec: ModelSpec, cache: Any) -> KVCache:
        """Build from a transformers cache (batch 1), e.g. the `past_key_values` of a full prefill."""
        layers = []
        for i in range(spec.num_layers):
            layer = cache.layers[i] if hasattr(cache, "layers") else None
            k, v = (layer.keys, layer.values) if layer is not None else cache[i][:2]
            layers.append(torch.stack([k[0], v[0]]))
        return cls(spec, torch.stack(layers).to(spec.dtype))


def buffer_problem(spec: ModelSpec, data: object) -> str | None:
    """What stops a restore writing the KV of `spec` into `data` in place ([L, 2, H, N, D] for any N), or
    None: not a dense strided tensor of the model's dtype, another shape, a tensor that records
    gradients, rows of a head that do not lie back to back (a transposed view), or elements that share
    memory (an `expand()`). Every lane writes a buffer that passes, by copies and byte views."""
    if not isinstance(data, torch.Tensor):
        return f"its data must be a torch.Tensor, got {type(data).__name__}"
    if data.layout != torch.strided or data.is_quantized:
        return f"its data must be a dense tensor, got layout {data.layout}"
    if data.dtype != spec.dtype:
        return f"its data is {data.dtype}; the model's KV is {spec.dtype}"
    want = (spec.num_layers, 2, spec.num_kv_heads)
    shape = tuple(data.shape)
    if data.dim() != 5 or shape[:3] != want or shape[4] != spec.head_dim:
        return (
            f"its data has shape {shape}; the model's KV is [layers, 2, kv_heads, tokens, head_dim] = "
            f"[{', '.join(map(str, want))}, N, {spec.head_dim}]"
        )
    if data.requires_grad:
        return "its data requires grad: a restore writes it in place (pass a tensor made under no_grad)"
    strides = data.stride()
    if (shape[4] > 1 and strides[4] != 1) or (shape[3] > 1 and strides[3] != shape[4]):
        return (
            f"its data has strides {strides}: each head's token rows must lie back to back (a transposed "
            "view cannot be written in place; pass .contiguous() or KVCache.empty)"
        )
    extent = shape[3] * shape[4]  # elements of one head's rows
    for stride, size in sorted((st, s) for s, st in zip(shape[:3], strides[:3], strict=True) if s > 1):
        if stride < extent:
            return f"its data has strides {strides}: elements share memory (an expand() cannot be written)"
        extent = stride * size
    return None
