"""Eviction policies: which object leaves a full store first.

A policy is bookkeeping only (no I/O): the store tells it what was added, used and removed, and asks it
for the next victim when its bytes exceed the capacity. `LRU` is the default; `FIFO` ignores use; write
your own by implementing the four methods of `EvictionPolicy`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from kvrestore.core.errors import InvalidInputError


class EvictionPolicy(Protocol):
    """Ordering of a store's keys for eviction. Every method is called on the event loop thread."""

    def add(self, key: str, size: int) -> None:
        """`key` was written (or re-written) with `size` bytes."""
        ...

    def touch(self, key: str) -> None:
        """`key` was read (a hit)."""
        ...

    def remove(self, key: str) -> None:
        """`key` is gone (deleted, evicted, found missing); absent keys are ignored."""
        ...

    def victim(self) -> str | None:
        """The key to evict next (it stays tracked until `remove`), or None when empty."""
        ...


class LRU:
    """Least recently used first: writes and reads count as use."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def add(self, key: str, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self) -> str | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)


class FIFO(LRU):
    """First written, first evicted: reads do not keep an object."""

    def touch(self, key: str) -> None:
        pass


def make_policy(policy: EvictionPolicy | str | None) -> EvictionPolicy:
    """A policy object from an instance, a name ("lru", "fifo") or None (LRU)."""
    if policy is None:
        return LRU()
    if isinstance(policy, str):
        named = {"lru": LRU, "fifo": FIFO}
        if policy.lower() not in named:
            raise InvalidInputError(f"unknown eviction policy {policy!r}; known: {', '.join(named)}")
        return named[policy.lower()]()
    for method in ("add", "touch", "remove", "victim"):
        if not callable(getattr(policy, method, None)):
            raise InvalidInputError(
                f"eviction must be 'lru', 'fifo', None or an EvictionPolicy; {policy!r} has no {method}() method"
            )
    return policy


__all__ = ["FIFO", "LRU", "EvictionPolicy", "make_policy"]
