"""One move of chunk bytes from host memory to a KV cache, and everything it holds while it runs.

A load that reaches a CUDA cache stages the bytes in page-locked buffers from a `StagingPool`, queues
the copies on the load lane's stream, and may reuse a buffer only once the copies reading it have
finished. A `Transfer` owns all of that for one move: the buffers it took from its pool, the stream
its copies go on and the events that say when they are done. It gives every buffer back in one place
(`close`, or leaving its `with` block), whatever happened in between: a buffer whose copies were queued
goes back with an event, to be reused only once the event has completed; any other goes back at once.
A buffer is never handed back twice nor kept past `close`.

Off CUDA (a CPU cache, or the device path run on one in tests) the same code runs: copies are done
when they return, so no event is recorded.

`TransferLane` is where a restore's transfers run: the pool and the stream, carried together from the
restorer to whatever reads chunks, which opens one `Transfer` per move (`open`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType

import torch

from kvrestore.chunkio.pool import Staging, StagingPool
from kvrestore.core.streams import on_stream
from kvrestore.stores.base import copy_into


def pinned_view(data: memoryview) -> torch.Tensor | None:
    """`data` as a uint8 tensor over the same memory where that memory is page-locked (a pinned
    `MemoryStore`'s object), else None."""
    if data.readonly:
        return None
    host = torch.frombuffer(data, dtype=torch.uint8)
    return host if host.is_pinned() else None


class Transfer:
    """The staging buffers, stream and events of one host-to-device move (see the module doc).

    `stage`, `copy_in` and `pinned` take buffers (`give_back` returns one early); `running` enters the stream the copies go on; `copied` marks the
    copies out of every buffer held as queued (the buffers go back, busy until they are done); `wait`
    blocks until the stream has done everything queued; `close` gives back whatever is still held.
    Used from one thread at a time (a load lane's, or the event loop's around a thread hop).
    """

    def __init__(
        self, pool: StagingPool, stream: torch.cuda.Stream | None = None, device: torch.device | None = None
    ) -> None:
        self.pool = pool
        self.stream = stream
        self.device = device if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._held: list[Staging] = []
        self._queued = False  # a copy reading a held buffer may be queued on the stream
        self._closed = False

    def __enter__(self) -> Transfer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def held(self) -> int:
        """Staging buffers this transfer holds now."""
        return len(self._held)

    def stage(self, nbytes: int) -> Staging:
        """A staging buffer of at least `nbytes` from the pool, held until `copied`, `give_back` or
        `close`."""
        if self._closed:
            raise RuntimeError("a closed transfer cannot stage more bytes")
        buf = self.pool.acquire(nbytes)
        self._held.append(buf)
        return buf

    def pinned(self, data: memoryview) -> torch.Tensor:
        """`data` as a page-locked uint8 tensor: itself when it already is (`pinned_view`), else copied
        into a buffer this transfer stages (`copy_in`)."""
        host = pinned_view(data)
        return host if host is not None else self.copy_in(data).tensor

    def copy_in(self, data: memoryview) -> Staging:
        """A buffer this transfer stages, holding a copy of `data` (one copy, off the GIL)."""
        buf = self.stage(len(data))
        copy_into(buf.view, data)
        return buf

    def give_back(self, buf: Staging | None) -> None:
        """Hand `buf` back before the transfer ends: no copy reads it (its bytes were used on the host,
        or it was never filled). Nothing to do for None or a buffer already given back."""
        if buf is not None and any(b is buf for b in self._held):
            self._held = [b for b in self._held if b is not buf]
            self.pool.release(buf)

    def running(self) -> AbstractContextManager:
        """Enter the stream the copies go on (the device's current one without a stream; nothing off
        CUDA). From here on a held buffer may be read by a queued copy until `copied` or `wait`."""
        self._queued = True
        return on_stream(self.stream, self.device)

    def copied(self) -> None:
        """Every copy out of the held buffers is queued on the current stream: hand them all back, each
        reused only once an event recorded here has completed (on CUDA)."""
        if not self._held:
            return
        event = None
        if self._cuda:
            event = self.pool.event()
            event.record()
        held, self._held = self._held, []
        for buf in held:
            self.pool.release(buf, busy_until=event)

    def wait(self) -> None:
        """Block until the stream has done everything queued on it so far (the GIL is released
        meanwhile); the held buffers are then read by no copy."""
        if self._cuda:
            with on_stream(self.stream, self.device):
                done = self.pool.event()
                done.record()
            done.synchronize()
            self.pool.give_event(done)
        self._queued = False

    def close(self) -> None:
        """Give back every buffer still held: after the copies queued on the stream where some may read
        it (an error part-way through queueing them), else at once. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._queued:
            with on_stream(self.stream, self.device):
                self.copied()
            return
        held, self._held = self._held, []
        for buf in held:
            self.pool.release(buf)


@dataclass(frozen=True)
class TransferLane:
    """Where a restore's transfers to a device run: the `pool` their staging buffers come from (pinned
    for a GPU) and the `stream` their copies go on (None: the device's current stream)."""

    pool: StagingPool
    stream: torch.cuda.Stream | None = None

    def open(self, device: torch.device) -> Transfer:
        """A transfer to `device` on this lane."""
        return Transfer(self.pool, self.stream, device)
