"""Fire-and-forget tasks for store wrappers (write-back flushes, promotions, read-ahead).

A store is not given a task group by its callers (a Restorer calls `store.get` from inside its own), so
background work runs as plain asyncio tasks on the loop of the call that started it. Under another
anyio backend (trio) `spawn` refuses and the caller does the work inline instead. Work whose loss would
matter (write-back) must keep its own record of what is pending: a loop that ends cancels its tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class Background:
    """The tasks one store has started, per event loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    @staticmethod
    def available() -> bool:
        """Whether `spawn` can start a task here (an asyncio loop is running)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> asyncio.Task[Any] | None:
        """Start `fn(*args)` on the running asyncio loop; None (nothing started) when there is none."""
        if not self.available():
            return None
        task = asyncio.get_running_loop().create_task(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    def is_live(task: asyncio.Task[Any] | None) -> bool:
        """Whether `task` is unfinished and belongs to the running loop."""
        if task is None or task.done():
            return False
        try:
            return task.get_loop() is asyncio.get_running_loop()
        except RuntimeError:
            return False

    def running(self) -> list[asyncio.Task[Any]]:
        """Unfinished tasks started on the current loop."""
        if not self.available():
            return []
        loop = asyncio.get_running_loop()
        return [t for t in self._tasks if not t.done() and t.get_loop() is loop]

    async def wait(self) -> None:
        """Wait for every task started on the current loop (their errors are theirs to record)."""
        while tasks := self.running():
            await asyncio.gather(*tasks, return_exceptions=True)

    def cancel(self) -> None:
        for t in list(self._tasks):
            if not t.done():
                with contextlib.suppress(RuntimeError):  # its loop is closed
                    t.cancel()


__all__ = ["Background"]
