"""What a layer-wise read names: the stored chunks it reads (`StoredChunk`) and the chunks it could not
(`ChunkLoadFailed`), and how it runs one read per chunk concurrently (`each`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kvrestore.core.errors import ChunkDecodeError
from kvrestore.stores.base import in_order

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")


class ChunkLoadFailed(ChunkDecodeError):
    """A layer of some chunks could not be read after their headers were: those chunks are misses."""

    def __init__(self, indices: Sequence[int], error: str) -> None:
        super().__init__(f"chunks {list(indices)}: {error}")
        self.indices = list(indices)
        self.error = error


async def each(fn: Callable[[T], Coroutine[Any, Any, None]], items: Sequence[T]) -> None:
    """fn(item) for every item concurrently; an unexpected error is raised as itself (the first inside
    the exception groups), not as a group."""
    try:
        await in_order([partial(fn, x) for x in items])
    except BaseExceptionGroup as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        raise exc from None


@dataclass(frozen=True)
class StoredChunk:
    """Where a stored chunk comes from (`key`, saved at position `stored_at`) and goes (`offset`)."""

    key: str
    stored_at: int
    offset: int
    n_tokens: int


def layers_name(layers: range) -> str:
    """How errors name the layers of a read: "layer 3", "layers 3-6"."""
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
