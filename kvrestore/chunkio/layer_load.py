"""One prompt's stored tokens [first, k), layer by layer, into a destination, for an engine that runs
its own layers (vLLM): `LayerLoad`.

The engine asks for each layer just before it runs it (`wait`); the load reads ahead of it through one
`LayerReader`, on the schedule every layer read keeps (`stored.read_plan`: the first layer alone, then
`layers_per_read` at a time), and hands each layer to its destination (`ready`: the pages, `page_dest`)
as soon as a read has verified it. Where the destination lands the bytes itself (`dest.Lands`: host
pages from a store that reads without the event loop) the reads run on the engine's thread, in `wait`;
otherwise on an I/O thread's event loop (`start`), while the engine computes.

What every load keeps, whatever its destination:

* **one deadline**: every layer is read within `timeout` seconds of `start`, or the load is cancelled:
  every chunk fails, nothing is written after `cancel` returns, and a store under deadlines
  (`DeadlineStore`) is told, which then counts as down for its back-off (as the library's engine does
  with a read it abandons). Reads on the engine's thread are local (`reads_sync`) and run to their end;
* **one fault rule**: a read that names its chunks (`ChunkLoadFailed`: missing, damaged, foreign,
  unauthenticated, a store fault on that chunk) fails those; any other fault (a bug, the deadline) fails
  every chunk. Failed chunks are recomputed by the engine from their first token (`failed_ranges`);
* **one deletion rule**: the reader's (`stored.forget`: only proven damage deletes).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio

from kvrestore.chunkio.dest import Destination, Lands
from kvrestore.chunkio.layers import LayerReader
from kvrestore.chunkio.stored import ChunkLoadFailed, forget, read_plan
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import LOAD_FAULTS, STORE_FAULTS, InvalidInputError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.deadline import DeadlineStore

log = logging.getLogger("kvrestore.chunkio")


class LayerDest(Destination, Protocol):
    """A `LayerLoad`'s destination: a reader's (`chunkio.dest`), told of each layer as it is read and as
    the engine is about to run it."""

    def ready(self, load: LayerLoad, i: int, layer: int, upto: int) -> None:
        """`layer`, the i-th of the read just done, is verified: tokens [load.first, upto) of it are good.
        On the reading thread, under the load's lock; never once `cancel` has returned."""
        ...

    def waited(self, layer: int) -> None:
        """The engine is about to run `layer` (on its thread, once `wait` returned)."""
        ...


class LayerLoad:
    """Tokens [first, k) of a prompt's stored `chunks` (which must cover them, in order; those holding
    none of them are left out) into `dest`, layer by layer (module doc): every layer of the chunks, or
    `layers` of them (a pipeline stage's share of whole chunks). `rows`: where a read lands for a destination that takes it from there
    (a device buffer of one read's layers, from the first chunk's first token: `page_dest.RowPages`);
    `reader_options`: the rest of `LayerReader`'s. Counts the chunks that did not load (`failed`, indices
    into `chunks`) and why (`errors`), the bytes read, and the seconds the reads took (`seconds`, once
    every layer is read: from `start` to the last layer placed, or the reads alone where they run on the
    engine's thread)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[ChunkRef],
        k: int,
        dest: LayerDest,
        *,
        first: int = 0,
        layers_per_read: int = 4,
        encoding: str = "native",
        seal: Seal | None = None,
        rows: KVCache | None = None,
        layers: range | None = None,
        **reader_options: Any,
    ) -> None:
        chunks = [c for c in chunks if c.start < k and c.end > first]  # those that hold [first, k)
        if not chunks or not chunks[0].start <= first < k <= chunks[-1].end:
            raise InvalidInputError(f"chunks must cover tokens [{first}, {k}), first < k")
        self.layers = range(spec.num_layers) if layers is None else layers
        if not (0 <= self.layers.start < self.layers.stop <= spec.num_layers and self.layers.step == 1):
            raise InvalidInputError(f"layers {self.layers} are not some of the chunks' {spec.num_layers}")
        self.spec, self.store, self.chunks, self.k, self.first, self.dest = spec, store, chunks, k, first, dest
        base = chunks[0].start  # where `rows` begins
        placed = [ChunkRef(c.index, c.start, c.end, c.key, at=c.start - base) for c in chunks]
        self.reader = LayerReader(spec, store, placed, dest=dest, encoding=encoding, seal=seal, **reader_options)
        self.rows = rows if rows is not None else KVCache.empty(spec, 0)
        self.here = isinstance(dest, Lands)  # read on the engine's thread, in `wait`
        self.plan = read_plan(self.layers.start, self.layers.stop, layers_per_read)
        self.failed: set[int] = set()
        self.errors: list[str] = []
        self.bytes_read = 0
        self.seconds: float | None = None
        self.cancelled = False
        self.future: concurrent.futures.Future[None] | None = None
        self.deadline: float | None = None  # time.monotonic() by which every layer must be placed
        #: the deletes of chunks a read on the engine's thread found damaged (nothing waits for them)
        self.deletes: list[concurrent.futures.Future[None]] = []
        self._io: LoopThread | None = None
        self._timeout: float | None = None
        self._lock = threading.Lock()
        self._events = [threading.Event() for _ in range(spec.num_layers)]
        self._next = 0  # reads done, of `plan`, on the engine's thread
        self._spent = 0.0
        self._t0 = time.perf_counter()

    # -- the engine's calls --------------------------------------------------------------------------

    def start(self, io: LoopThread, timeout: float | None = None) -> None:
        """Start the load: every layer must be placed within `timeout` seconds. `io` runs the reads in the
        background (or, for a destination read on the engine's thread, the deletes of damaged chunks):
        there the headers are read now, the sections by `wait`."""
        self._io, self._timeout = io, timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._t0 = time.perf_counter()
        if self.here:
            self._timed(lambda: self._opened(self.reader.open_sync()))
            self._forget_damaged()
        else:
            self.future = io.submit(self._background)

    def wait(self, layer: int) -> bool:
        """Block until `layer` is placed or given up, then let the destination prepare it for the engine
        (`waited`); False (the load cancelled, every chunk failed) if the deadline passed first. On the
        engine's thread, the reads up to `layer` run here."""
        if self.here:
            while self._next < len(self.plan) and self.plan[self._next].start <= layer and not self.cancelled:
                self._timed(lambda: self._read_here(self.plan[self._next]))
                self._next += 1
                if self._next == len(self.plan):
                    self.seconds = self._spent
            placed = True
        else:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            placed = self._events[layer].wait(timeout)
            if not placed:
                self.cancel(f"layer {layer} not loaded within {self._timeout:g} s")
                if isinstance(self.store, DeadlineStore) and self._timeout is not None:
                    self.store.timed_out(self._timeout)
        self.dest.waited(layer)
        return placed

    def cancel(self, why: str) -> None:
        """Stop placing layers (nothing is written after this returns); unless every layer was placed,
        every chunk counts as failed."""
        with self._lock:
            if not self.cancelled:
                self.cancelled = True
                done = (
                    self._next == len(self.plan)
                    if self.here
                    else all(self._events[layer].is_set() for layer in self.layers)
                )
                if not done:
                    self._fail(range(len(self.chunks)), [why])
        if self.future is not None:
            self.future.cancel()
        for event in self._events:
            event.set()

    def failed_ranges(self) -> list[tuple[int, int]]:
        """Token ranges, within [first, k), whose KV did not load."""
        failed = [self.chunks[j] for j in sorted(self.failed)]
        return [(max(c.start, self.first), min(c.end, self.k)) for c in failed if c.start < self.k]

    # -- reading ---------------------------------------------------------------------------------------

    def _opened(self, readable: list[bool]) -> None:
        unusable = [j for j, ok in enumerate(readable) if not ok]
        self._fail(unusable, [self.reader.why.get(j, f"chunk {j}: not readable") for j in unusable])

    def _read_here(self, layers: range) -> None:
        """One read of `layers` on the engine's thread (unless every chunk failed), then its layers to the
        destination; what it found damaged is deleted on the I/O thread."""
        if len(self.failed) < len(self.chunks):
            try:
                self.reader.read_layers_sync(layers, self.rows)
            except ChunkLoadFailed as exc:
                self._fail(exc.indices, [exc.error])
        self._forget_damaged()
        self._deliver(layers)

    def _forget_damaged(self) -> None:
        """Delete, on the I/O thread, what a read on the engine's thread found damaged."""
        damaged, self.reader.damaged = self.reader.damaged, []
        if self._io is not None:
            self.deletes += [self._io.submit(forget, self.store, key) for key in damaged]

    def _deliver(self, layers: range) -> None:
        """Each layer of a read to the destination, with the tokens good in it, and to its waiter."""
        upto = min([self.k] + [self.chunks[j].start for j in self.failed])  # recomputed from there on
        for i, layer in enumerate(layers):
            with self._lock:
                if not self.cancelled and upto > self.first:
                    self.dest.ready(self, i, layer, upto)
            if layer == self.layers[-1]:  # set before the wake-up: read once all is placed
                self.bytes_read = self.reader.bytes_read
                if not self.here:
                    self.seconds = time.perf_counter() - self._t0
            self._events[layer].set()

    async def _background(self) -> None:
        """Every read, on the I/O thread's loop; any fault ends in `_fault`, and every layer's event is
        set at the end, so the engine is never left waiting."""
        try:
            self._opened(await self.reader.open())
            for layers in self.plan:
                if self.cancelled:
                    break
                if len(self.failed) < len(self.chunks):
                    try:
                        await self.reader.read_layers(layers, self.rows)
                    except ChunkLoadFailed as exc:
                        self._fail(exc.indices, [exc.error])
                self._deliver(layers)
        except BaseException as exc:
            self._fault(exc)
            if not isinstance(exc, (Exception, anyio.get_cancelled_exc_class())):
                raise
        finally:
            for event in self._events:
                event.set()

    def _timed(self, step: Callable[[], None]) -> None:
        """`step` on the engine's thread, its time counted, any fault ending in `_fault`."""
        t = time.perf_counter()
        try:
            step()
        except Exception as exc:
            self._fault(exc)
        finally:
            self._spent += time.perf_counter() - t

    def _fault(self, exc: BaseException) -> None:
        """The one fault rule for what no read names (module doc): every chunk fails; a bug is logged."""
        self._fail(range(len(self.chunks)), [f"{type(exc).__name__}: {exc}"])
        if not isinstance(exc, (*LOAD_FAULTS, *STORE_FAULTS, anyio.get_cancelled_exc_class())):
            log.exception("kvrestore: a layer load failed", exc_info=exc)

    def _fail(self, indices: Sequence[int] | range, errors: Sequence[str]) -> None:
        new = set(indices) - self.failed
        if new:
            self.failed |= new
            self.errors.extend(errors)
