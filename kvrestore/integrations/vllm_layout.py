"""vLLM's paged KV caches <-> kvrestore's chunk layout: pure tensor functions, no vLLM needed.

kvrestore keeps one layer of a chunk as ``[2, H, T, D]`` (K then V, tokens contiguous per head). vLLM keeps
a layer as pages of `block_size` tokens; a request's token t lives in block ``block_ids[t // block_size]``
at offset ``t % block_size``. The layouts handled:

* ``"standard"``: vLLM >= 0.12 (RFC #42082), every backend, CPU and CUDA: the per-layer tensor a connector
  gets is the logical view ``[num_blocks, H, block_size, 2 * D]``, K and V side by side in the last
  dimension. Its strides may be anything (FlashAttention's NHD pages are ``[B, N, H, C]`` in memory, the
  CPU backend's ``[B, H, N, C]``): indexing goes through the view, so both work.
* ``"flash_attn"``: older CUDA FlashAttention, ``[2, num_blocks, block_size, H, D]``.
* ``"flashinfer_nhd"``: older FlashInfer, ``[num_blocks, 2, block_size, H, D]``.
* ``"flashinfer_hnd"``: older FlashInfer with the HND layout, ``[num_blocks, 2, H, block_size, D]``.

Every layout is first viewed (never copied) as ``[2, num_blocks, H, block_size, D]``; `gather_tokens` and
`scatter_tokens` then index that view.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidInputError

LAYOUTS = ("standard", "flash_attn", "flashinfer_nhd", "flashinfer_hnd")


def canonical_view(cache: torch.Tensor, layout: str, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """`cache` (one layer) as a ``[2, num_blocks, H, block_size, D]`` view of the same memory."""
    H, D = num_kv_heads, head_dim
    if layout == "standard":
        if cache.dim() != 4 or cache.shape[1] != H or cache.shape[3] != 2 * D:
            raise InvalidInputError(
                f"a standard vLLM layer is [blocks, {H}, block_size, {2 * D}], got {_shape(cache)}"
            )
        nb, _, bs, _ = cache.shape
        # split the last dim in two without copying: [B, H, N, 2, D] -> [2, B, H, N, D]
        return cache.unflatten(3, (2, D)).permute(3, 0, 1, 2, 4)
    if layout == "flash_attn":
        if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != (H, D):
            raise InvalidInputError(
                f"a flash_attn layer is [2, blocks, block_size, {H}, {D}], got {_shape(cache)}"
            )
        return cache.permute(0, 1, 3, 2, 4)
    if layout == "flashinfer_nhd":
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[3:] != (H, D):
            raise InvalidInputError(
                f"a flashinfer_nhd layer is [blocks, 2, block_size, {H}, {D}], got {_shape(cache)}"
            )
        return cache.permute(1, 0, 3, 2, 4)
    if layout == "flashinfer_hnd":
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[2] != H or cache.shape[4] != D:
            raise InvalidInputError(
                f"a flashinfer_hnd layer is [blocks, 2, {H}, block_size, {D}], got {_shape(cache)}"
            )
        return cache.permute(1, 0, 2, 3, 4)
    raise InvalidInputError(f"unknown paged layout {layout!r}; use one of {LAYOUTS}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def block_size_of(cache: torch.Tensor, layout: str, num_kv_heads: int, head_dim: int) -> int:
    return int(canonical_view(cache, layout, num_kv_heads, head_dim).shape[3])


def _slots(
    block_ids: Sequence[int] | torch.Tensor, start: int, end: int, block_size: int, device: torch.device
):
    """(block index, offset) tensors of tokens [start, end) of a request with pages `block_ids`."""
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    if start < 0 or end < start:
        raise InvalidInputError(f"bad token range [{start}, {end})")
    need = -(-end // block_size)
    if need > len(blocks):
        raise InvalidInputError(
            f"tokens [{start}, {end}) need {need} blocks of {block_size}, the request has {len(blocks)}"
        )
    t = torch.arange(start, end, dtype=torch.long)
    return blocks[t // block_size].to(device), (t % block_size).to(device)


def gather_tokens(
    cache: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    end: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Tokens [start, end) of one layer of a paged cache as a new ``[2, H, T, D]`` tensor (kvrestore's
    section layout), on the cache's device."""
    view = canonical_view(cache, layout, num_kv_heads, head_dim)
    b, o = _slots(block_ids, start, end, int(view.shape[3]), view.device)
    # two advanced indices around a slice: the indexed dim comes first -> [T, 2, H, D]
    return view[:, b, :, o, :].permute(1, 2, 0, 3).contiguous()


def scatter_tokens(
    cache: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    data: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Write `data` (``[2, H, T, D]``) as tokens [start, start + T) of one layer of a paged cache, in place."""
    view = canonical_view(cache, layout, num_kv_heads, head_dim)
    if data.dim() != 4 or data.shape[0] != 2 or data.shape[1] != num_kv_heads or data.shape[3] != head_dim:
        raise InvalidInputError(f"data must be [2, {num_kv_heads}, T, {head_dim}], got {_shape(data)}")
    n = int(data.shape[2])
    b, o = _slots(block_ids, start, start + n, int(view.shape[3]), view.device)
    view[:, b, :, o, :] = data.permute(2, 0, 1, 3).to(device=view.device, dtype=view.dtype)


def blocks_of(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The pages holding tokens [start, end)."""
    if end <= start:
        return []
    return [int(b) for b in block_ids[start // block_size : -(-end // block_size)]]
