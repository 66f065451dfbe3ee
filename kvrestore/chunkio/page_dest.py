"""An engine's pages as destinations of a layer load (`layer_load.LayerLoad`): each layer read goes into
the request's pages (`pages.PagedCache`) as soon as the read has verified it.

* `SectionPages`: the host path. The reader keeps each verified section as read (`KeptSections`: a
  view of the bytes where stored uncompressed and native, else decoded), and each layer goes into the
  pages, a `Piece` per chunk, decoded where the pages are (an fp8 cache's quantized with its
  scales, `pages.fp8_values`). With `heads` it takes some heads of each chunk only (a tensor-parallel
  rank's of a chunk of more heads), read by head where the chunk has per-head checks.
* `RowPages`: the device path. A read lands checked in a device buffer of its layers (the reader's
  `CacheRows(per_read=True)`), and each layer's rows go into the pages with one indexed copy for K and
  one for V.

Where the pages are written (`PageWrites`): on a CUDA cache on the load's own stream, on the reading
thread, with an event per layer that the engine's stream waits for (the host never waits for a layer);
on a host cache by the thread that waits for the layer (the engine's), which then writes what the reads
queued for it: no thread of ours copies beside the engine's compute threads.

`host_pages.HostPages` is the third: the reader fills vLLM's CPU pages straight from the store.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from kvrestore import codec
from kvrestore.chunkio.dest import CacheRows
from kvrestore.chunkio.pages import PagedCache, fp8_values, scatter
from kvrestore.codec.quant import Encoding
from kvrestore.core.errors import CorruptChunkError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.core.streams import on_stream

if TYPE_CHECKING:
    from kvrestore.chunkio.layer_load import LayerLoad
    from kvrestore.chunkio.layers import LayerReader


class Piece(NamedTuple):
    """Tokens [start, start + n_tokens) of one chunk's section of one layer, `skip` tokens into it. `data`
    is what was read and verified, not copied: native, a ``[2, H, T, D]`` view of the KV (T, the chunk's
    tokens); encoded, the section's bytes as stored (uint8), which `kv` decodes where the pages are."""

    start: int
    n_tokens: int
    data: torch.Tensor
    encoding: Encoding
    stored_tokens: int
    skip: int = 0

    def kv(self, device: torch.device | None = None) -> torch.Tensor:
        """The piece's KV ``[2, H, n_tokens, D]`` in the model's dtype: native, a view of the bytes read
        (the caller moves it); encoded, decoded on `device` (default: the host; on a device, on the
        current stream, after the small encoded bytes go up)."""
        a, b = self.skip, self.skip + self.n_tokens
        if self.encoding.native:
            return self.data[:, :, a:b]
        sections = self.data.view(1, -1)
        if device is not None and device.type != "cpu":
            sections = sections.pin_memory().to(device, non_blocking=True)
        enc = self.encoding
        shape = (1, 2, enc.num_kv_heads, self.stored_tokens, enc.head_dim)
        out = torch.empty(shape, dtype=enc.dtype, device=sections.device)
        enc.decode(sections, out)
        return out[0, :, :, a:b]


class Writes(Protocol):
    """Where a page destination's layers go: `PageWrites`, or anything that takes the pieces of each layer."""

    #: whether `put` keeps the pieces for the layer's waiter, who writes them later (their data must
    #: then outlive the read that made it)
    queues: bool

    def put(self, layer: int, pieces: list[Piece]) -> None:
        """`pieces` of `layer`, read and verified (on the reading thread)."""
        ...

    def flush(self, layer: int) -> None:
        """The engine is about to run `layer` (on its thread)."""
        ...


class PageWrites:
    """Writes a load's layers into the request's pages (`block_ids` of `paged`): on `stream` as they come
    (CUDA), an event per layer recorded there, or, without a stream, queued until the layer's waiter
    writes them (`flush`)."""

    def __init__(
        self, paged: PagedCache, block_ids: Sequence[int], stream: torch.cuda.Stream | None = None
    ) -> None:
        self.paged = paged
        self.block_ids = list(block_ids)
        self.stream = stream
        self.queues = stream is None
        self._queued: dict[int, list[Piece]] = {}
        self._placed: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def put(self, layer: int, pieces: list[Piece]) -> None:
        """Write `pieces` (of `layer`) now, on the stream, or queue them for the layer's waiter."""
        if self.stream is None:
            with self._lock:
                self._queued.setdefault(layer, []).extend(pieces)
            return
        with on_stream(self.stream):
            self._write(layer, pieces)
            placed = torch.cuda.Event()
            placed.record(self.stream)
            self._placed[layer] = placed

    def flush(self, layer: int) -> None:
        """On the layer's waiter: write what is queued for `layer`, or make the current stream wait (on the
        device) for what the load stream wrote of it."""
        with self._lock:
            pieces = self._queued.pop(layer, [])
        self._write(layer, pieces)
        placed = self._placed.get(layer)
        if placed is not None:
            torch.cuda.current_stream(self.paged.device).wait_event(placed)

    def _write(self, layer: int, pieces: list[Piece]) -> None:
        k, v, scales, device = self.paged.k[layer], self.paged.v[layer], self.paged.scales, self.paged.device
        for p in pieces:
            data = fp8_values(p, scales[layer], device) if scales is not None else p.kv(device)
            scatter(k, v, self.block_ids, p.start, data)


class KeptSections(CacheRows):
    """A `LayerReader` destination that keeps each verified section instead of copying it into a cache:
    an uncompressed one, checked against its checksum, as a tensor over the bytes read; a compressed
    one, or one whose keys are stored in tiles (`codec.layout`), decoded into a tensor of its own. Each
    read's sections replace the last's.

    With `heads` [a, b) it takes those heads of each chunk only (a tensor-parallel rank's of a chunk of
    more heads: `dest.Destination`): of a chunk with per-head checks the reader reads just their bytes,
    each head verified here (`codec.check_heads`); of another, the sections whole, verified, and each
    piece is cut to the heads (native: a view; encoded: decoded on the host first)."""

    def __init__(self, heads: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.heads = heads
        #: (chunk, layer) -> its section: the KV ``[2, H, T, D]`` (H: `heads`' where read by head), or
        #: (encoded) its bytes as stored
        self.sections: dict[tuple[int, int], torch.Tensor] = {}
        self._read: range | None = None

    def place(
        self, reader: LayerReader, layers: range, j: int, data: bytes | memoryview, kv: KVCache
    ) -> None:
        if layers != self._read:  # a new read: the last one's were placed
            self.sections, self._read = {}, layers
        if reader.by_head(j):
            self._place_heads(reader, layers, j, data)
            return
        header, spec, enc = reader.headers[j], reader.spec, reader.encoding
        shape = (2, spec.num_kv_heads, header.n_tokens, spec.head_dim)
        raw = enc.section_bytes(header.n_tokens)
        for layer, stored in codec.span_sections(header, layers, data).items():
            section = header.layers[layer]
            copied = header.compression != "none" or codec.key_tile(header)
            if copied or section.length != raw or section.raw_length != raw:
                self.sections[j, layer] = codec.decode_layers(
                    header, {layer: stored}, spec, [layer], seal=reader.seal
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

    def _place_heads(self, reader: LayerReader, layers: range, j: int, data: bytes | memoryview) -> None:
        """Keep chunk j's sections of `heads` (`data`: their bytes, `codec.head_sections`), each head
        verified first: untiled, as a tensor over the bytes read; tiled, decoded into one of its own."""
        assert self.heads is not None
        header, spec, (a, b) = reader.headers[j], reader.spec, self.heads
        shape = (2, b - a, header.n_tokens, spec.head_dim)
        checks = reader.head_checks[j]
        for layer, stored in codec.head_sections(header, layers, self.heads, data).items():
            if codec.key_tile(header):
                self.sections[j, layer] = codec.decode_heads(checks, {layer: stored}, spec, self.heads, [layer])[0]
                continue
            codec.check_heads(checks, layer, self.heads, stored)
            with warnings.catch_warnings():  # read-only bytes: nothing writes through the view
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(stored, dtype=torch.uint8)
            self.sections[j, layer] = flat.view(spec.dtype).view(shape)

    def pieces(self, load: LayerLoad, layer: int, upto: int) -> list[Piece]:
        """Tokens [load.first, upto) of `layer`, a `Piece` per chunk, as read."""
        reader = load.reader
        out = []
        for j, c in enumerate(reader.chunks):
            a, b = max(c.start, load.first), min(c.end, upto)
            if a < b:
                out.append(self.piece(reader, j, layer, a, b - a, a - c.start))
        return out

    def piece(
        self, reader: LayerReader, j: int, layer: int, start: int, n_tokens: int, skip: int = 0
    ) -> Piece:
        """Tokens [start, start + n_tokens) of chunk j's section of `layer`, `skip` tokens into it, as read."""
        data = self.sections[j, layer]
        encoded = data.dtype == torch.uint8 and not reader.encoding.native  # else KV: native or decoded
        enc = reader.encoding if encoded else codec.spec_encoding(reader.spec)
        piece = Piece(start, n_tokens, data, enc, reader.headers[j].n_tokens, skip)
        if self.heads is None:
            return piece
        a, b = self.heads
        ours = codec.spec_encoding(dataclasses.replace(reader.spec, num_kv_heads=b - a))
        if not encoded and data.shape[1] == b - a:  # read by head: the heads' KV only
            return piece._replace(encoding=ours)
        return Piece(start, n_tokens, piece.kv()[:, a:b], ours, n_tokens)  # cut: a view where native


class SectionPages(KeptSections):
    """The pages, from the sections a read kept (module doc): the host path of a layer load."""

    def __init__(self, writes: Writes, heads: tuple[int, int] | None = None) -> None:
        super().__init__(heads)
        self.writes = writes

    def ready(self, load: LayerLoad, i: int, layer: int, upto: int) -> None:
        self.writes.put(layer, self.pieces(load, layer, upto))

    def waited(self, layer: int) -> None:
        self.writes.flush(layer)


class RowPages(CacheRows):
    """The pages, from a device buffer each read lands in checked (module doc): the device path of a layer
    load, whose `rows` buffer holds the layers of one read, its chunks from the first one's start."""

    def __init__(self, writes: Writes) -> None:
        super().__init__(per_read=True)
        self.writes = writes

    def ready(self, load: LayerLoad, i: int, layer: int, upto: int) -> None:
        base = load.reader.chunks[0].start  # the buffer's first token
        rows = load.rows.data[i, :, :, load.first - base : upto - base]
        if self.writes.queues:  # the next read reuses the buffer before the waiter writes these
            rows = rows.clone()
        native = codec.spec_encoding(load.reader.spec)  # the read decoded them into the buffer
        self.writes.put(layer, [Piece(load.first, upto - load.first, rows, native, int(rows.shape[2]))])

    @staticmethod
    def buffer(
        spec: ModelSpec,
        chunks: Sequence[ChunkRef],
        layers_per_read: int,
        device: torch.device,
        stream: torch.cuda.Stream | None = None,
    ) -> KVCache:
        """The buffer on `device` one read of `layers_per_read` layers of `chunks` lands in (from the first
        chunk's first token), made on `stream`: freed once the stream's copies out of it are done."""
        n = max(1, layers_per_read)
        T = chunks[-1].end - chunks[0].start
        with on_stream(stream, device):
            data = torch.empty((n, 2, spec.num_kv_heads, T, spec.head_dim), dtype=spec.dtype, device=device)
        return KVCache(spec, data)

    def waited(self, layer: int) -> None:
        self.writes.flush(layer)
