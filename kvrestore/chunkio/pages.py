"""A paged KV cache, as a serving engine keeps one, and moving tokens between it and chunk rows.

A request's token t lives in page ``block_ids[t // block_size]`` at ``t % block_size``. Each layer is
seen as two views, K and V, each ``[num_blocks, H, block_size, D]`` over the engine's own memory (any
strides: how an engine lays its pages out is the integration's business, `integrations.vllm.layouts`).
`scatter` writes a chunk's rows ``[2, H, T, D]`` into pages, `gather` reads tokens of every layer out of
them (what a save copies), and an fp8 cache (one byte an element, with a K and a V scale per layer)
holds fp8 chunks' values as they are (`fp8_sections`, `fp8_values`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvrestore.codec.layout import INT_OF_SIZE
from kvrestore.codec.quant import Encoding
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.streams import upload

#: (block id, first and last offset in it, first token of the data) of each page of a token range
Page = tuple[int, int, int, int]


@dataclass(frozen=True)
class PagedCache:
    """An engine's paged KV cache: per layer its K and V views ``[num_blocks, H, block_size, D]``, and an
    fp8 cache's (K, V) scale of each layer (``[L, 2]`` bfloat16, `fp8_layer_scales`; None otherwise)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    scales: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return int(self.k[0].shape[2])

    @property
    def device(self) -> torch.device:
        return self.k[0].device


def pages_of(block_ids: Sequence[int] | torch.Tensor, start: int, end: int, block_size: int) -> Iterator[Page]:
    """The pages of tokens [start, end) (`Page`), in token order."""
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


def blocks_of(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The pages holding tokens [start, end)."""
    if end <= start:
        return []
    return [int(b) for b in block_ids[start // block_size : -(-end // block_size)]]


def _page_index(pages: list[Page], device: torch.device) -> torch.Tensor:
    """The block ids of `pages` as an index on `device` (through pinned memory: no host wait)."""
    return upload(torch.tensor([block for block, _, _, _ in pages], dtype=torch.int64), device)


def gather(
    views: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int] | torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Tokens [start, end) of every layer's (K, V) `views` as one ``[L, 2, H, T, D]`` tensor on their
    device (the last dimension contiguous; the rest may be a view of a padded buffer). Per layer one
    gather of the pages that hold them for K and one for V, then one copy for all layers: a copy per
    page and layer would be thousands of kernel launches per chunk on a GPU with 16-token pages."""
    k0 = views[0][0]
    _, H, bs, D = k0.shape
    pages = list(pages_of(block_ids, start, end, bs))
    ids = _page_index(pages, k0.device)
    by_page = torch.empty((len(views), 2, len(pages), H, bs, D), dtype=k0.dtype, device=k0.device)
    for i, kv in enumerate(views):
        for j, view in enumerate(kv):
            torch.index_select(view, 0, ids, out=by_page[i, j])
    by_head = torch.empty((len(views), 2, H, len(pages), bs, D), dtype=k0.dtype, device=k0.device)
    by_head.copy_(by_page.permute(0, 1, 3, 2, 4, 5))
    first = (start // bs) * bs
    return by_head.view(len(views), 2, H, len(pages) * bs, D)[:, :, :, start - first : end - first]


def copy_out(
    views: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int], start: int, end: int
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Tokens [start, end) of every layer (`gather`) in memory of their own, copied behind the work queued
    on the current stream, and the event a reader of them waits for: on CUDA they go to pinned memory
    and the host does not wait (None off CUDA, where the copy is done when this returns)."""
    data = gather(views, block_ids, start, end)
    if not data.is_cuda:
        return data.contiguous(), None
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data, non_blocking=True)  # padded pages cut on the device first
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(data.device))
    return host, ready


def scatter(
    k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, data: torch.Tensor
) -> None:
    """Write `data` (``[2, H, T, D]``) as tokens [start, start + T) of one layer's K and V views, in
    place, on the current stream.

    A host cache is written page by page through numpy: one single-threaded copy per page, K and V,
    with the GIL released. torch's copies split each page over its intra-op threads, whose barriers
    stall whenever another process holds one of the cores an engine pinned them to: on a shared 2-core
    host the same 180 MB took 0.4-3.6 s that way and 0.04-0.12 s this way. On a device, the whole pages
    go in one indexed copy for K and one for V, a partial first or last page in a copy of its own; host
    data goes up through pinned memory (from pageable memory the host would wait for the stream)."""
    H, D = int(k.shape[1]), int(k.shape[3])
    if data.dim() != 4 or data.shape[0] != 2 or data.shape[1] != H or data.shape[3] != D:
        raise InvalidInputError(f"data must be [2, {H}, T, {D}], got {list(data.shape)}")
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
    """`scatter` into K and V views `k`, `v` from `data` on their device."""
    _, num_kv_heads, _, head_dim = data.shape
    n, bs = int(data.shape[2]), int(k.shape[2])
    pages = list(pages_of(block_ids, start, start + n, bs))
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


def as_words(t: torch.Tensor) -> np.ndarray:
    """A numpy view of host tensor `t` (any strides) as same-sized integers: numpy has no bfloat16, and a
    copy of the bits is the copy of the values."""
    return t.view(INT_OF_SIZE[t.element_size()]).numpy()


def _scatter_host(
    k: torch.Tensor, v: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, data: torch.Tensor
) -> None:
    """`scatter` into host views `k`, `v` from host `data`."""
    kn, vn, dn = as_words(k), as_words(v), as_words(data)
    for block, a, b, at in pages_of(block_ids, start, start + int(data.shape[2]), int(k.shape[2])):
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
    """A loaded `page_dest.Piece` as an fp8 cache's values of one layer whose (K, V) scales are `scales`
    (bf16 [2]): uint8 ``[2, H, n, D]``. An fp8 chunk whose every scale is the layer's gives its values as
    they are (what an fp8 cache saved); any other is decoded and quantized with the layer's scales."""
    n, skip = piece.n_tokens, piece.skip
    if piece.encoding.name == "fp8":
        parts = piece.encoding.views(piece.data.view(1, -1), piece.stored_tokens)
        q, s = parts["q"][0], parts["scale"][0]  # [2, H, T, D] fp8, [2, H, T] bf16
        if torch.equal(s, scales.to(s.device).view(2, 1, 1).expand_as(s)):
            return q[:, :, skip : skip + n].view(torch.uint8)
    kv = piece.kv(device).float()
    limit = torch.finfo(torch.float8_e4m3fn).max
    q8 = (kv / scales.to(kv.device).float().view(2, 1, 1, 1)).clamp_(-limit, limit)
    return q8.to(torch.float8_e4m3fn).view(torch.uint8)
