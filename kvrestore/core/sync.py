"""The bridge from blocking callers to async code: an event loop to run coroutines on, and blocking faces
of async methods, generated rather than copied by hand.

`LoopThread` is one event loop in a daemon thread that any other thread hands coroutines to (the
`SyncRestorer`'s loop, the vLLM worker side's I/O loop); `CallerLoop` runs them on a loop of its own in
the calling thread (the vLLM scheduler side), or on a `LoopThread` where that thread already runs a loop.
A store's client (an S3 session) stays on the one loop it was made on, whichever is used.

A sync class that wraps an async object (`SyncRestorer` wraps a `Restorer`) gets, for every public
coroutine method of the async class, a blocking method of the same name, signature and docstring that
runs the coroutine on the sync object's own event loop. A method added to the async class then has its
sync face at once; none can be forgotten or drift. It is fsspec's `mirror_sync_methods` / `sync_wrapper`
pattern, done once at class creation instead of per instance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread

T = TypeVar("T", bound=type)
R = TypeVar("R")


def _bounded(
    fn: Callable[..., Awaitable[R]], args: tuple[Any, ...], timeout: float | None
) -> Callable[[], Any]:
    """`fn(*args)` as a coroutine function, failing with TimeoutError (cancelled) after `timeout` s."""
    if timeout is None:
        return functools.partial(fn, *args)

    async def bounded() -> R:
        with anyio.fail_after(timeout):
            return await fn(*args)

    return bounded


class LoopThread:
    """One anyio event loop in a daemon thread (a blocking portal); coroutines are run on it from any
    other thread."""

    def __init__(self) -> None:
        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        self.closed = False
        self.thread_id = self.portal.call(threading.get_ident)

    @property
    def on_loop(self) -> bool:
        """Whether the calling thread is the loop's own (a call from it would wait for itself)."""
        return threading.get_ident() == self.thread_id

    def submit(self, fn: Callable[..., Awaitable[R]], *args: Any) -> concurrent.futures.Future[R]:
        """Start `fn(*args)` on the loop; its future."""
        return self.portal.start_task_soon(fn, *args)

    def call(self, fn: Callable[..., Awaitable[R]], *args: Any, timeout: float | None = None) -> R:
        """Run `fn(*args)` on the loop and wait for it; TimeoutError (and the task cancelled) after
        `timeout` seconds."""
        return self.portal.call(_bounded(fn, args, timeout))

    def close(self) -> None:
        """Stop the loop and its thread, once (the tasks still running are cancelled)."""
        if not self.closed:
            self.closed = True
            self._cm.__exit__(None, None, None)


class CallerLoop:
    """Runs coroutines to completion on one event loop, in the calling thread: a store's client (an S3
    session) stays on the loop it was made on, and no thread is started. Where the calling thread
    already runs a loop (it cannot run a second), the calls go to a `LoopThread` made then."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: LoopThread | None = None

    def call(self, fn: Callable[..., Awaitable[R]], *args: Any, timeout: float | None = None) -> R:
        """`fn(*args)`, waited for; TimeoutError (the task cancelled) after `timeout` seconds."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(_bounded(fn, args, timeout)())
        if self._thread is None:
            self._thread = LoopThread()
        return self._thread.call(fn, *args, timeout=timeout)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
        if self._thread is not None:
            self._thread.close()


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
