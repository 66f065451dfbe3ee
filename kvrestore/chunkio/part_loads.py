"""A rank's share of a load where the chunks are stored in another layout than its own
(`chunkio.parts`): one `LayerLoad` a stored part that holds some of its heads and layers, each into its
own destination (`head_slice`), waited for and settled as one load (`PartLoads`, built by `share_loads`).

A token range fails where any part's chunk failed: the engine then recomputes it on every rank (vLLM
joins each worker's load errors), so a rank never keeps KV of two sources for one token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrestore.chunkio.head_slice import LayerShift, sliced
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import SectionPages, Writes
from kvrestore.chunkio.pages import PagedCache
from kvrestore.chunkio.parts import Layout, Part, part_ref, part_spec
from kvrestore.core.keys import ChunkRef
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.stores.base import ChunkStore


@dataclass(frozen=True)
class Share:
    """One part's load: it holds the rank's `layers` (the rank's own numbering), its layer l being the
    rank's layer l - `offset`."""

    load: LayerLoad
    layers: range
    offset: int


class PartLoads:
    """`shares` (over the same chunks and tokens) as one load."""

    def __init__(self, shares: Sequence[Share]) -> None:
        self.shares = list(shares)
        first = self.shares[0].load
        self.chunks, self.first, self.k = first.chunks, first.first, first.k
        self.here = any(load.here for load in self.loads)

    @property
    def loads(self) -> list[LayerLoad]:
        return [s.load for s in self.shares]

    def start(self, io: LoopThread, timeout: float | None = None) -> None:
        for load in self.loads:
            load.start(io, timeout)

    def wait(self, layer: int) -> bool:
        """Every load that holds the rank's `layer` waited for (each runs), True if all placed it."""
        return all([s.load.wait(layer + s.offset) for s in self.shares if layer in s.layers])

    def cancel(self, why: str) -> None:
        for load in self.loads:
            load.cancel(why)

    @property
    def failed(self) -> set[int]:
        return set().union(*(load.failed for load in self.loads))

    @property
    def errors(self) -> list[str]:
        return [e for load in self.loads for e in load.errors]

    @property
    def bytes_read(self) -> int:
        return sum(load.bytes_read for load in self.loads)

    @property
    def seconds(self) -> float | None:
        times = [load.seconds for load in self.loads]
        return None if None in times else max(t for t in times if t is not None)

    def failed_ranges(self) -> list[tuple[int, int]]:
        failed = [self.chunks[j] for j in sorted(self.failed)]
        return [(max(c.start, self.first), min(c.end, self.k)) for c in failed if c.start < self.k]


def share_loads(
    model: ModelSpec,
    mine: Part,
    layout: Layout,
    store: ChunkStore,
    chunks: Sequence[ChunkRef],
    k: int,
    paged: PagedCache,
    writes: Callable[[PagedCache], Writes],
    **options: Any,
) -> PartLoads:
    """The load of part `mine` of `chunks` (tokens [first, k), `LayerLoad`'s `options`) from their parts
    stored as `layout`, into `paged` (the rank's pages: `mine`'s heads and layers), through the `writes`
    made for a view of them: of each stored part that overlaps `mine`, the overlap's layers only, into
    its heads' slice of the pages (`sliced`), cut to them where the part holds more heads (`SectionPages`
    with `heads`: read by head where the part has per-head checks),
    each layer to the page layer of the same model layer (`LayerShift`)."""
    (a, b), (m0, m1) = mine.heads, mine.layers
    shares = []
    for p in layout:
        (pa, pb), (p0, p1) = p.heads, p.layers
        ha, hb, la, lb = max(a, pa), min(b, pb), max(m0, p0), min(m1, p1)
        if ha >= hb or la >= lb:
            continue
        out: Writes = writes(sliced(paged, (ha - a, hb - a)))
        # where the part holds more heads than the rank, its only: just their bytes where the part has
        # per-head checks (`SectionPages` with `heads`), else its sections whole, cut to them
        heads = (ha - pa, hb - pa) if (pa, pb) != (ha, hb) else None
        if p0 != m0:  # the part's layer l is the model's p0 + l, the rank's p0 + l - m0
            out = LayerShift(out, p0 - m0)
        refs = [part_ref(c, p, model) for c in chunks]
        load = LayerLoad(
            part_spec(model, p),
            store,
            refs,
            k,
            SectionPages(out, heads),
            layers=range(la - p0, lb - p0),
            **options,
        )
        shares.append(Share(load, range(la - m0, lb - m0), m0 - p0))
    return PartLoads(shares)
