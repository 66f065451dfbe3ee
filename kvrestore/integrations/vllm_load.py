"""The vLLM connector's loads, without vLLM: what every load of a request's chunks keeps (`ChunkLoad`),
one run on the I/O thread through a `LayerReader` (`BackgroundLoad`), and one that hands each layer's
verified KV over as `Pieces` (`LayerLoad`). The others: `vllm_device.DeviceLayerLoad` (into CUDA pages)
and `vllm_pages.HostPageLoad` (on the step's thread, straight into host pages).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio
import torch

from kvrestore import codec
from kvrestore.chunkio.dest import CacheRows, Destination
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader, StoredChunk
from kvrestore.codec.quant import Encoding
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import LOAD_FAULTS, STORE_FAULTS, CorruptChunkError, InvalidInputError
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.integrations.vllm_io import IOThread, LoadChunk
from kvrestore.integrations.vllm_stats import log
from kvrestore.stores.base import ChunkStore


class Piece(NamedTuple):
    """Tokens [start, start + n_tokens) of one chunk's section of one layer. `data` is what was read and
    verified, not copied: native, a ``[2, H, T, D]`` view of the KV (T, the chunk's tokens, >=
    n_tokens); encoded, the section's bytes as stored (uint8), which `kv` decodes where the pages are."""

    start: int
    n_tokens: int
    data: torch.Tensor
    encoding: Encoding
    stored_tokens: int

    def kv(self, device: torch.device | None = None) -> torch.Tensor:
        """The piece's KV ``[2, H, n_tokens, D]`` in the model's dtype: native, a view of the bytes read
        (the caller moves it); encoded, decoded on `device` (default: the host; on a device, on the
        current stream, after the small encoded bytes go up)."""
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
    it into a cache: an uncompressed one, checked against its checksum, as a tensor over the bytes read
    (vLLM's pages take them from there); a compressed one, or one whose keys are stored in tiles
    (`codec.layout`), decoded into a tensor of its own. Each read's sections replace the last's."""

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
                sections = {layer: stored}
                self.sections[j, layer] = codec.decode_layers(
                    header, sections, spec, [layer], seal=reader.seal
                )[0]
                continue
            if len(stored) != section.length:
                raise CorruptChunkError(
                    f"layer {layer}: {len(stored)} bytes for a {section.length}-byte section"
                )
            codec.check_section(header, layer, stored, reader.seal)
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
    """What every load of tokens [0, k) of a request's stored chunks keeps: the chunks that did not load
    (`failed`, indices into `chunks`) and why (`errors`), the bytes read, the seconds the reads took
    (once every layer is read). `chunks` must cover [0, k)."""

    def __init__(
        self, spec: ModelSpec, store: ChunkStore, chunks: Sequence[LoadChunk], k: int, seal: Seal | None
    ) -> None:
        self.spec = spec
        self.store = store
        self.seal = seal  # where set, a chunk without its valid MAC is a miss (`codec.seal`)
        if not chunks or chunks[0].start != 0 or chunks[-1].end < k:
            raise InvalidInputError(f"chunks must cover tokens [0, {k})")
        self.chunks = list(chunks)
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
        failed = [self.chunks[j] for j in sorted(self.failed)]
        return [(c.start, min(c.end, self.k)) for c in failed if c.start < self.k]


class BackgroundLoad(ChunkLoad):
    """A `ChunkLoad` run on the I/O thread through one `LayerReader` (`run`): the headers, then the first
    layer alone (compute starts sooner) and `layers_per_read` layers at a time, each read placed into
    `rows` through the reader's `dest` and each of its layers handed to `place_layer(i, layer, upto)`
    (`i`: its place in the read, `upto`: the tokens to place). Chunks missing, damaged or of another
    model end in `failed`; a store fault or a timeout fails every chunk. `wait(layer)` blocks until the
    layer is placed or given up; once `cancel` returns nothing more is placed (it takes the lock)."""

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
        """Open the reader's chunks (failing those that do not check out), then read every layer, failing
        the chunks a read names; after each read, `place_layer` for its layers (under the lock, unless
        cancelled) and wake each layer's waiter."""
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
                if layer == L - 1:  # set before the wake-up: the step loop reads them once all is placed
                    self.bytes_read = reader.bytes_read
                    self.seconds = time.perf_counter() - self._t0
                self._events[layer].set()

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
    """A `BackgroundLoad` that hands each layer's verified KV, on the I/O thread, to `place(layer,
    pieces)` as `Pieces` covering tokens [0, T) (T = k, or the start of the first failed chunk), over
    the bytes read where stored uncompressed (`KeptSections`). The load for a host cache and for caches
    `DeviceLayerLoad` does not take. Only chunks in `encoding` are read: another is foreign."""

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
        super().__init__(
            spec,
            store,
            chunks,
            k,
            seal,
            dest=self.kept,
            rows=KVCache.empty(spec, 0),  # the sections stay in `kept`, not in a cache
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
