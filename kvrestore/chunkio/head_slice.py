"""A rank's share of a chunk as a destination: the heads of a part that a rank's pages hold.

A reader of another layout than the writer's (`chunkio.parts`) reads each stored part that overlaps its
heads. Where the part holds some of the rank's heads (tp 1 reading tp 2's parts), its layers go into
those heads' slice of the pages (`sliced`: views, nothing copied). Where it holds more heads than the
rank (tp 2 reading tp 1's whole chunks), the destination takes the rank's heads only
(`page_dest.KeptSections` with `heads`): of a chunk with per-head checks (format 6, `codec.heads`) the
reader reads just their bytes, each head verified; of another, the sections whole, cut to the heads.
"""

from __future__ import annotations

import dataclasses

from kvrestore.chunkio.pages import PagedCache

Span = tuple[int, int]


def sliced(paged: PagedCache, heads: Span) -> PagedCache:
    """`paged` with only heads [a, b) of each layer (strided views of the same pages)."""
    a, b = heads
    return dataclasses.replace(paged, k=[k[:, a:b] for k in paged.k], v=[v[:, a:b] for v in paged.v])
