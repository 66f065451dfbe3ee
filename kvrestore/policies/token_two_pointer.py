"""TokenTwoPointer: Cake's bidirectional restore along tokens (Cake §4, Appendix A; CacheFlow §3.1).

The compute lane prefills chunks from the front; the load lanes fetch stored chunks from the back; the
two meet in the middle (`policies.meeting`, whose decisions the layer-wise pointer shares). Along tokens
the first chunks are cheaper to compute than the last (attention grows with position), which is what
lets the meeting fall past the middle of a long prompt when the link and the compute lane are equally
fast.
"""

from __future__ import annotations

from kvrestore.core.errors import check_int
from kvrestore.policies.base import Decision, Estimates, Policy, Progress
from kvrestore.policies.meeting import Meeting

#: stored chunks per compute unit: 2 x 256-token chunks = 512 tokens, Cake's compute granularity
DEFAULT_COMPUTE_CHUNKS = 2


class TokenTwoPointer(Policy):
    """Compute chunks from the front, load chunks from the back, meet in the middle.

    `compute_chunks` stored chunks make one compute unit (the fetch granularity is the store's chunk
    size, `Restorer(chunk_size=...)`); a unit is cut short where it would reach a chunk being fetched.
    """

    name = "two-pointer"

    def __init__(self, compute_chunks: int = DEFAULT_COMPUTE_CHUNKS) -> None:
        self.compute_chunks = check_int("compute_chunks", compute_chunks)
        self._meeting = Meeting(self.compute_chunks)

    def __repr__(self) -> str:
        return f"TokenTwoPointer(compute_chunks={self.compute_chunks})"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        return self._meeting.decide(progress, estimates)
