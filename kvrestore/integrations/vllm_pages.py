"""Loading stored chunks straight into vLLM's host pages (its CPU backend), without vLLM.

`HostPageLoad` is the connector's load on the CPU from a store that reads without the event loop
(`ChunkStore.reads_sync`: a local directory, this process's memory) of chunks stored uncompressed and
native. Each layer is read as vLLM asks for it (`wait`), on vLLM's step thread: no thread of ours
competes with vLLM's compute threads (pinned to the host's cores, they stall at every barrier while
another thread holds one of them).

* values go from the file into the pages with one `preadv` (`ChunkStore.scatter_into_sync`): the "cpu"
  layout keeps a page's values row-major, as a stored section does;
* keys, which the pages keep column-major, go in the same `preadv` where the connector saved them so
  (tiles of one page, `codec.layout`) and the chunk covers whole pages; otherwise (another writer or
  page size, a last partial page) into a small staging buffer, transposed into the pages once verified;
* every section is checked where its bytes landed (`codec.check_section`): against its xxh3-64, or
  with a secret its GMAC tag (`codec.seal`), before `wait` hands the layer to vLLM.

A chunk whose header or section does not check out is failed: vLLM recomputes its blocks (with the
recompute policy, all after them too), so damaged bytes written into its pages are never used.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvrestore import codec
from kvrestore.chunkio.load import PROBE_BYTES
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import (
    LOAD_FAULTS,
    STORE_FAULTS,
    ChunkDecodeError,
    CorruptChunkError,
    MissingChunkError,
    TruncatedChunkError,
    proves_damage,
)
from kvrestore.core.spec import ModelSpec
from kvrestore.integrations.vllm_io import IOThread, LoadChunk
from kvrestore.integrations.vllm_layout import _INT_OF_SIZE, _pages
from kvrestore.integrations.vllm_load import ChunkLoad
from kvrestore.integrations.vllm_stats import log
from kvrestore.stores.base import ChunkStore


class CompressedChunkError(ChunkDecodeError):
    """A chunk stored compressed, which a load straight into the pages cannot read (not damaged: kept)."""


def applies(store: ChunkStore, layout: str, encoding: str, compression: str) -> bool:
    """Whether a load can go straight into the pages: vLLM's host layout, a store that reads without
    the event loop, chunks saved uncompressed in the native encoding."""
    return layout == "cpu" and store.reads_sync and encoding == "native" and compression == "none"


class HostLayer:
    """One layer of vLLM's host cache (``[num_blocks, H, block_size, 2 * D]``, "cpu" layout) as bytes: per
    (page, head) the keys as ``[D, block_size]``, then the values as ``[block_size, D]``."""

    def __init__(self, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
        nb, _, bs, _ = cache.shape
        self.block_size = int(bs)
        self.row = head_dim * cache.element_size()  # one token's K (or V) of one head, in bytes
        self.half = self.block_size * self.row  # a page's keys (or values) of one head
        nbytes = cache.numel() * cache.element_size()
        self.bytes = memoryview((ctypes.c_ubyte * nbytes).from_address(cache.data_ptr())).cast("B")
        self.heads = num_kv_heads
        # the keys as numpy [num_blocks, H, block_size, D] (a transposed view) of same-sized integers
        # (numpy has no bfloat16), for the transposing copy
        words = cache.view(_INT_OF_SIZE[cache.element_size()]).view(nb, num_kv_heads, 2, head_dim, bs)
        self.keys = words[:, :, 0].transpose(2, 3).numpy()


class _ChunkPlan:
    """Where one chunk's tokens [start, start + n) go in a request's pages, the same for every layer:
    its values as byte ranges of a layer's cache (in the order a section holds them: head by head,
    page by page), and its keys the same way where the writer stored them in tiles of one page each
    (`codec.layout`) and the chunk starts and ends on a page boundary, else as one transposing copy
    from staging (by whole consecutive pages where it can)."""

    def __init__(
        self, n: int, stored: int, pages: list[tuple[int, int, int, int]], host: HostLayer, tile: int = 0
    ) -> None:
        self.n, self.stored, self.pages, self.tile = n, stored, pages, tile
        tail = (stored - n) * host.row
        bs = host.block_size
        whole = all(a == 0 and b == bs for _, a, b, _ in pages)
        #: (offset, length) in a layer's bytes; length < 0: a tail, past k (in staging, hashed only)
        self.values = self._ranges(pages, host, 1, tail, 0)
        self.keys = self._ranges(pages, host, 0, tail, host.heads * tail) if tile == bs and whole else None
        blocks = [block for block, _, _, _ in pages]
        consecutive = all(b == a + 1 for a, b in itertools.pairwise(blocks))
        self.run = blocks[0] if pages and whole and consecutive else None

    @staticmethod
    def _ranges(
        pages: list[tuple[int, int, int, int]], host: HostLayer, half: int, tail: int, tails_at: int
    ) -> list[tuple[int, int]]:
        """The keys' (`half` 0) or the values' (1) byte ranges of `pages`, head by head, each head's
        tokens past k (`tail` bytes) at `tails_at` in the tails."""
        out: list[tuple[int, int]] = []
        for h in range(host.heads):
            for block, a, b, _ in pages:
                out.append(
                    (((block * host.heads + h) * 2 + half) * host.half + a * host.row, (b - a) * host.row)
                )
            if tail:
                out.append((tails_at + h * tail, -tail))
        return out

    def views(
        self, ranges: list[tuple[int, int]], layer_bytes: memoryview, tails: memoryview
    ) -> list[memoryview]:
        return [layer_bytes[o : o + n] if n > 0 else tails[o : o - n] for o, n in ranges]

    def place_keys(self, dest: np.ndarray, keys: np.ndarray) -> None:
        """Copy staged keys (``[H, T, D]``; as stored, in tiles where the writer tiled them) into a
        layer's keys (`HostLayer.keys`), transposing."""
        if self.tile:  # another page size or a cut chunk: row-major first (a second copy, the rare case)
            H, T, D = keys.shape
            rows = np.empty_like(keys)
            np.copyto(
                rows.reshape(H, T // self.tile, self.tile, D),
                keys.reshape(H, -1, D, self.tile).swapaxes(2, 3),
            )
            keys = rows
        if self.run is not None:  # [H, P * bs, D] -> [P, H, bs, D]: one copy per head
            P = len(self.pages)
            H, _, D = keys.shape
            src = keys[:, : self.n].reshape(H, P, self.n // P, D)
            out = dest[self.run : self.run + P]
            for h in range(H):  # a 3-D copy per head, which numpy walks better than one 4-D copy
                np.copyto(out[:, h], src[h])
            return
        for h in range(keys.shape[0]):
            for block, a, b, at in self.pages:
                np.copyto(dest[block, h, a:b], keys[h, at : at + b - a])


class HostPageLoad(ChunkLoad):
    """Loads tokens [0, k) of one request straight into vLLM's host pages, layer by layer as vLLM asks
    for them (`wait`, on the step thread); its `seconds` are the time spent reading (what the link took)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[LoadChunk],
        k: int,
        layers: Sequence[HostLayer],
        block_ids: Sequence[int],
        layers_per_read: int = 4,
        seal: Seal | None = None,
    ) -> None:
        super().__init__(spec, store, chunks, k, seal)
        self.layers = list(layers)
        self.block_ids = list(block_ids)
        self.layers_per_read = max(1, layers_per_read)
        self._headers: dict[int, codec.ChunkHeader] = {}
        self._read_upto = 0  # layers below this one are read
        self._spent = 0.0
        self._plans: dict[int, _ChunkPlan] = {}
        self._staging: list[tuple[np.ndarray, memoryview]] = []  # per layer of a read: keys, tails
        self._io: IOThread | None = None
        #: the deletes of damaged chunks, running on the I/O thread (nothing waits for them)
        self.deletes: list[concurrent.futures.Future[None]] = []

    def start(self, io: IOThread, timeout: float | None = None) -> None:
        """Check every chunk's header (a small read each); the sections are read by `wait`. `io` deletes
        damaged objects in the background; reads are local, so `timeout` does not apply."""
        self._io = io
        t = time.perf_counter()
        self._each(self._header)
        self._spent += time.perf_counter() - t

    def _header(self, j: int) -> None:
        c = self.chunks[j]
        probe = bytearray(PROBE_BYTES)
        got = self.store.scatter_into_sync(c.key, 0, [memoryview(probe)])
        if got is None:
            raise MissingChunkError("not in the store")
        head = memoryview(probe)[:got]
        if codec.header_length(head) > got:
            raise CorruptChunkError(f"header longer than {PROBE_BYTES} bytes")
        header = codec.probe_header(head, self.spec, c.key, c.start, c.end - c.start, "native", self.seal)
        if header.compression != "none":
            raise CompressedChunkError(f"stored {header.compression}-compressed, read here uncompressed only")
        self._headers[j] = header

    def wait(self, layer: int) -> bool:
        """Read every layer up to `layer`'s group that is not read yet; True (a read cannot outlast a
        deadline: the store is local)."""
        L = self.spec.num_layers
        while self._read_upto <= layer < L and not self.cancelled:
            a = self._read_upto
            b = 1 if a == 0 else min(a + self.layers_per_read, L)  # the first alone: compute starts sooner
            t = time.perf_counter()
            self._each(functools.partial(self._read, layers=range(a, b)), bugs=(Exception,))
            self._spent += time.perf_counter() - t
            self._read_upto = b
            if b == L:
                self.seconds = self._spent
        return True

    def _each(self, read: Callable[[int], None], bugs: tuple[type[Exception], ...] = ()) -> None:
        """`read(j)` for each chunk j holding tokens below k and not failed: a store fault fails every
        chunk, a load fault chunk j, and an exception of `bugs` (logged) the whole load."""
        for j, c in enumerate(self.chunks):
            if j in self.failed or c.start >= self.k:  # a store fault on an earlier chunk failed them all
                continue
            try:
                read(j)
            except STORE_FAULTS as exc:
                self._fault(range(len(self.chunks)), f"{type(exc).__name__}: {exc}")
            except LOAD_FAULTS as exc:
                self._fault([j], f"chunk {c.key[:12]}: {type(exc).__name__}: {exc}", exc, c.key)
            except bugs as exc:  # a bug: fail the load (vLLM recomputes), never vLLM's step
                log.exception("kvrestore: loading into host pages failed")
                self._fault(range(len(self.chunks)), f"{type(exc).__name__}: {exc}")

    def _plan(self, j: int) -> _ChunkPlan:
        plan = self._plans.get(j)
        if plan is None:
            c, host = self.chunks[j], self.layers[0]
            n = min(c.end, self.k) - c.start  # tokens placed; the rest of the section is read to be verified
            pages = list(_pages(self.block_ids, c.start, c.start + n, host.block_size))
            header = self._headers[j]
            plan = self._plans[j] = _ChunkPlan(n, header.n_tokens, pages, host, codec.key_tile(header))
        return plan

    def _stage(self, i: int, plan: _ChunkPlan, host: HostLayer) -> tuple[np.ndarray, memoryview]:
        """Staging for the keys of the i-th layer of a read (``[H, T, D]``), and room for its tokens past
        k (a part per head: they are hashed after the read), made once per load for the longest chunk."""
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        staging = self._staging
        if i == len(staging):
            most = max(h.n_tokens for h in self._headers.values())
            keys = np.empty(H * most * D, dtype=host.keys.dtype)
            staging.append((keys, memoryview(bytearray(2 * H * most * host.row))))
        keys, tails = staging[i]
        return keys[: H * plan.stored * D].reshape(H, plan.stored, D), tails

    def _read(self, j: int, layers: range) -> None:
        """Chunk j's sections of `layers` in one scatter read: values into the pages, keys too where they
        are stored as the pages keep them (`_ChunkPlan.keys`), else into staging; verified where they
        landed, then any staged keys transposed into the pages."""
        c, header, plan = self.chunks[j], self._headers[j], self._plan(j)
        first, end = codec.layer_span(header, layers)
        if not codec.back_to_back(header, layers):
            raise CorruptChunkError("sections are not back to back")
        staged: list[tuple[np.ndarray, HostLayer]] = []
        buffers: list[memoryview] = []
        parts: list[list[memoryview]] = []
        for i, layer in enumerate(layers):
            host = self.layers[layer]
            keys, tails = self._stage(i, plan, host)
            if plan.keys is None:  # through staging, then transposed into the pages
                staged.append((keys, host))
                mine = [keys.data.cast("B"), *plan.views(plan.values, host.bytes, tails)]
            else:  # keys and values straight into the pages: one copy
                mine = plan.views(plan.keys, host.bytes, tails) + plan.views(plan.values, host.bytes, tails)
            parts.append(mine)
            buffers.extend(mine)
        past_end = memoryview(bytearray(1))  # filled only if the object is longer than its header says
        placed = self.store.scatter_into_sync(c.key, first, [*buffers, past_end])
        if placed is None:
            raise MissingChunkError("disappeared from the store")
        if placed < end - first:
            raise TruncatedChunkError(f"object is {first + placed} bytes, its header says {end} or more")
        if layers[-1] == len(header.layers) - 1 and placed > end - first:
            raise CorruptChunkError(f"object has bytes past the last section (at byte {end})")
        self.bytes_read += end - first
        for layer, mine in zip(layers, parts, strict=True):  # signed: against its tag (`codec.seal`)
            codec.check_section(header, layer, mine, self.seal)
        for keys, host in staged:
            plan.place_keys(host.keys, keys)

    def _fault(
        self, indices: Sequence[int] | range, error: str, exc: BaseException | None = None, key: str = ""
    ) -> None:
        """Fail chunks `indices` for `error`, deleting in the background an object its bytes proved
        damaged (`exc`)."""
        self._fail(indices, [error])
        damaged = exc is not None and proves_damage(exc)  # a compressed or missing chunk is not damaged
        if damaged and self._io is not None:  # as `LayerReader` does: never served again
            self.deletes.append(self._io.submit(self.store.delete, key))

    def cancel(self, why: str) -> None:
        """Stop reading; unless every layer was read, every chunk counts as failed."""
        if not self.cancelled:
            self.cancelled = True
            if self._read_upto < self.spec.num_layers:
                self._fault(range(len(self.chunks)), why)
