"""ComputeBackend: what the engine needs from a model, nothing more."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec


@runtime_checkable
class ComputeBackend(Protocol):
    """A model the engine can prefill a token range with, one chunk or one layer at a time.

    Tensors follow the KV layout of `kvrestore.core.kv`: past KV is [L, 2, H, P, D] (keys after RoPE),
    hidden states are [1, T, hidden]. Batch size is 1: a restore is one prompt.

    Optional: `prefill_into(tokens, cache, start)` (see `PrefillsInto`), which computes a token range
    straight into a KVCache's buffer. The restorer uses it when a backend has it, else `prefill_chunk`
    and a copy into the cache. A wrapper that intercepts `prefill_chunk` (to count or slow units) and
    forwards other attributes must intercept `prefill_into` too.
    """

    spec: ModelSpec
    device: torch.device

    def prefill_chunk(self, tokens: torch.Tensor, past: torch.Tensor | None, start: int) -> KVChunk:
        """KV of `tokens` placed at positions [start, start + len(tokens)), given the KV of [0, start)."""
        ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [1, T, hidden] of token ids [T]."""
        ...

    def run_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer: returns (hidden out, K [H, T, D], V [H, T, D]) for the new tokens."""
        ...

    def validate_tokens(self, tokens: torch.Tensor) -> None:
        """Raise InvalidInputError when a token id is outside the vocabulary."""
        ...


@runtime_checkable
class PrefillsInto(Protocol):
    """The optional in-place prefill of a ComputeBackend (`HFBackend` has it)."""

    def prefill_into(
        self, tokens: torch.Tensor, cache: torch.Tensor, start: int, *, logits: bool = False
    ) -> torch.Tensor | None:
        """Compute `tokens` at positions [start, end) into `cache` [L, 2, H, N, D] (N >= end).

        `cache[:, :, :, :start]` already holds the KV of the tokens before (it is read, never written);
        each layer's new K (after RoPE) and V go to `cache[layer, :, :, start:end]` and the new tokens
        attend over `cache[layer, :, :, :end]` -- no copy of the past. Returns the last token's logits
        ([vocab], float32) when `logits` is set, else None. Raises InvalidInputError when the cache does
        not fit (wrong shape, dtype or device, or fewer than `end` tokens).
        """
        ...
