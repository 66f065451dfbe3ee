"""vLLM's paged KV caches <-> kvrestore's chunk layout (``[2, H, T, D]`` a layer): tensor functions, no
vLLM needed. A request's token t lives in page ``block_ids[t // block_size]`` at ``t % block_size``:

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

Every layout is viewed (never copied) as K and V, each ``[num_blocks, H, block_size, D]`` (`kv_views`),
through which `gather_chunk` and `scatter_tokens` move whole pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvrestore.codec.quant import Encoding
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.streams import upload

LAYOUTS = ("cpu", "cuda", "flash_attn", "flashinfer_nhd", "flashinfer_hnd")


def kv_views(
    cache: torch.Tensor, layout: str, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cache` (one layer) as K and V views of the same memory, each ``[num_blocks, H, block_size, D]``."""
    H, D = num_kv_heads, head_dim
    if layout in ("cpu", "cuda"):
        if cache.dim() != 4 or cache.shape[1] != H or cache.shape[3] != 2 * D:
            raise InvalidInputError(
                f"a {layout} vLLM layer is [blocks, {H}, block_size, {2 * D}], got {_shape(cache)}"
            )
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
            raise InvalidInputError(
                f"a flash_attn layer is [2, blocks, block_size, {H}, {D}], got {_shape(cache)}"
            )
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    if layout == "flashinfer_nhd":
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[3:] != (H, D):
            raise InvalidInputError(
                f"a flashinfer_nhd layer is [blocks, 2, block_size, {H}, {D}], got {_shape(cache)}"
            )
        return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    if layout == "flashinfer_hnd":
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[2] != H or cache.shape[4] != D:
            raise InvalidInputError(
                f"a flashinfer_hnd layer is [blocks, 2, {H}, block_size, {D}], got {_shape(cache)}"
            )
        return cache[:, 0], cache[:, 1]
    raise InvalidInputError(f"unknown paged layout {layout!r}; use one of {LAYOUTS}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _pages(block_ids: Sequence[int] | torch.Tensor, start: int, end: int, block_size: int):
    """(block id, first and last offset in it, first token of data) for each page of tokens [start, end)."""
    if start < 0 or end < start:
        raise InvalidInputError(f"bad token range [{start}, {end})")
    need = -(-end // block_size)
    if need > len(block_ids):
        raise InvalidInputError(
            f"tokens [{start}, {end}) need {need} blocks of {block_size}, the request has {len(block_ids)}"
        )
    for p in range(start // block_size, need):
        lo, hi = max(start, p * block_size), min(end, (p + 1) * block_size)
        yield int(block_ids[p]), lo - p * block_size, hi - p * block_size, lo - start


def _page_index(pages: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
    """The block ids of `_pages`' pages as an index on `device` (through pinned memory: no host wait)."""
    return upload(torch.tensor([block for block, _, _, _ in pages], dtype=torch.int64), device)


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


def gather_chunk(
    caches: Sequence[torch.Tensor],
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    end: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Tokens [start, end) of every layer in `caches` as one ``[L, 2, H, T, D]`` tensor on their device
    (the last dimension contiguous; the rest may be a view of a padded buffer). Per layer one gather of
    the pages that hold them for K and one for V, then one copy for all layers: a copy per page and
    layer would be thousands of kernel launches per chunk on a GPU with 16-token pages."""
    H, D = num_kv_heads, head_dim
    k0, _ = kv_views(caches[0], layout, H, D)
    bs = int(k0.shape[2])
    pages = list(_pages(block_ids, start, end, bs))
    ids = _page_index(pages, k0.device)
    by_page = torch.empty((len(caches), 2, len(pages), H, bs, D), dtype=k0.dtype, device=k0.device)
    for i, cache in enumerate(caches):
        for j, view in enumerate(kv_views(cache, layout, H, D)):
            torch.index_select(view, 0, ids, out=by_page[i, j])
    by_head = torch.empty((len(caches), 2, H, len(pages), bs, D), dtype=k0.dtype, device=k0.device)
    by_head.copy_(by_page.permute(0, 1, 3, 2, 4, 5))
    first = (start // bs) * bs
    return by_head.view(len(caches), 2, H, len(pages) * bs, D)[:, :, :, start - first : end - first]


def scatter_tokens(
    cache: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    data: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Write `data` (``[2, H, T, D]``) as tokens [start, start + T) of one layer of a paged cache, in
    place, on the current stream.

    A host cache is written page by page through numpy: one single-threaded copy per page, K and V,
    with the GIL released. torch's copies split each page over its intra-op threads, whose barriers
    stall whenever another process holds one of the cores vLLM pinned them to: on a shared 2-core host
    the same 180 MB took 0.4-3.6 s that way and 0.04-0.12 s this way. On a device, the whole pages go
    in one indexed copy for K and one for V, a partial first or last page in a copy of its own; host
    data goes up through pinned memory (from pageable memory the host would wait for the stream)."""
    k, v = kv_views(cache, layout, num_kv_heads, head_dim)
    if data.dim() != 4 or data.shape[0] != 2 or data.shape[1] != num_kv_heads or data.shape[3] != head_dim:
        raise InvalidInputError(f"data must be [2, {num_kv_heads}, T, {head_dim}], got {_shape(data)}")
    data = data.to(dtype=k.dtype)
    if k.device.type == "cpu":
        _scatter_host(k, v, block_ids, start, data.cpu())
        return
    if data.device != k.device:
        data = upload(data.contiguous(), k.device)
    _scatter_device(k, v, block_ids, start, data)


def _scatter_device(
    k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, data: torch.Tensor
) -> None:
    """`scatter_tokens` into K and V views `k`, `v` from `data` on their device."""
    _, num_kv_heads, _, head_dim = data.shape
    n, bs = int(data.shape[2]), int(k.shape[2])
    pages = list(_pages(block_ids, start, start + n, bs))
    whole = [p for p in pages if p[2] - p[1] == bs]  # consecutive: only the first and last may be partial
    if len(whole) > 1:
        ids = _page_index(whole, k.device)
        at = whole[0][3]
        rows = data[:, :, at : at + len(whole) * bs]
        by_page = rows.reshape(2, num_kv_heads, len(whole), bs, head_dim).transpose(1, 2)  # [2, P, H, bs, D]
        k.index_copy_(0, ids, by_page[0])
        v.index_copy_(0, ids, by_page[1])
        pages = [p for p in pages if p[2] - p[1] != bs]
    for block, a, b, at in pages:
        k[block, :, a:b].copy_(data[0, :, at : at + b - a])
        v[block, :, a:b].copy_(data[1, :, at : at + b - a])


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of host tensor `t` as same-sized integers (numpy has no bfloat16; a copy of the
    bits is the copy of the values)."""
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _scatter_host(
    k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, data: torch.Tensor
) -> None:
    """`scatter_tokens` into host views `k`, `v` from host `data`."""
    kn, vn, dn = _numpy(k), _numpy(v), _numpy(data)
    for block, a, b, at in _pages(block_ids, start, start + int(data.shape[2]), int(k.shape[2])):
        np.copyto(kn[block, :, a:b], dn[0, :, at : at + b - a])
        np.copyto(vn[block, :, a:b], dn[1, :, at : at + b - a])


def fp8_layer_scales(scales: Sequence[tuple[float, float]]) -> torch.Tensor:
    """An fp8 cache's per-layer (K scale, V scale) as the fp8 encoding's scales hold them: [L, 2]
    bfloat16. A scale bfloat16 cannot hold exactly (vLLM's default 1.0 it can) is rounded: a reader of
    the stored chunk multiplies by that rounding (at most 2^-9 off), while the pages loaded back into an
    fp8 cache get the values as they were."""
    return torch.tensor([list(s) for s in scales], dtype=torch.float32).to(torch.bfloat16)


def fp8_sections(values: torch.Tensor, scales: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    """The fp8 encoding's sections (uint8 [L, section bytes]) holding an fp8 cache's gathered pages
    `values` (``[L, 2, H, T, D]``, one byte each) as they are, with each layer's K and V scale
    (`fp8_layer_scales`, ``[L, 2]``) as the scale of every token and head: no decode, no re-rounding."""
    if encoding.name != "fp8":
        raise InvalidInputError(f"an fp8 cache's pages are stored as fp8 chunks, not {encoding.name!r}")
    L, _, H, T, _ = values.shape
    out = torch.zeros((L, encoding.section_bytes(T)), dtype=torch.uint8, device=values.device)
    parts = encoding.views(out, T)
    parts["q"].view(torch.uint8).copy_(values.view(torch.uint8))
    parts["scale"].copy_(scales.to(values.device).view(L, 2, 1, 1).expand(L, 2, H, T))
    return out


def fp8_values(piece: Any, scales: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A loaded `load.Piece` as an fp8 cache's values of one layer whose (K, V) scales are `scales`
    (bf16 [2]): uint8 ``[2, H, n, D]``. An fp8 chunk whose every scale is the layer's gives its values as
    they are (what an fp8 cache saved); any other is decoded and quantized with the layer's scales."""
    n = piece.n_tokens
    if piece.encoding.name == "fp8":
        parts = piece.encoding.views(piece.data.view(1, -1), piece.stored_tokens)
        q, s = parts["q"][0], parts["scale"][0]  # [2, H, T, D] fp8, [2, H, T] bf16
        if torch.equal(s, scales.to(s.device).view(2, 1, 1).expand_as(s)):
            return q[:, :, :n].view(torch.uint8)
    kv = piece.kv(device).float()
    limit = torch.finfo(torch.float8_e4m3fn).max
    q8 = (kv / scales.to(kv.device).float().view(2, 1, 1, 1)).clamp_(-limit, limit)
    return q8.to(torch.float8_e4m3fn).view(torch.uint8)


def blocks_of(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The pages holding tokens [start, end)."""
    if end <= start:
        return []
    return [int(b) for b in block_ids[start // block_size : -(-end // block_size)]]
