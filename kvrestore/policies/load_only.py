"""LoadOnly: load every stored chunk; compute only what the store does not have (or gave back broken)."""

from __future__ import annotations

from kvrestore.policies.base import ChunkStatus, Decision, Estimates, Policy, Progress, next_compute_run


class LoadOnly(Policy):
    """Fetch stored chunks front to back on every free load lane.

    A chunk that is missing, or whose load failed (corrupt, truncated, foreign, store error), is
    recomputed as soon as every chunk before it is in place; chunks after it stay loaded (their keys
    name their whole prefix, so their KV is valid however the earlier chunk was obtained).

    Takes no parameters; the number of load lanes is the engine's (`Restorer(load_lanes=)`).
    """

    name = "load-only"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        loads = tuple(
            i for i, s in enumerate(progress.status) if s is ChunkStatus.PENDING and progress.stored[i]
        )[: progress.free_load_lanes]
        run = next_compute_run(progress, stop_at_stored=True)
        if run is not None and progress.stored[run[0]]:
            run = None  # the next chunk is loadable: wait for its load instead of computing it
        return Decision(compute=run, loads=loads)
