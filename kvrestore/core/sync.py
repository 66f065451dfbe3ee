"""Blocking faces of async methods, generated rather than copied by hand.

A sync class that wraps an async object (`SyncRestorer` wraps a `Restorer`) gets, for every public
coroutine method of the async class, a blocking method of the same name, signature and docstring that
runs the coroutine on the sync object's own event loop. A method added to the async class then has its
sync face at once; none can be forgotten or drift. It is fsspec's `mirror_sync_methods` / `sync_wrapper`
pattern, done once at class creation instead of per instance.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def public_coroutines(cls: type) -> list[str]:
    """Names of the public (no leading underscore) coroutine methods of `cls`, its bases' included."""
    return sorted(
        name for name, fn in inspect.getmembers(cls, inspect.iscoroutinefunction) if not name.startswith("_")
    )


def sync_wrapper(name: str, fn: Callable[..., Any], via: str, run: str) -> Callable[..., Any]:
    """A blocking method that runs `self.<via>.<name>(...)` through `self.<run>(fn, *args, **kwargs)`,
    with `fn`'s name, signature (`__wrapped__`) and docstring."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, run)(getattr(getattr(self, via), name), *args, **kwargs)

    return method


def mirror_sync_methods(source: type, *, via: str, run: str = "_call") -> Callable[[T], T]:
    """Class decorator: give the decorated class a sync face (`sync_wrapper`) of every public coroutine
    method of `source`, except those the class defines itself (which need more
    than running the coroutine, e.g. a `close` that also stops the loop). `via` is the attribute that
    holds the async object, `run` the method that runs a coroutine function to its result."""

    def decorate(cls: T) -> T:
        for name in public_coroutines(source):
            if name in cls.__dict__:
                continue
            setattr(cls, name, sync_wrapper(name, getattr(source, name), via, run))
        return cls

    return decorate
