"""The writer's layout of a native section's keys (`header.key_tile`): what lets a reader whose cache keeps
its keys as the writer's did copy each section once, straight from the store into its pages.

A native section is the ``[2, H, T, D]`` tensor's bytes: K, then V, each head's tokens row-major. vLLM's
CPU pages keep a page's keys of one head column-major (``[D, block_size]``), so the vLLM connector on a
CPU stores its keys so too: per head ``[T / tile, D, tile]``, `tile` its page size, the values as
always (`TiledHeader`). Its host-page load then reads a chunk's keys and values into the pages with one
`preadv`; every other reader (a `Restorer`, a layer read, another page size, a GPU layout) converts the
keys on read, with one strided copy where it would have copied them anyway. Both checksums cover the
bytes as stored, so every reader verifies what it read before converting it.
"""

from __future__ import annotations

import numpy as np
import torch

from kvrestore.core.errors import InvalidInputError

Buffer = bytes | bytearray | memoryview

#: same-sized integer types, to copy any KV dtype (bfloat16 included) through numpy
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tile_keys(dense: torch.Tensor, tile: int) -> torch.Tensor:
    """`dense` (``[L, 2, H, T, D]``, row-major keys) as it is stored with keys in tiles of `tile` tokens
    (a new contiguous tensor). On the host the copies are numpy's, on one thread (torch's would spread
    over the cores a serving engine's compute threads are pinned to)."""
    out = torch.empty_like(dense, memory_format=torch.contiguous_format)
    keys = stored_keys(out[:, 0], tile)
    rows = dense[:, 0].unflatten(-2, (-1, tile))
    if dense.device.type != "cpu":
        out[:, 1] = dense[:, 1]
        keys.copy_(rows)
        return out
    ints = INT_OF_SIZE[dense.element_size()]
    np.copyto(out[:, 1].view(ints).numpy(), dense[:, 1].view(ints).numpy())
    np.copyto(keys.view(ints).numpy(), rows.view(ints).numpy())
    return out


def stored_keys(keys: torch.Tensor, tile: int) -> torch.Tensor:
    """The keys of sections as stored in tiles (`keys`: ``[..., H, T, D]`` over the stored bytes, each
    head's ``T * D`` contiguous) as a view ``[..., H, T / tile, tile, D]``: token-major, as a reader
    indexes them."""
    *lead, T, D = keys.shape
    return keys.view(*lead, T // tile, D, tile).transpose(-1, -2)


def place_rows(dst: torch.Tensor, src: torch.Tensor, tile: int) -> None:
    """Copy sections as stored (`src`: ``[..., 2, H, T, D]`` over their bytes) to `dst` (the same shape,
    any strides, row-major keys), on their device: one copy, the keys' a strided one where tiled."""
    if not tile:
        dst.copy_(src)
        return
    dst.select(-4, 1).copy_(src.select(-4, 1))
    dst.select(-4, 0).unflatten(-2, (-1, tile)).copy_(stored_keys(src.select(-4, 0), tile))


def host_tiles(keys: np.ndarray, tile: int) -> np.ndarray:
    """`stored_keys` for a host array: keys stored in tiles (``[..., H, T, D]`` over the stored bytes) as a
    view ``[..., H, T / tile, tile, D]``, token-major."""
    *lead, T, D = keys.shape
    return keys.reshape(*lead, T // tile, D, tile).swapaxes(-1, -2)


def place_host_rows(dst: np.ndarray, src: np.ndarray, tile: int) -> None:
    """`place_rows` for host arrays (numpy: one thread, the GIL released), `dst` a view of a cache."""
    if not tile:
        np.copyto(dst, src)
        return
    np.copyto(dst[..., 1, :, :, :], src[..., 1, :, :, :])
    T, D = src.shape[-2:]
    tiles = host_tiles(src[..., 0, :, :, :], tile)
    out = dst[..., 0, :, :, :]
    # split dst's token axis in place (a view, whatever its strides): [..., H, T / tile, tile, D]
    strides = (*out.strides[:-2], out.strides[-2] * tile, out.strides[-2], out.strides[-1])
    view = np.lib.stride_tricks.as_strided(
        out, (*out.shape[:-2], T // tile, tile, D), strides, writeable=True
    )
    np.copyto(view, tiles)


def byte_tensor(data: Buffer) -> torch.Tensor:
    """A host uint8 tensor over `data`: a view, or a copy where the bytes are read-only (torch refuses
    to view read-only memory without a warning)."""
    view = memoryview(data)
    return torch.frombuffer(view if not view.readonly else bytearray(view), dtype=torch.uint8)


def cpu_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Where a decode writes: `out` if given (checked: `shape`, `dtype`, on the CPU), else a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu":
        raise InvalidInputError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}, need {shape} {dtype} on cpu"
        )
    return out


def copy_bytes(dst: torch.Tensor, data: Buffer, key_tile: int = 0) -> None:
    """Copy raw tensor bytes (`dst`'s dtype and shape, C order) into `dst`, which may be strided; with
    `key_tile`, `data` is sections (`dst`: ``[..., 2, H, T, D]``) whose keys are stored in tiles
    (`codec.layout`), turned row-major on the way.

    One copy, outside the GIL, from the bytes as they are, read-only ones included (a store's `bytes`):
    on the CPU through numpy views of both sides; elsewhere through a host tensor over the bytes.
    """
    if dst.device.type == "cpu":
        host = dst.view(INT_OF_SIZE[dst.element_size()]).numpy()  # any KV dtype, bfloat16 included
        place_host_rows(host, np.frombuffer(data, host.dtype).reshape(dst.shape), key_tile)
        return
    place_rows(dst, byte_tensor(data).view(dst.dtype).view(dst.shape), key_tile)


__all__ = [
    "INT_OF_SIZE",
    "byte_tensor",
    "copy_bytes",
    "cpu_out",
    "host_tiles",
    "place_host_rows",
    "place_rows",
    "stored_keys",
    "tile_keys",
]
