"""ComputeBackend: what the engine needs from a model, nothing more."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .kv import KVChunk
from .spec import ModelSpec


@runtime_checkable
class ComputeBackend(Protocol):
    """A model the engine can prefill a token range with, one chunk or one layer at a time.

    Tensors follow the KV layout of `kvrestore.kv`: past KV is [L, 2, H, P, D] (keys after RoPE),
    hidden states are [1, T, hidden]. Batch size is 1: a restore is one prompt.
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
