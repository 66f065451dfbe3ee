"""Which layers each pipeline stage owns, and where the stage boundaries are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.settings import check_int


@dataclass(frozen=True)
class StageLayout:
    """Stages as contiguous layer ranges [start, end) covering layers [0, num_layers) in order.

    Stage s > 0 starts at a boundary: the hidden state entering its first layer is what stage-parallel
    restore stores with each chunk (stage 0's input is the token embedding, computed from the tokens).
    """

    stages: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        stages = self.stages
        if not stages or stages[0][0] != 0:
            raise InvalidInputError(f"stages must start at layer 0, got {list(stages)}")
        for (a, b), (c, _) in zip(stages, stages[1:], strict=False):
            if b != c:
                raise InvalidInputError(f"stages must be contiguous: [{a}, {b}) is followed by one at {c}")
        if any(b <= a for a, b in stages):
            raise InvalidInputError(f"every stage needs at least one layer, got {list(stages)}")

    @classmethod
    def even(cls, num_layers: int, n_stages: int) -> StageLayout:
        """`n_stages` stages of as equal a size as possible (the first ones one layer larger)."""
        check_int("n_stages", n_stages)
        if check_int("num_layers", num_layers) < n_stages:
            raise InvalidInputError(
                f"{n_stages} stages need at least {n_stages} layers, the model has {num_layers}"
            )
        base, extra = divmod(num_layers, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + base + (s < extra))
        return cls(tuple(zip(bounds, bounds[1:], strict=False)))

    @classmethod
    def at(cls, num_layers: int, boundaries: Sequence[int]) -> StageLayout:
        """Stages split at `boundaries` (increasing layer indices inside (0, num_layers))."""
        bounds = [0, *boundaries, num_layers]
        if any(not isinstance(b, int) or isinstance(b, bool) for b in boundaries):
            raise InvalidInputError(f"boundaries must be layer indices, got {list(boundaries)}")
        return cls(tuple(zip(bounds, bounds[1:], strict=False)))

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1][1]

    @property
    def boundaries(self) -> list[int]:
        """The first layer of every stage after the first."""
        return [a for a, _ in self.stages[1:]]

    def check(self, num_layers: int) -> StageLayout:
        """This layout if it covers exactly a `num_layers`-layer model, else InvalidInputError."""
        if self.num_layers != num_layers:
            raise InvalidInputError(f"the stages cover {self.num_layers} layers, the model has {num_layers}")
        return self
