"""Where a `LayerReader`'s verified sections go (`chunkio.layers`): the reader fetches, verifies and says
which chunks of which layers are good; a destination says where each chunk's rows lie and what placing
them means. A reader is given one, never subclassed.

* `CacheRows` (the default): a `KVCache`'s rows, chunk j's tokens of layer l at row l and the chunk's
  token range (`ChunkRef.offset`); with `per_read`, a cache that holds the layers of one read only (the
  read's first layer at row 0: a device buffer a read lands in before its rows go to pages).
* `blend.chunks.RotatedRows`: a cache's rows, the keys of chunks placed elsewhere than where they were
  saved re-rotated once placed (CacheBlend).
* an engine's pages (`page_dest`): the sections kept as read, or rows from a device buffer, written
  into the request's pages layer by layer; and `host_pages.HostPages`, which the reader fills straight
  from the store (`Lands`: the bytes read into the pages, verified where they landed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

from kvrestore import codec
from kvrestore.core.kv import KVCache

if TYPE_CHECKING:
    from kvrestore.chunkio.layers import LayerReader


class Destination(Protocol):
    """What a `LayerReader` places sections through. One that has a `heads` attribute, a span [a, b),
    takes only those heads of each chunk (`page_dest.KeptSections`): the reader then reads only their
    bytes of a chunk with per-head checks (`LayerReader.by_head`), and hands them to `place` as the
    native sections of b - a heads, each head to be verified there (`codec.check_heads`)."""

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


class Landing(NamedTuple):
    """Where a read of one chunk's span lands (`Lands`): `buffers`, filled in order by one scatter read of
    the span; `sections`, each layer's section among them as its parts in order (what is verified)."""

    buffers: list[memoryview]
    sections: list[list[memoryview]]


@runtime_checkable
class Lands(Protocol):
    """A destination the reader fills straight from a store that reads without the event loop
    (`ChunkStore.reads_sync`), on the caller's thread (`LayerReader.read_layers_sync`): the bytes go where
    they are used with one scatter read, and are verified there before they count as placed."""

    def landing(self, reader: LayerReader, layers: range, j: int) -> Landing:
        """Where chunk j's span of `layers` goes (a ChunkDecodeError where it cannot go there)."""
        ...

    def landed(self, reader: LayerReader, layers: range, j: int) -> None:
        """Chunk j's span of `layers` is read and verified where it landed: finish placing it."""
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
