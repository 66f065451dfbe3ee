"""Hidden states from one stage to the next over torch.distributed (the sequential pipeline fallback).

Each transfer is a header (chunk, ok, tokens) then the payload, tagged by chunk, so the two sides match
whatever order their compute lanes run in. A stage that fails sends `ok = 0` headers for everything its
successor still waits for (`poison`), so the successor raises at once instead of waiting for a timeout; a
stage that died is noticed by the transport (its connection closes) or at the timeout. Sends do not wait
for the receiver: `flush` waits for them at the end of the restore.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from kvrestore.core.errors import StageFailedError

log = logging.getLogger("kvrestore.distributed")

#: tags of one restore: 2c and 2c + 1 for chunk c, `_GO` for "the previous stage has finished"
#: (sequential mode), offset by the restore's number so a message a failed restore left unreceived is
#: never taken for one of a later restore
_SPAN = 1 << 20
_GO = _SPAN - 1
_EPOCHS = 1000


def world() -> dist.ProcessGroup:
    """The default process group (every rank); StageFailedError when torch.distributed has none yet."""
    group = dist.group.WORLD
    if group is None:
        raise StageFailedError("torch.distributed is not initialised: no process group")
    return group


def global_rank(group: dist.ProcessGroup, rank: int) -> int:
    """Rank `rank` of `group` as a rank of the default group (what point-to-point calls and `src=` take)."""
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


def started(work: dist.Work | None) -> dist.Work:
    """A point-to-point operation's handle (torch gives None to a rank outside the group)."""
    if work is None:
        raise StageFailedError("this process is not a member of the stage group")
    return work


class Pipe:
    """The links of stage `stage` to its neighbours in `group` (group rank = stage index)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        stage: int,
        n_stages: int,
        hidden_size: int,
        dtype: torch.dtype,
        timeout_s: float,
        epoch: int = 0,
    ) -> None:
        self.group, self.stage, self.n_stages = group, stage, n_stages
        self.hidden_size, self.dtype = hidden_size, dtype
        self.timeout = timedelta(seconds=timeout_s)
        self._sends: list[tuple[dist.Work, list[torch.Tensor]]] = []
        self.sent: set[int] = set()
        self.base = (epoch % _EPOCHS) * _SPAN
        self.went = False

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # gloo: a peer gone (connection closed) or the timeout
            raise StageFailedError(f"stage {self.stage}: {what}: {exc}", {self.stage: str(exc)}) from exc

    def _isend(self, tensors: list[torch.Tensor], tag: int) -> None:
        dst = global_rank(self.group, self.stage + 1)
        for i, t in enumerate(tensors):
            self._sends.append((started(dist.isend(t, dst, group=self.group, tag=tag + i)), [t]))

    def send(self, chunk: int, hidden: torch.Tensor) -> None:
        """Send chunk `chunk`'s stage output [1, T, hidden] to the next stage."""
        payload = hidden[0].detach().to("cpu", self.dtype).contiguous()
        header = torch.tensor([chunk, 1, payload.shape[0]], dtype=torch.int64)
        self._isend([header, payload], self.base + 2 * chunk)
        self.sent.add(chunk)

    def poison(self, chunks: list[int]) -> None:
        """Tell the next stage that chunks it waits for will never come (this stage failed)."""
        for c in chunks:
            if c not in self.sent:
                self._isend([torch.tensor([c, 0, 0], dtype=torch.int64)], self.base + 2 * c)
                self.sent.add(c)

    def recv(self, chunk: int, n_tokens: int, device: torch.device | str) -> torch.Tensor:
        """Chunk `chunk`'s input [1, T, hidden] from the previous stage (blocking, up to the timeout)."""
        src = global_rank(self.group, self.stage - 1)
        header = torch.zeros(3, dtype=torch.int64)
        self._wait(
            started(dist.irecv(header, src, group=self.group, tag=self.base + 2 * chunk)),
            f"waiting for chunk {chunk}'s input",
        )
        c, ok, n = header.tolist()
        if not ok:
            raise StageFailedError(
                f"stage {self.stage - 1} failed before sending chunk {chunk}'s hidden states"
            )
        if (c, n) != (chunk, n_tokens):
            raise StageFailedError(
                f"stage {self.stage}: got chunk {c} ({n} tokens) for chunk {chunk} ({n_tokens})"
            )
        payload = torch.empty((n_tokens, self.hidden_size), dtype=self.dtype)
        self._wait(
            started(dist.irecv(payload, src, group=self.group, tag=self.base + 2 * chunk + 1)),
            f"receiving chunk {chunk}'s input",
        )
        return payload.to(device)[None]

    def go(self) -> None:
        """Sequential mode: let the next stage start."""
        if self.stage + 1 < self.n_stages:
            self._isend([torch.ones(1, dtype=torch.int64)], self.base + _GO)
        self.went = True

    def wait_go(self) -> None:
        """Sequential mode: wait until the previous stage has finished (0: it failed)."""
        if self.stage == 0:
            return
        flag = torch.zeros(1, dtype=torch.int64)
        src = global_rank(self.group, self.stage - 1)
        self._wait(
            started(dist.irecv(flag, src, group=self.group, tag=self.base + _GO)),
            "waiting for its turn",
        )
        if not int(flag):
            raise StageFailedError(f"stage {self.stage - 1} failed before stage {self.stage}'s turn")

    def fail_go(self) -> None:
        """Sequential mode: tell the next stage this one failed (unless it was already let go)."""
        if self.stage + 1 < self.n_stages and not self.went:
            self._isend([torch.zeros(1, dtype=torch.int64)], self.base + _GO)
        self.went = True

    def flush(self) -> None:
        """Wait until every send has been taken (up to the timeout)."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            self._wait(work, "sending hidden states to the next stage")
