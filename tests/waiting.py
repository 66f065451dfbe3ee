"""Waiting on a thing in tests, not on time: poll a condition at short intervals, bounded by a timeout
that only catches a hang (it is not a claim about speed)."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Return once `condition()` is true; TimeoutError after `timeout` seconds."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.001)
