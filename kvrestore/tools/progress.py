"""What the commands print while they work: timestamped lines on stderr, and a heartbeat for steps that
run long, so that a command never sits silent for more than a few seconds (stdout keeps the results)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TextIO

import anyio


class ProgressLog:
    """Timestamped progress lines on `stream` (stderr). `tick` rewrites one line in place on a terminal
    (a restore's chunks as they land); inside `beating()`, a step that has said nothing for a while gets
    a line saying it is still running and for how long."""

    def __init__(
        self, stream: TextIO | None = None, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.stream = stream or sys.stderr
        self.clock = clock
        self.t0 = self.step_t0 = self.said_t = clock()
        self.step = ""
        self.tty = self.stream.isatty()
        self._open = False  # a line `tick` began is not ended yet
        self.last = ""  # the current step's latest tick, which a heartbeat off a terminal repeats

    def _stamp(self) -> str:
        return f"[{self.clock() - self.t0:6.1f}s]"

    def __call__(self, message: str) -> None:
        """A line of its own: a new step begins."""
        if self._open:  # end the line `tick` left open
            print(file=self.stream)
            self._open = False
        print(f"{self._stamp()} {message}", file=self.stream, flush=True)
        self.note(message)

    def note(self, step: str) -> None:
        """A new step begins, said elsewhere (a result line on stdout): what `beat` then names."""
        self.step, self.step_t0 = step, self.clock()
        self.said_t = self.step_t0
        self.last = ""

    def tick(self, message: str) -> None:
        """How a step is going, on a terminal only: one line, rewritten by the next tick."""
        self.last = message
        if self.tty:  # off a terminal a tick prints nothing, so the heartbeat must still come
            self.said_t = self.clock()
            self._rewrite(message)

    def _rewrite(self, message: str) -> None:
        if self.tty:
            print(f"\r{self._stamp()} {message}\x1b[K", end="", file=self.stream, flush=True)
            self._open = True

    def beat(self) -> None:
        """Say the current step is still running, and for how long (on a terminal, in the line `tick`
        rewrites)."""
        still = f"... {self.step} ({self.clock() - self.step_t0:.0f} s)"
        if self.tty:
            self._rewrite(still)
        else:
            done = f": {self.last}" if self.last else ""
            print(f"{self._stamp()} {still}{done}", file=self.stream, flush=True)
            self.said_t = self.clock()

    @contextlib.asynccontextmanager
    async def beating(self, every_s: float = 2.0, lines_every_s: float = 15.0) -> AsyncIterator[None]:
        """While the block runs, `beat` whenever nothing was said for `every_s` seconds on a terminal
        (the line rewritten in place: a running clock), or for `lines_every_s` elsewhere (a log file
        gets a line that often). The event loop must be free: the step's work in a thread."""
        quiet_s = every_s if self.tty else max(every_s, lines_every_s)

        async def beats() -> None:
            while True:
                await anyio.sleep(every_s)
                if self.clock() - self.said_t >= quiet_s:
                    self.beat()

        async with anyio.create_task_group() as tg:
            tg.start_soon(beats)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()


__all__ = ["ProgressLog"]
