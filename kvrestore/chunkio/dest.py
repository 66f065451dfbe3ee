"""Where a `LayerReader`'s verified sections go (`chunkio.layers`): the reader fetches, verifies and says
which chunks of which layers are good; a destination says where each chunk's rows lie and what placing
them means. A reader is given one, never subclassed.

* `CacheRows` (the default): a `KVCache`'s rows, chunk j's tokens of layer l at row l and the chunk's
  token range; with `per_read`, a cache that holds the layers of one read only (the read's first layer
  at row 0: the vLLM connector's device buffer of one read).
* `vllm_load.KeptSections`: each verified section kept as read, for the vLLM connector's host load to
  write into its pages.
* `blend.chunks.RotatedRows`: a cache's rows, the keys of chunks placed elsewhere than where they were
  saved re-rotated once placed (CacheBlend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvrestore import codec
from kvrestore.core.kv import KVCache

if TYPE_CHECKING:
    from kvrestore.chunkio.layers import LayerReader


class Destination(Protocol):
    """What a `LayerReader` places sections through."""

    def rows(self, layers: range, start: int, n_tokens: int, kv: KVCache) -> torch.Tensor:
        """Tokens [start, start + n_tokens) of `layers` in `kv`: ``[len(layers), 2, H, n, D]``."""
        ...

    def place(
        self, reader: LayerReader, layers: range, j: int, data: bytes | memoryview, kv: KVCache
    ) -> None:
        """Verify chunk j's sections of `layers` (`data`: their span, `codec.layer_span`) and place them
        (blocking; the host path). Raises a ChunkDecodeError where they are damaged."""
        ...

    def placed(self, reader: LayerReader, layers: range, chunks: Sequence[int], kv: KVCache) -> None:
        """`chunks`' sections of `layers` are verified and in place (on the upload stream for a CUDA
        cache)."""
        ...


class CacheRows:
    """A `KVCache`'s rows: layer l at row l (`per_read`: the read's first layer at row 0)."""

    def __init__(self, per_read: bool = False) -> None:
        self.per_read = per_read

    def rows(self, layers: range, start: int, n_tokens: int, kv: KVCache) -> torch.Tensor:
        first = 0 if self.per_read else layers.start
        return kv.data[first : first + len(layers), :, :, start : start + n_tokens]

    def place(
        self, reader: LayerReader, layers: range, j: int, data: bytes | memoryview, kv: KVCache
    ) -> None:
        """Verify and decode the sections straight into their rows of a CPU cache (one copy each)."""
        header, chunk = reader.headers[j], reader.chunks[j]
        out = self.rows(layers, chunk.offset, chunk.n_tokens, kv)
        sections = codec.span_sections(header, layers, data)
        codec.decode_layers(header, sections, reader.spec, list(layers), out=out, seal=reader.seal)

    def placed(self, reader: LayerReader, layers: range, chunks: Sequence[int], kv: KVCache) -> None:
        """Nothing more to do: the rows are the KV."""
