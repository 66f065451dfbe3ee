"""What an engine's next step holds, as a scheduler that plans splits knows it (`LinkQueue`): the loads
on the link and the compute of the step, which each split counts before it (CacheFlow's batch rule:
`planning.split.choose_split_ahead`'s `bytes_ahead`, `compute_ahead_s`, `step_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvrestore.costs.compute import ChunkCost
from kvrestore.planning.split import SplitChoice
from kvrestore.policies.batch import QueuedLoad


class LinkQueue:
    """What the engine's next step holds: the loads not finished (planned in this scheduling pass, or
    sent until the engine reports them finished, `finished`, or at most `timeout_s`: a lost report does
    not hold the link forever), and the step's compute: what the running requests carry into it (an
    engine schedules them first) and what this pass planned."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._planned: dict[str, tuple[QueuedLoad | None, SplitChoice]] = {}  # (its load, its split)
        self._sent: dict[str, tuple[QueuedLoad, float]] = {}  # and when it is taken as finished
        self._running: tuple[float, int] = (0.0, 0)  # compute seconds, tokens

    def plan(self, req_id: str, load: QueuedLoad | None, choice: SplitChoice) -> None:
        """`req_id`'s split in this pass and its load (None: nothing to load)."""
        self._planned[req_id] = (load, choice)

    def planned(self, req_id: str) -> QueuedLoad | None:
        entry = self._planned.get(req_id)
        return entry[0] if entry else None

    def ahead(self, req_id: str) -> tuple[float, float, int]:
        """What the step holds before `req_id`'s split: the bytes of every other load not finished, and
        the compute seconds and tokens of the running requests and the others planned in this pass."""
        now = time.monotonic()
        self._sent = {r: v for r, v in self._sent.items() if v[1] > now}
        loads = [q for r, (q, _) in self._sent.items() if r != req_id]
        others = [v for r, v in self._planned.items() if r != req_id]
        loads += [q for q, _ in others if q is not None]
        compute_s, tokens = self._running
        return (
            sum(q.nbytes for q in loads),
            compute_s + sum(c.compute_s or 0.0 for _, c in others),
            tokens + sum(c.step_new_tokens for _, c in others),
        )

    def later(self, req_id: str) -> tuple[float, int]:
        """The compute seconds and tokens the others planned in this pass spill into the next step."""
        others = [c for r, (_, c) in self._planned.items() if r != req_id]
        return sum(c.later_s for c in others), sum(c.later_tokens for c in others)

    def send(self, req_ids: Iterable[str], running: tuple[float, int] = (0.0, 0)) -> None:
        """The pass is over: `req_ids`' loads were sent, other plans dropped (asked again). `running`: the
        compute seconds and tokens the scheduled requests carry into the next step."""
        until = time.monotonic() + self.timeout_s
        for r in req_ids:
            q = self.planned(r)
            if q is not None:
                self._sent[r] = (q, until)
        self._planned.clear()
        self._running = running

    def finished(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._sent.pop(r, None)
            self._planned.pop(r, None)


def carried(
    running: Iterable[tuple[int, int]], cost: ChunkCost | None, step_tokens: int | None
) -> tuple[float, int]:
    """The compute seconds and tokens that requests in a step, each (its prompt's tokens, those computed
    by the step's end), carry into the next step, where an engine schedules them before any new request:
    the rest of a prompt (`step_tokens` at most), or one token to decode, in a pass the step runs anyway
    (its fixed cost not counted). No cost known: the tokens only."""
    seconds, tokens = 0.0, 0
    for n_tokens, done in running:
        n = n_tokens - done if step_tokens is None else min(n_tokens - done, step_tokens)
        if n > 0:
            seconds += cost.seconds(n, done) if cost is not None else 0.0
        else:
            n = 1
            seconds += cost.seconds(1, done) - cost.fixed_s if cost is not None else 0.0
        tokens += n
    return seconds, tokens
