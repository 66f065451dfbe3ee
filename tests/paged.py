"""vLLM's paged layouts as the tests read and write them: tokens of one or more layers of a paged cache
(`layouts.kv_views`, then `chunkio.pages`' gather and scatter)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrestore.chunkio.pages import gather, scatter
from kvrestore.integrations.vllm.layouts import kv_views


def gather_chunk(
    caches: Sequence[torch.Tensor],
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    end: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Tokens [start, end) of every layer in `caches` as one ``[L, 2, H, T, D]`` tensor (`pages.gather`)."""
    return gather([kv_views(c, layout, num_kv_heads, head_dim) for c in caches], block_ids, start, end)


def gather_tokens(
    cache: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    end: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Tokens [start, end) of one layer of a paged cache as a new ``[2, H, T, D]`` tensor on its device."""
    return gather_chunk([cache], layout, block_ids, start, end, num_kv_heads, head_dim)[0]


def scatter_tokens(
    cache: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    data: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Write `data` (``[2, H, T, D]``) as tokens [start, start + T) of one layer of a paged cache
    (`pages.scatter`)."""
    scatter(*kv_views(cache, layout, num_kv_heads, head_dim), block_ids, start, data)
