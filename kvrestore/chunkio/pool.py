"""Reusable staging buffers for chunk reads: pinned on CUDA, recycled once their copy has finished.

A load lane reads a chunk object into a staging buffer with one bulk operation, then (on CUDA) copies
it to the device on the load stream. Allocating pinned memory costs milliseconds and first-touching
fresh pages costs as much as the read itself, so buffers are kept and reused, as vLLM's
`kv_offload` CPU tier does. A buffer handed back with a CUDA event is not handed out again before the
event has completed (its host-to-device copy may still be reading it); events are pooled too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

#: buffer sizes are rounded up to this, so chunks of one prompt (and its last, shorter chunk) share them
GRANULE = 1 << 20


@dataclass(eq=False)
class Staging:
    """One host buffer: `tensor` (uint8, pinned for CUDA) and a writable `view` of the same bytes."""

    tensor: torch.Tensor
    view: memoryview
    pinned: bool
    busy_until: torch.cuda.Event | None = None  # the copy that still reads it, if any

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def ready(self) -> bool:
        return self.busy_until is None or self.busy_until.query()


class StagingPool:
    """Staging buffers for one kind of destination: `pinned=True` for uploads to a GPU.

    Thread-safe: load lanes acquire and release from worker threads. At most `max_idle` free buffers
    are kept, of at most `max_idle_bytes` together; more in use at once are allocated and dropped on
    release (the largest first), so memory beyond the pool's working size goes back to the system.
    `close()` drops every free buffer.
    """

    def __init__(self, pinned: bool = False, max_idle: int = 16, max_idle_bytes: int = 512 << 20) -> None:
        self.pinned = pinned
        self.max_idle = max_idle
        self.max_idle_bytes = max_idle_bytes
        self._free: list[Staging] = []
        self._events: list[torch.cuda.Event] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created so far (a warm pool stops creating them)

    def acquire(self, nbytes: int) -> Staging:
        """A buffer of at least `nbytes` whose last copy has finished (a new one if none is free)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes and buf.ready():
                    self._recycle_event(buf)
                    return self._free.pop(i)
        size = -(-max(nbytes, 1) // GRANULE) * GRANULE
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self.allocated += 1
        # an ndarray has the buffer protocol (numpy's stubs say so only on Python 3.12+)
        view = memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type,unused-ignore]
        return Staging(tensor, view, self.pinned)

    def release(self, buf: Staging, busy_until: torch.cuda.Event | None = None) -> None:
        """Hand `buf` back; with `busy_until`, it is reused only after that event has completed.
        Raises RuntimeError if it is free already: a buffer handed back twice would be given to two
        readers at once."""
        with self._lock:
            if any(b is buf for b in self._free):
                raise RuntimeError("a staging buffer was handed back twice")
            buf.busy_until = busy_until
            self._free.append(buf)
            idle = sum(b.nbytes for b in self._free)
            while self._free and (len(self._free) > self.max_idle or idle > self.max_idle_bytes):
                drop = max(self._free, key=lambda b: b.nbytes)  # past the working size: given back
                self._free.remove(drop)
                idle -= drop.nbytes
                self._recycle_event(drop)

    @property
    def idle_bytes(self) -> int:
        """Bytes held by free buffers."""
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def close(self) -> None:
        """Drop every free buffer (and pooled event): their memory goes back to the system. Buffers in
        use stay their holders' and are dropped on release; the pool stays usable."""
        with self._lock:
            self._free.clear()
            self._events.clear()

    def event(self) -> torch.cuda.Event:
        """A CUDA event from the pool (returned to it when the buffer it guards is reused)."""
        with self._lock:
            if self._events:
                return self._events.pop()
        return torch.cuda.Event()

    def give_event(self, event: torch.cuda.Event) -> None:
        """Return an event that guards nothing any more (it has completed)."""
        with self._lock:
            self._events.append(event)

    def _recycle_event(self, buf: Staging) -> None:
        """Take `buf`'s event off it, and keep it for reuse only if it has completed and guards no other
        free buffer (one upload's event guards every buffer it read): an event recorded again elsewhere,
        perhaps on another stream, would not say when those buffers' copies are done."""
        event, buf.busy_until = buf.busy_until, None
        if event is None or not event.query():
            return
        if not any(b.busy_until is event for b in self._free if b is not buf):
            self._events.append(event)
