"""Token ids in, checked once: every entry point (restore, save, CacheBlend) takes them the same way.

They live here, below every layer that takes prompts, so the facade, the restore runs and CacheBlend
refuse bad input with the same words instead of three copies of the checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvrestore.core.errors import InvalidInputError

TokenIds = Sequence[int] | torch.Tensor


class TakesTokens(Protocol):
    """What the checks need of a compute backend (`ComputeBackend`; wrappers forward attributes)."""

    spec: Any

    def validate_tokens(self, tokens: torch.Tensor) -> None: ...


def as_token_tensor(token_ids: TokenIds) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor, a dense copy of what was given wherever it lived; an
    InvalidInputError naming the problem for anything else (text, floats, other shapes, a tensor with
    no data to read such as a meta tensor, a sparse or otherwise non-dense layout)."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidInputError("token_ids must be integer token ids, not text: tokenize first")
    if isinstance(token_ids, torch.Tensor):
        if token_ids.layout != torch.strided or token_ids.is_nested or token_ids.is_quantized:
            raise InvalidInputError(f"token_ids must be a dense tensor, got layout {token_ids.layout}")
        if token_ids.is_meta:
            raise InvalidInputError("token_ids is a meta tensor: it has no ids to read")
    try:
        return _dense_ids(token_ids)
    except (TypeError, ValueError, RuntimeError, NotImplementedError, OverflowError) as exc:
        if isinstance(exc, InvalidInputError):
            raise
        raise InvalidInputError(
            f"token_ids must be a sequence of integers: {type(exc).__name__}: {exc}"
        ) from None


def _dense_ids(token_ids: TokenIds) -> torch.Tensor:
    """`as_token_tensor` past its type checks (any failure of torch here is the input's)."""
    t = torch.as_tensor(token_ids)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InvalidInputError(f"token_ids must be 1-D (or [1, n]), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise InvalidInputError("token_ids is empty: nothing to restore")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise InvalidInputError(f"token_ids must be integers, got {t.dtype}")
    if t.dtype == torch.uint64:  # ids of 2**63 and more would wrap around to negative int64s
        wrapped = t.view(torch.int64) < 0
        if bool(wrapped.any()):
            bad = int(t.view(torch.int64)[wrapped][0]) + (1 << 64)
            raise InvalidInputError(f"token id {bad} is outside any vocabulary")
    return t.to(device="cpu", dtype=torch.int64)


def model_tokens(backend: TakesTokens, token_ids: TokenIds) -> torch.Tensor:
    """`as_token_tensor`, then the backend's own check (ids inside its vocabulary)."""
    tokens = as_token_tensor(token_ids)
    backend.validate_tokens(tokens)
    return tokens


def optional_tokens(backend: TakesTokens, token_ids: TokenIds | None) -> torch.Tensor:
    """Validated tokens, or an empty tensor for None / an empty sequence."""
    if token_ids is None:
        return torch.zeros(0, dtype=torch.int64)
    with contextlib.suppress(TypeError):  # no length: as_token_tensor says what is wrong
        if len(token_ids) == 0:
            return torch.zeros(0, dtype=torch.int64)
    return model_tokens(backend, token_ids)


def check_length(backend: TakesTokens, n_tokens: int, what: str = "the prompt") -> None:
    """Refuse more tokens than the model's context (the backend's `context_length`, if it has one)."""
    limit = getattr(backend, "context_length", None)
    if limit is not None and n_tokens > limit:
        raise InvalidInputError(
            f"{what} has {n_tokens} tokens, more than {backend.spec.name} takes: its context is {limit} "
            "tokens (max_position_embeddings)"
        )
