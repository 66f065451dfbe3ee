"""ComputeOnly: recompute the whole prompt; the store is not read."""

from __future__ import annotations

from kvrestore.core.errors import check_int
from kvrestore.policies.base import IDLE, Decision, Estimates, Policy, Progress, next_compute_run


class ComputeOnly(Policy):
    """Prefill every chunk on the compute lane.

    Parameters
    ----------
    unit_chunks: int | None
        How many chunks one compute unit covers. None (default) prefills everything left in one unit,
        which runs at full-prefill speed (chunked prefill pays a per-call overhead).

    Raises
    ------
    InvalidInputError
        `unit_chunks` is not a positive int.
    """

    name = "compute-only"

    def __init__(self, unit_chunks: int | None = None) -> None:
        self.unit_chunks = None if unit_chunks is None else check_int("unit_chunks", unit_chunks)

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        run = next_compute_run(progress, self.unit_chunks)
        return Decision(compute=run) if run else IDLE

    def __repr__(self) -> str:
        return f"ComputeOnly(unit_chunks={self.unit_chunks})"
