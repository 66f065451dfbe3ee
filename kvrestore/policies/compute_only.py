"""ComputeOnly: recompute the whole prompt; the store is not read (but for one chunk, with `watch`)."""

from __future__ import annotations

from kvrestore.core.settings import check_int
from kvrestore.policies.base import IDLE, Decision, Estimates, Policy, Progress, next_compute_run


class ComputeOnly(Policy):
    """Prefill every chunk on the compute lane.

    Parameters
    ----------
    unit_chunks: int | None
        How many chunks one compute unit covers. None (default) prefills everything left in one unit,
        which runs at full-prefill speed (chunked prefill pays a per-call overhead).
    watch: bool
        Also fetch the last stored chunk of the first unit aside while it computes (where the lanes
        can fetch aside, `LaneTraits.can_overtake`): one read that keeps a restorer measuring its
        link while it computes everything, so that a link that got faster is seen by the next plan
        (`Auto` runs compute-only so). The unit never waits for it; its KV is used only where it
        lands before the unit ends and is the unit's only chunk (the fetch then overtakes the unit).

    Raises
    ------
    InvalidInputError
        `unit_chunks` is not a positive int.
    """

    name = "compute-only"

    def __init__(self, unit_chunks: int | None = None, watch: bool = False) -> None:
        self.unit_chunks = None if unit_chunks is None else check_int("unit_chunks", unit_chunks)
        self.watch = bool(watch)

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        run = next_compute_run(progress, self.unit_chunks)
        if run is None:
            return IDLE
        return Decision(compute=run, overtake=self._watched(progress, run))

    def _watched(self, p: Progress, run: tuple[int, int]) -> tuple[int, ...]:
        """The chunk fetched aside beside the unit `run` (see `watch`): the first unit's last stored."""
        if not (self.watch and p.lanes.can_overtake and p.free_load_lanes > 0 and run[0] == 0):
            return ()
        return next(((j,) for j in range(run[1] - 1, run[0] - 1, -1) if p.stored[j]), ())

    def __repr__(self) -> str:
        watch = ", watch=True" if self.watch else ""
        return f"ComputeOnly(unit_chunks={self.unit_chunks}{watch})"
