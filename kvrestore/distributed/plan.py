"""The plan every stage of a restore follows: which chunks it may load, which it computes in the pipeline.

Rank 0 makes it from one look at the store (`StageRestorer`) and broadcasts it, so every stage acts on the
same view even while the store changes. Pure data: no I/O, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrestore.core.errors import InvalidInputError
from kvrestore.distributed.layout import StageLayout


@dataclass(frozen=True)
class StagePlan:
    """`kv_stored[c]`: chunk c's KV is in the store. `missing[s][c]`: stage s has no boundary activation for
    chunk c (never for stage 0, whose input is the embedding). Where the store cannot be asked, nothing
    is stored: every stage computes every chunk in the pipeline.

    A stage without chunk c's activation can compute c only from the previous stage's output for it: the
    sequential pipeline. So both compute c (stage s-1 sends its output to stage s), neither loads it, and
    the two-pointer of each stage works over the other chunks as usual.
    """

    layout: StageLayout
    kv_stored: tuple[bool, ...]
    missing: tuple[tuple[bool, ...], ...]

    @classmethod
    def make(
        cls, layout: StageLayout, kv_stored: Sequence[bool], boundary_present: Sequence[Sequence[bool]]
    ) -> StagePlan:
        """From the store's answers: `boundary_present[s - 1][c]` for each boundary (stage s >= 1)."""
        n = len(kv_stored)
        if len(boundary_present) != layout.n_stages - 1 or any(len(p) != n for p in boundary_present):
            raise InvalidInputError("boundary_present needs one flag per chunk for every stage boundary")
        missing = ((False,) * n, *(tuple(not p for p in present) for present in boundary_present))
        return cls(layout, tuple(bool(x) for x in kv_stored), missing)

    @property
    def n_chunks(self) -> int:
        return len(self.kv_stored)

    def receives(self, s: int) -> list[bool]:
        """Chunks whose input stage s receives from stage s - 1."""
        return list(self.missing[s])

    def sends(self, s: int) -> list[bool]:
        """Chunks whose output stage s sends to stage s + 1."""
        last = s + 1 == self.layout.n_stages
        return [False] * self.n_chunks if last else list(self.missing[s + 1])

    def pipelined(self, s: int) -> list[bool]:
        """Chunks stage s must compute (it receives or sends their hidden states)."""
        return [r or t for r, t in zip(self.receives(s), self.sends(s), strict=True)]

    def stored(self, s: int) -> list[bool]:
        """What stage s's two-pointer may load: stored chunks outside the pipeline."""
        return [k and not p for k, p in zip(self.kv_stored, self.pipelined(s), strict=True)]

    def wants_boundary(self, s: int) -> list[bool]:
        """Chunks stage s computes from a stored boundary activation, if it computes them."""
        return [s > 0 and not m for m in self.missing[s]]
