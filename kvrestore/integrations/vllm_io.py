"""The vLLM connector's background I/O, without vLLM: an event loop in its own thread, a bounded saver
and a layer-by-layer loader over kvrestore's stores, codec and `LayerReader`.

vLLM calls a connector from its step loop, synchronously; every store operation here runs on one anyio
event loop in a daemon thread (`IOThread`), and the step loop only waits where it must: for the layer it
is about to compute (`LayerLoad.wait`), with a bound.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.chunkio.dest import CacheRows, Destination
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader, StoredChunk
from kvrestore.codec.checksums import host_checksum
from kvrestore.codec.quant import Encoding
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import LOAD_FAULTS, STORE_FAULTS, CorruptChunkError, InvalidInputError
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.integrations.vllm_layout import fp8_sections
from kvrestore.stores.base import ChunkStore

log = logging.getLogger("kvrestore.vllm")

T = TypeVar("T")


class IOThread:
    """One anyio event loop in a daemon thread; coroutines are submitted from any other thread."""

    def __init__(self) -> None:
        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        self._closed = False

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        return self.portal.start_task_soon(fn, *args)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        """Run `fn(*args)` on the loop and wait for it; TimeoutError (and the task cancelled) after
        `timeout` seconds."""

        async def bounded() -> T:
            with anyio.fail_after(timeout):
                return await fn(*args)

        return self.portal.call(bounded)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cm.__exit__(None, None, None)


class ChunkSaver:
    """Encodes (in `encoding`: `quant.ENCODINGS`) and writes chunks in the background; never blocks its
    caller.

    At most `max_bytes` of KV wait to be written (across every request); a chunk that does not fit is
    dropped and counted (`dropped`), with a warning: a dropped save is only a future cache miss. A write
    fault counts in `failed`, with one warning, and the store is then left alone for `retry_after_s`,
    as the scheduler side leaves a store alone that did not answer a lookup: chunks offered meanwhile are
    not copied out nor written, and count in `failed` (a read-only store or a missing bucket warns once
    per `retry_after_s`, not once per chunk).
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        io: IOThread,
        *,
        compression: str = "none",
        max_bytes: int = 1 << 30,
        lanes: int = 2,
        encoding: str = "native",
        seal: Seal | None = None,
        retry_after_s: float = 10.0,
        key_tile: int = 0,
    ) -> None:
        self.spec = spec
        #: native chunks of whole tiles are stored with their keys in tiles of this many tokens (0: not):
        #: the page size of a cache that keeps its keys so (`codec.layout`), set by the worker
        self.key_tile = key_tile
        self.retry_after_s = retry_after_s
        self._down_until = 0.0  # time.monotonic() until which writes are not tried
        self.store = store
        self.io = io
        self.seal = seal  # signs every chunk written, where the connector has a secret
        self.compression = compression
        self.encoding = codec.spec_encoding(spec, encoding).name  # `quant.ENCODINGS`: checked here
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.written = 0
        self.written_bytes = 0
        self.dropped = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._lanes = lanes
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop

    def submit(self, key: str, chunk: KVChunk) -> bool:
        """Queue `chunk` (its own memory: the caller must not reuse it) for writing under `key`."""
        if not self.reserve(key, chunk.nbytes):
            return False
        self.submit_reserved(key, chunk)
        return True

    def reserve(self, key: str, nbytes: int) -> bool:
        """Room in the queue for a chunk of `nbytes` to be written under `key`, taken before the chunk is
        copied out (a chunk that would be dropped is not copied at all); False, counted and warned, if
        there is none, or while the store is left alone after a write fault (counted in `failed`,
        silently). Then `submit_reserved` the chunk, or `unreserve` the room."""
        with self._lock:
            if time.monotonic() < self._down_until:
                self.failed += 1
                return False
            if self.pending_bytes + nbytes > self.max_bytes:
                self.dropped += 1
                dropped, pending = self.dropped, self.pending_bytes
            else:
                self.pending_bytes += nbytes
                dropped = None
        if dropped is not None:
            log.warning(
                "kvrestore: save queue full (%d of %d bytes waiting): dropped chunk %s (%d dropped so far)",
                pending,
                self.max_bytes,
                key[:12],
                dropped,
            )
            return False
        return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.pending_bytes -= nbytes

    def submit_reserved(
        self,
        key: str,
        chunk: KVChunk,
        ready: torch.cuda.Event | None = None,
        fp8_scales: torch.Tensor | None = None,
    ) -> None:
        """Queue `chunk`, whose room was reserved; with `ready`, its bytes (pinned host memory a copy from
        the GPU is still filling) are read once that event has completed, in the writer's thread. With
        `fp8_scales` ([L, 2]: each layer's K and V scale), `chunk.data` holds an fp8 cache's values (one
        byte each), stored as they are in fp8 chunks (`vllm_layout.fp8_sections`)."""
        fut = self.io.submit(self._write, key, chunk, chunk.nbytes, ready, fp8_scales)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(fut)

    async def _write(
        self,
        key: str,
        chunk: KVChunk,
        nbytes: int,
        ready: torch.cuda.Event | None = None,
        fp8_scales: torch.Tensor | None = None,
    ) -> None:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._lanes)

        def encode() -> bytes:
            if ready is not None:
                ready.synchronize()
            if fp8_scales is not None:
                enc = codec.spec_encoding(self.spec, self.encoding)
                return codec.encode_sections(
                    fp8_sections(chunk.data.cpu(), fp8_scales, enc),
                    chunk.start,
                    chunk.n_tokens,
                    self.spec,
                    key,
                    encoding=self.encoding,
                    compression=self.compression,
                    seal=self.seal,
                )
            tile = self.key_tile if self.encoding == "native" else 0
            if tile and chunk.n_tokens % tile:  # a chunk of part of a tile: keys row-major
                tile = 0
            return codec.encode_chunk(
                chunk,
                self.spec,
                key,
                compression=self.compression,
                encoding=self.encoding,
                seal=self.seal,
                key_tile=tile,
            )

        try:
            async with self._limiter:
                blob = await anyio.to_thread.run_sync(encode)
                await self.store.put(key, blob)
            with self._lock:
                self.written += 1
                self.written_bytes += len(blob)
        except STORE_FAULTS as exc:
            with self._lock:
                self.failed += 1
                first = time.monotonic() >= self._down_until  # the first fault since the store was up
                self._down_until = max(self._down_until, time.monotonic() + self.retry_after_s)
            if first:
                log.warning(
                    "kvrestore: could not save chunk %s (%s: %s); not saving to %s for %.0f s",
                    key[:12],
                    type(exc).__name__,
                    exc,
                    self.store.name,
                    self.retry_after_s,
                )
        finally:
            with self._lock:
                self.pending_bytes -= nbytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued write; False if some were still running after `timeout` seconds."""
        with self._lock:
            futures = list(self._futures)
        done, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done


@dataclass(frozen=True)
class LoadChunk:
    """A stored chunk of the prompt: its key and token range."""

    key: str
    start: int
    end: int


def covering(chunks: Sequence[LoadChunk], k: int) -> list[LoadChunk]:
    """`chunks`, checked to cover tokens [0, k) (a load's chunks)."""
    if not chunks or chunks[0].start != 0 or chunks[-1].end < k:
        raise InvalidInputError(f"chunks must cover tokens [0, {k})")
    return list(chunks)


def failed_token_ranges(chunks: Sequence[LoadChunk], failed: set[int], k: int) -> list[tuple[int, int]]:
    """Token ranges, within [0, k), of the `failed` chunks (indices into `chunks`)."""
    return [(chunks[j].start, min(chunks[j].end, k)) for j in sorted(failed) if chunks[j].start < k]


class Piece(NamedTuple):
    """One chunk's part of one layer that a load places: tokens [start, start + n_tokens).

    `data` is what was read and verified, not copied: in the native encoding a ``[2, H, T, D]`` view of
    the KV (T, the chunk's tokens, >= n_tokens), in another the section's bytes as stored (uint8), which
    `kv` decodes where the pages are."""

    start: int
    n_tokens: int
    data: torch.Tensor
    encoding: Encoding
    stored_tokens: int

    def kv(self, device: torch.device | None = None) -> torch.Tensor:
        """The piece's KV ``[2, H, n_tokens, D]`` in the model's dtype. Native: a view of the bytes read
        (the caller moves it). Encoded: decoded on `device` (default: the host), an encoded section
        going up as the small bytes it is and decoded on the current stream."""
        if self.encoding.native:
            return self.data[:, :, : self.n_tokens]
        sections = self.data.view(1, -1)
        if device is not None and device.type != "cpu":
            sections = sections.pin_memory().to(device, non_blocking=True)
        enc = self.encoding
        shape = (1, 2, enc.num_kv_heads, self.stored_tokens, enc.head_dim)
        out = torch.empty(shape, dtype=enc.dtype, device=sections.device)
        enc.decode(sections, out)
        return out[0, :, :, : self.n_tokens]


#: what a load hands its `place` for one layer: a `Piece` per chunk, in token order, together covering
#: tokens [0, upto)
Pieces = list[Piece]


class KeptSections(CacheRows):
    """A `LayerReader` destination (`chunkio.dest`) that keeps each verified section instead of copying
    it into a cache: an uncompressed section, checked against its checksum, is viewed as a tensor over
    the bytes read (no copy: vLLM's pages take the bytes from there, decoded on the way where the
    encoding is not native); a compressed one, or one whose keys another writer stored in tiles
    (`codec.layout`), is decoded into a tensor of its own. Each read's sections replace the last's."""

    def __init__(self) -> None:
        super().__init__()
        #: (chunk, layer) -> its section: the KV ``[2, H, T, D]``, or (encoded) its bytes as stored
        self.sections: dict[tuple[int, int], torch.Tensor] = {}
        self._read: range | None = None

    def place(
        self, reader: LayerReader, layers: range, j: int, data: bytes | memoryview, kv: KVCache
    ) -> None:
        if layers != self._read:  # a new read: the last one's were placed
            self.sections, self._read = {}, layers
        header, spec, enc = reader.headers[j], reader.spec, reader.encoding
        shape = (2, spec.num_kv_heads, header.n_tokens, spec.head_dim)
        raw = enc.section_bytes(header.n_tokens)
        for layer, stored in codec.span_sections(header, layers, data).items():
            section = header.layers[layer]
            copied = header.compression != "none" or codec.key_tile(header)
            if copied or section.length != raw or section.raw_length != raw:
                self.sections[j, layer] = codec.decode_layers(header, {layer: stored}, spec, [layer])[0]
                continue
            if len(stored) != section.length or host_checksum(stored) != section.checksum:
                raise CorruptChunkError(f"layer {layer}: section checksum mismatch")
            with warnings.catch_warnings():  # read-only bytes: nothing writes through the view
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(stored, dtype=torch.uint8)
            self.sections[j, layer] = flat.view(spec.dtype).view(shape) if enc.native else flat

    def piece(self, reader: LayerReader, j: int, layer: int, start: int, n_tokens: int) -> Piece:
        """Tokens [start, start + n_tokens) of chunk j's section of `layer`, as read."""
        data = self.sections[j, layer]
        encoded = data.dtype == torch.uint8 and not reader.encoding.native  # else KV: native or decoded
        enc = reader.encoding if encoded else codec.spec_encoding(reader.spec)
        return Piece(start, n_tokens, data, enc, reader.headers[j].n_tokens)


class ChunkLoad:
    """What every load of tokens [0, k) of one request from its stored chunks keeps: the chunks that did
    not load (`failed`, indices into `chunks`) and why (`errors`), the bytes read, the seconds the reads
    took (once every layer is read)."""

    def __init__(
        self, spec: ModelSpec, store: ChunkStore, chunks: Sequence[LoadChunk], k: int, seal: Seal | None
    ) -> None:
        self.spec = spec
        self.store = store
        self.seal = seal  # where set, a chunk without its valid MAC is a miss (`codec.seal`)
        self.chunks = covering(chunks, k)
        self.k = k
        self.failed: set[int] = set()
        self.errors: list[str] = []
        self.bytes_read = 0
        self.seconds: float | None = None
        self.cancelled = False

    def _fail(self, indices: Sequence[int] | range, errors: Sequence[str]) -> None:
        new = set(indices) - self.failed
        if new:
            self.failed |= new
            self.errors.extend(errors)

    def _upto(self) -> int:
        """Tokens placed: up to the first failed chunk (vLLM recomputes from there on)."""
        return min([self.k] + [self.chunks[j].start for j in self.failed])

    def failed_ranges(self) -> list[tuple[int, int]]:
        """Token ranges, within [0, k), whose KV did not load."""
        return failed_token_ranges(self.chunks, self.failed, self.k)


class BackgroundLoad(ChunkLoad):
    """A `ChunkLoad` run on the I/O thread through one `LayerReader` (`run`): the headers first, then the
    first layer alone (compute starts sooner) and `layers_per_read` layers at a time after it, each read
    placed into `rows` through the reader's `dest`, and each of its layers handed to
    `place_layer(i, layer, upto)` (`i`: the layer's place in the read, `upto`: the tokens to place).
    Chunks that are missing, damaged or of another model end in `failed`; a store fault or a timeout
    fails every chunk. `wait(layer)` blocks until the layer is placed (or given up); `cancel` stops
    placing layers: once it returns, nothing more is placed (placing runs under the lock it takes)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[LoadChunk],
        k: int,
        seal: Seal | None,
        *,
        dest: Destination,
        rows: KVCache,
        place_layer: Callable[[int, int, int], None],
        layers_per_read: int,
        **reader_options: Any,
    ) -> None:
        super().__init__(spec, store, chunks, k, seal)
        stored = [StoredChunk(c.key, c.start, c.start, c.end - c.start) for c in self.chunks]
        self.reader = LayerReader(spec, store, stored, seal=seal, dest=dest, **reader_options)
        self.rows = rows
        self.place_layer = place_layer
        self.layers_per_read = max(1, layers_per_read)
        self._lock = threading.Lock()
        self._events = [threading.Event() for _ in range(spec.num_layers)]
        self.future: concurrent.futures.Future[None] | None = None
        self.deadline: float | None = None  # time.monotonic() by which every layer must be placed
        self._t0 = time.perf_counter()

    def start(self, io: IOThread, timeout: float | None = None) -> None:
        """Run the load on `io`'s loop; every layer must be placed within `timeout` seconds."""
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.future = io.submit(self._guarded)

    async def run(self) -> None:
        """Open the reader's chunks (failing those that do not check out), then read and place every
        layer, failing the chunks a read names; after each read, `place_layer` for its layers under the
        lock and unless cancelled, and wake each layer's waiter."""
        reader = self.reader
        ok = await reader.open()
        self._fail([j for j, good in enumerate(ok) if not good], reader.errors)
        L, step = self.spec.num_layers, self.layers_per_read
        for layers in [range(0, 1), *(range(a, min(a + step, L)) for a in range(1, L, step))]:
            if self.cancelled:
                break
            if len(self.failed) < len(self.chunks):
                try:
                    await reader.read_layers(layers, self.rows)
                except ChunkLoadFailed as exc:
                    self._fail(exc.indices, [exc.error])
            for i, layer in enumerate(layers):
                with self._lock:
                    upto = self._upto()
                    if not self.cancelled and upto > 0:
                        self.place_layer(i, layer, upto)
                self._placed(layer, reader.bytes_read)

    async def _guarded(self) -> None:
        """`run`, with every fault failing the load (vLLM then recomputes) and every layer's event set at
        the end, so the step loop is never left waiting."""
        self._t0 = time.perf_counter()
        try:
            await self.run()
        except (*LOAD_FAULTS, *STORE_FAULTS) as exc:
            self._fail(range(len(self.chunks)), [f"{type(exc).__name__}: {exc}"])
        except BaseException as exc:  # a bug: still never leave the step loop waiting
            self._fail(range(len(self.chunks)), [f"{type(exc).__name__}: {exc}"])
            if not isinstance(exc, (Exception, anyio.get_cancelled_exc_class())):
                raise
            log.exception("kvrestore: loading failed")
        finally:
            for ev in self._events:
                ev.set()

    def _placed(self, layer: int, bytes_read: int) -> None:
        """Layer `layer` is placed: wake whoever waits for it. Before the last layer's wake-up, the
        load's `bytes_read` and `seconds` are set: the step loop reads them once every layer is placed."""
        if layer == self.spec.num_layers - 1:
            self.bytes_read = bytes_read
            self.seconds = time.perf_counter() - self._t0
        self._events[layer].set()

    def wait(self, layer: int) -> bool:
        """Block until `layer` is placed or given up; False (and the load cancelled, every chunk failed)
        if the deadline passed first."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        if self._events[layer].wait(timeout):
            return True
        self.cancel(f"layer {layer} not loaded by the deadline")
        return False

    def cancel(self, why: str) -> None:
        """Stop placing layers (nothing is written after this returns); every chunk counts as failed."""
        with self._lock:
            if not self.cancelled:
                self.cancelled = True
                if not all(ev.is_set() for ev in self._events):
                    self._fail(range(len(self.chunks)), [why])
        if self.future is not None:
            self.future.cancel()
        for ev in self._events:
            ev.set()


class LayerLoad(BackgroundLoad):
    """A `BackgroundLoad` that hands each layer's verified KV to `place(layer, pieces)` as `Pieces`
    covering tokens [0, T) (T = k, or the start of the first failed chunk), each over the bytes read
    where the chunk is stored uncompressed (`KeptSections`; decoded by `Piece.kv` where its `encoding`
    is not native); `place` writes it where the engine wants it, on the I/O thread. The load for a host
    cache and for caches `DeviceLayerLoad` does not take (`vllm_device`). Only chunks in `encoding` are
    read: another is foreign (`codec.check_header`)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[LoadChunk],
        k: int,
        place: Callable[[int, Pieces], None],
        layers_per_read: int = 4,
        encoding: str = "native",
        seal: Seal | None = None,
    ) -> None:
        self.place = place
        self.kept = KeptSections()
        # the sections stay in `kept`, not in a cache
        rows = KVCache.empty(spec, 0)
        super().__init__(
            spec,
            store,
            chunks,
            k,
            seal,
            dest=self.kept,
            rows=rows,
            place_layer=self._pieces,
            layers_per_read=layers_per_read,
            encoding=encoding,
        )

    def _pieces(self, _: int, layer: int, upto: int) -> None:
        pieces = [
            self.kept.piece(self.reader, j, layer, c.start, min(c.end, upto) - c.start)
            for j, c in enumerate(self.chunks)
            if c.start < upto
        ]
        self.place(layer, pieces)
