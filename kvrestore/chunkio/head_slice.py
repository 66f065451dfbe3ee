"""A rank's share of a chunk as a destination: the heads and layers of a stored part that a rank's pages
hold.

A reader of another layout than the writer's (`chunkio.parts`) reads each stored part that overlaps its
heads and layers. Where the part holds some of the rank's heads (tp 1 reading tp 2's parts), its layers go
into those heads' slice of the pages (`sliced`: views, nothing copied). Where it holds more heads than the
rank (tp 2 reading tp 1's whole chunks), the destination takes the rank's heads only
(`page_dest.KeptSections` with `heads`): of a chunk with per-head checks (format 6, `codec.heads`) the
reader reads just their bytes, each head verified; of another, the sections whole, cut to the heads.
Where the part's layers are numbered from another first layer than the rank's (a pipeline stage reading
whole chunks, or whole layers reading a stage's part), each layer goes to the page layer of the same
model layer (`LayerShift`).
"""

from __future__ import annotations

import dataclasses

from kvrestore.chunkio.page_dest import Piece, Writes
from kvrestore.chunkio.pages import PagedCache

Span = tuple[int, int]


def sliced(paged: PagedCache, heads: Span) -> PagedCache:
    """`paged` with only heads [a, b) of each layer (strided views of the same pages)."""
    a, b = heads
    return dataclasses.replace(paged, k=[k[:, a:b] for k in paged.k], v=[v[:, a:b] for v in paged.v])


class LayerShift:
    """`writes` of the pages' layer `layer + shift` for the part's layer `layer`."""

    def __init__(self, writes: Writes, shift: int) -> None:
        self.writes, self.shift = writes, shift
        self.queues = writes.queues

    def put(self, layer: int, pieces: list[Piece]) -> None:
        self.writes.put(layer + self.shift, pieces)

    def flush(self, layer: int) -> None:
        self.writes.flush(layer + self.shift)
