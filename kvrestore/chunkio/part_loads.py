"""A tensor-parallel rank's share of a load where the chunks are stored in another layout than its own
(`chunkio.parts`): one `LayerLoad` a stored part that holds some of its heads, each into its own
destination (`head_slice`), waited for and settled as one load.

A token range fails where any part's chunk failed: the engine then recomputes it on every rank (vLLM
joins each worker's load errors), so a rank never keeps KV of two sources for one token.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.core.sync import LoopThread


class PartLoads:
    """`loads` (one per part, over the same chunks and tokens) as one load."""

    def __init__(self, loads: Sequence[LayerLoad]) -> None:
        self.loads = list(loads)
        first = self.loads[0]
        self.chunks, self.first, self.k = first.chunks, first.first, first.k
        self.here = any(load.here for load in self.loads)

    def start(self, io: LoopThread, timeout: float | None = None) -> None:
        for load in self.loads:
            load.start(io, timeout)

    def wait(self, layer: int) -> bool:
        return all([load.wait(layer) for load in self.loads])  # every part's wait runs

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
