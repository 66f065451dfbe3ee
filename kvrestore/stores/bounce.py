"""Read buffers a store owns, for reads that run in worker threads and may be abandoned.

A blocking read (a socket's `recv_into`, Mooncake's `get_into`) that a deadline abandons keeps writing
into its buffer until it ends. Were that buffer the caller's staging buffer, the late bytes would land in
a buffer already handed to another load, after its bytes were verified. So such a read goes into a
buffer of the store's own, lent for that read alone (`Lease`), and is copied out (one bulk copy, GIL-free)
only by a reader still waiting; the buffer returns to the pool only once both the read and its reader are
done with it, in whichever order they finish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

#: buffer sizes are rounded up to this, so chunks of one prompt share them
GRANULE = 1 << 20


class ReadBuffers:
    """At most `keep` free buffers, reused; `register(ptr, size) -> 0 on success` and `unregister(ptr)`
    tell a transfer engine about each buffer made and dropped (Mooncake's), where given."""

    def __init__(
        self,
        keep: int,
        register: Callable[[int, int], int] | None = None,
        unregister: Callable[[int], object] | None = None,
    ) -> None:
        self.keep = keep
        self._register, self._unregister = register, unregister
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.registered = 0  # buffers the transfer engine accepted

    def acquire(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        buf = np.empty(-(-max(nbytes, 1) // GRANULE) * GRANULE, np.uint8)
        if self._register is not None and self._register(buf.ctypes.data, buf.nbytes) == 0:
            self.registered += 1
        return buf

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > self.keep:
                dropped = self._free.pop(0)
                if self._unregister is not None:
                    self._unregister(dropped.ctypes.data)


class Lease:
    """A buffer of `pool` lent to one read. It goes back once the read's thread has finished with it
    (`finish`) and its reader has copied out of it or stopped waiting (`settle`), in either order."""

    def __init__(self, pool: ReadBuffers, buf: np.ndarray) -> None:
        self.pool, self.buf = pool, buf
        self._lock = threading.Lock()
        self._open = 2  # the thread and the reader

    def finish(self) -> None:
        self._end()

    def settle(self) -> None:
        self._end()

    def _end(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self.pool.release(self.buf)


__all__ = ["GRANULE", "Lease", "ReadBuffers"]
