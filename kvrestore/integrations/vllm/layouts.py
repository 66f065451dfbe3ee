"""vLLM's paged KV caches as K and V views (`kv_views`), which chunkio's page destinations and `pages`
move tokens through. A request's token t lives in page ``block_ids[t // block_size]`` at
``t % block_size``; vLLM's backends lay a layer's pages out so:

* ``"cpu"``: vLLM's CPU backend with its portable "vec" kernels (the ones it picks for fp32, and for
  bf16 without AMX; `cpu_attn.py`'s `_get_attn_isa`). The per-layer tensor is shaped
  ``[num_blocks, H, block_size, 2 * D]``, but each (page, head) holds all its keys, then all its values
  (the backend views it as ``[num_blocks, H, 2 * block_size, D]`` and splits it along the tokens), and
  the keys are stored column-major: ``[D, block_size]``, the values row-major ``[block_size, D]``
  (`csrc/cpu/cpu_attn_vec.hpp`, `reshape_and_cache`). So a slot's 2 * D "content" is not its K and V.
* ``"cuda"``: vLLM >= 0.12 (RFC #42082) FlashAttention and Triton backends: the logical view
  ``[num_blocks, H, block_size, 2 * D]`` with one token's K then V in the last dimension
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); its strides may be anything (NHD pages are
  ``[B, N, H, C]`` in memory): indexing goes through the view.
* ``"flash_attn"``: older CUDA FlashAttention, ``[2, num_blocks, block_size, H, D]``.
* ``"flashinfer_nhd"``: older FlashInfer, ``[num_blocks, 2, block_size, H, D]``.
* ``"flashinfer_hnd"``: older FlashInfer with the HND layout, ``[num_blocks, 2, H, block_size, D]``.

Every layout is viewed (never copied) as K and V, each ``[num_blocks, H, block_size, D]``.
"""

from __future__ import annotations

import torch

from kvrestore.core.errors import InvalidInputError, UnsupportedModelError
from kvrestore.stores.base import ChunkStore

LAYOUTS = ("cpu", "cuda", "flash_attn", "flashinfer_nhd", "flashinfer_hnd")


def kv_views(
    cache: torch.Tensor, layout: str, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cache` (one layer) as K and V views of the same memory, each ``[num_blocks, H, block_size, D]``."""
    H, D = num_kv_heads, head_dim
    shape = "[" + ", ".join(str(s) for s in cache.shape) + "]"
    if layout in ("cpu", "cuda"):
        if cache.dim() != 4 or cache.shape[1] != H or cache.shape[3] != 2 * D:
            raise InvalidInputError(f"a {layout} vLLM layer is [blocks, {H}, block_size, {2 * D}], got {shape}")
        nb, _, bs, _ = cache.shape
        if layout == "cuda":  # one token's K then V in the last dim
            return cache[..., :D], cache[..., D:]
        try:  # per (page, head): K as [D, bs], then V as [bs, D]
            halves = cache.view(nb, H, 2, bs * D)
        except RuntimeError as exc:
            raise InvalidInputError(f"a cpu vLLM layer must be contiguous within a page: {exc}") from None
        return halves[:, :, 0].unflatten(2, (D, bs)).transpose(2, 3), halves[:, :, 1].unflatten(2, (bs, D))
    if layout == "flash_attn":
        if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != (H, D):
            raise InvalidInputError(f"a flash_attn layer is [2, blocks, block_size, {H}, {D}], got {shape}")
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    if layout == "flashinfer_nhd":
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[3:] != (H, D):
            raise InvalidInputError(f"a flashinfer_nhd layer is [blocks, 2, block_size, {H}, {D}], got {shape}")
        return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    if layout == "flashinfer_hnd":
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[2] != H or cache.shape[4] != D:
            raise InvalidInputError(f"a flashinfer_hnd layer is [blocks, 2, {H}, block_size, {D}], got {shape}")
        return cache[:, 0], cache[:, 1]
    raise InvalidInputError(f"unknown paged layout {layout!r}; use one of {LAYOUTS}")


def detect_layout(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> str:
    """The layout of one layer of vLLM's cache, from its shape and device."""
    H, D = num_kv_heads, head_dim
    if cache.dim() == 4 and cache.shape[1] == H and cache.shape[3] == 2 * D:
        # the CPU backend keeps a page's keys, then its values; CUDA backends one token's K then V
        return "cpu" if cache.device.type == "cpu" else "cuda"
    if cache.dim() == 5 and cache.shape[0] == 2 and tuple(cache.shape[3:]) == (H, D):
        return "flash_attn"
    raise UnsupportedModelError(
        f"unknown vLLM KV cache layout {tuple(cache.shape)} for {H} heads of {D}; "
        "set kv_connector_extra_config['layout']"
    )


def applies(store: ChunkStore, layout: str, encoding: str, compression: str) -> bool:
    """Whether a load can go straight into the pages (`chunkio.host_pages`): vLLM's host layout, a store
    that reads without the event loop, chunks saved uncompressed in the native encoding."""
    return layout == "cpu" and store.reads_sync and encoding == "native" and compression == "none"
