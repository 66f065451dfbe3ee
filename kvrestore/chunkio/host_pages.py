"""Host pages the reader fills straight from the store (`HostPages`, a `dest.Lands` destination).

For pages that keep each (page, head)'s values row-major (``[block_size, D]``) and its keys column-major
(``[D, block_size]``), as vLLM's CPU pages do, a layer read of a store that reads without the event loop
(`ChunkStore.reads_sync`: a local directory, this process's memory) of chunks stored uncompressed and
native runs on the thread that asks for the layer (`LayerReader.read_layers_sync`): no thread of ours
competes with the engine's compute threads (pinned to the host's cores, they stall at every barrier
while another thread holds one of them).

* values go from the file into the pages with one `preadv` (`ChunkStore.scatter_into_sync`): a stored
  section keeps them row-major, as the pages do;
* keys go in the same `preadv` where the writer stored them in tiles of one page (`codec.layout`) and the
  tokens placed cover whole pages; otherwise (another writer or page size, a partial page) into a small
  staging buffer, turned into the pages' layout once verified;
* tokens of a chunk outside the load's [first, k) (the part an engine's own prefix cache holds, the
  tokens past k) go aside: read and verified, never written into the pages.

Every section is verified where its bytes landed (`codec.check_section`), by the reader.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvrestore.chunkio.dest import Landing
from kvrestore.chunkio.pages import Page, PagedCache, as_words, pages_of
from kvrestore.codec import key_tile
from kvrestore.codec.layout import host_tiles
from kvrestore.core.errors import ChunkDecodeError

if TYPE_CHECKING:
    from kvrestore.chunkio.layers import LayerReader


class CompressedChunkError(ChunkDecodeError):
    """A chunk stored compressed, which a read straight into the pages cannot take (not damaged: kept)."""


class HostLayer:
    """One layer of host pages as bytes: where each (page, head)'s keys and values lie in its memory."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        nb, self.heads, self.block_size, D = (int(x) for x in k.shape)
        es = k.element_size()
        self.row = D * es  # one token's K (or V) of one head, in bytes
        ends = [t.data_ptr() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) * es for t in (k, v)]
        base = min(k.data_ptr(), v.data_ptr())
        self.bytes = memoryview((ctypes.c_ubyte * (max(ends) + es - base)).from_address(base)).cast("B")
        self.k0, self.v0 = k.data_ptr() - base, v.data_ptr() - base
        self.k_strides = [s * es for s in k.stride()[:2]]
        self.v_strides = [s * es for s in v.stride()[:3]]
        self.keys = as_words(k)  # [num_blocks, H, block_size, D], for the transposing copies

    def page(self, half: int, block: int, head: int, a: int, b: int) -> tuple[int, int]:
        """(offset, length) of tokens [a, b) of a page's keys (`half` 0: the whole page, column-major) or
        values (1: row-major)."""
        if half == 0:
            return self.k0 + block * self.k_strides[0] + head * self.k_strides[1], self.block_size * self.row
        sb, sh, st = self.v_strides
        return self.v0 + block * sb + head * sh + a * st, (b - a) * self.row


class _ChunkPlan:
    """Where one chunk's tokens go in a request's pages, the same for every layer: its sections' values
    (and keys, where the writer stored them in tiles of one page and the tokens placed are whole pages)
    as byte ranges of a layer's memory or of the aside buffer, in the order a section holds them (head by
    head, page by page); else its keys through staging (`place_keys`). `skip` tokens of the chunk before
    the first placed, `n` placed, the rest of its `stored` tokens after."""

    def __init__(
        self, skip: int, n: int, stored: int, pages: list[Page], host: HostLayer, tile: int = 0
    ) -> None:
        self.skip, self.n, self.stored, self.pages, self.tile = skip, n, stored, pages, tile
        bs = host.block_size
        whole = all(a == 0 and b == bs for _, a, b, _ in pages)
        self._aside = 0
        #: (where: 0 the layer's memory, 1 aside; offset; length)
        self.values = self._ranges(host, 1)
        self.keys = self._ranges(host, 0) if tile == bs and whole else None
        blocks = [block for block, _, _, _ in pages]
        consecutive = all(b == a + 1 for a, b in itertools.pairwise(blocks))
        self.run = blocks[0] if pages and whole and consecutive else None

    def _ranges(self, host: HostLayer, half: int) -> list[tuple[int, int, int]]:
        """The keys' (`half` 0) or the values' (1) ranges, head by head: the tokens before the first
        placed and after the last aside, the pages' between."""
        out: list[tuple[int, int, int]] = []
        for h in range(host.heads):
            for n in (self.skip, -1, self.stored - self.skip - self.n):
                if n < 0:
                    out += [(0, *host.page(half, block, h, a, b)) for block, a, b, _ in self.pages]
                elif n:
                    out.append((1, self._aside, n * host.row))
                    self._aside += n * host.row
        return out

    @property
    def aside_bytes(self) -> int:
        return self._aside

    def views(self, ranges: list[tuple[int, int, int]], host: HostLayer, aside: memoryview) -> list[memoryview]:
        return [(host.bytes, aside)[w][o : o + n] for w, o, n in ranges]

    def place_keys(self, dest: np.ndarray, keys: np.ndarray) -> None:
        """Copy staged keys (``[H, T, D]``; as stored, in tiles where the writer tiled them) into a
        layer's keys (`HostLayer.keys`), transposing."""
        if self.tile:  # another page size or a cut chunk: row-major first (a second copy, the rare case)
            H, T, D = keys.shape
            rows = np.empty_like(keys)
            np.copyto(rows.reshape(H, T // self.tile, self.tile, D), host_tiles(keys, self.tile))
            keys = rows
        keys = keys[:, self.skip : self.skip + self.n]
        if self.run is not None:  # [H, P * bs, D] -> [P, H, bs, D]: one copy per head
            P = len(self.pages)
            H, _, D = keys.shape
            src = keys.reshape(H, P, self.n // P, D)
            out = dest[self.run : self.run + P]
            for h in range(H):  # a 3-D copy per head, which numpy walks better than one 4-D copy
                np.copyto(out[:, h], src[h])
            return
        for h in range(keys.shape[0]):
            for block, a, b, at in self.pages:
                np.copyto(dest[block, h, a:b], keys[h, at : at + b - a])


class HostPages:
    """Tokens [first, k) of a request's chunks read straight into its host pages (`block_ids` of
    `paged`), as the module doc says. A `dest.Lands` destination: `LayerReader.read_layers_sync` asks it
    where each chunk's span of a read goes (`landing`) and tells it once the bytes are verified
    (`landed`)."""

    def __init__(self, paged: PagedCache, block_ids: Sequence[int], first: int, k: int) -> None:
        self.layers = [HostLayer(k_, v_) for k_, v_ in zip(paged.k, paged.v, strict=True)]
        self.block_ids = list(block_ids)
        self.first, self.k = first, k
        self._plans: dict[int, _ChunkPlan] = {}
        self._staging: list[tuple[np.ndarray, memoryview]] = []  # per layer of a read: keys, aside
        self._staged: list[tuple[_ChunkPlan, np.ndarray, HostLayer]] = []  # keys to turn, once verified

    @staticmethod
    def takes(paged: PagedCache) -> bool:
        """Whether `paged` keeps its pages as this reads them: on the host, each (page, head)'s values
        row-major and its keys column-major, not fp8."""
        k, v = paged.k[0], paged.v[0]
        D, bs = int(k.shape[3]), int(k.shape[2])
        return (
            k.device.type == "cpu"
            and paged.scales is None
            and v.stride(3) == 1
            and v.stride(2) == D
            and k.stride(2) == 1
            and k.stride(3) == bs
        )

    # -- the reader's calls --------------------------------------------------------------------------

    def rows(self, layers: range, start: int, n_tokens: int, kv: object) -> torch.Tensor:
        raise NotImplementedError("host pages are filled by the blocking face (`read_layers_sync`)")

    def place(self, reader: LayerReader, layers: range, j: int, data: object, kv: object) -> None:
        raise NotImplementedError("host pages are filled by the blocking face (`read_layers_sync`)")

    def placed(self, reader: LayerReader, layers: range, chunks: Sequence[int], kv: object) -> None:
        """Nothing more to do: the bytes are in the pages."""

    def landing(self, reader: LayerReader, layers: range, j: int) -> Landing:
        header = reader.headers[j]
        if header.compression != "none":
            raise CompressedChunkError(f"stored {header.compression}-compressed, read here uncompressed only")
        plan = self._plan(reader, j)
        self._staged = []
        buffers: list[memoryview] = []
        sections: list[list[memoryview]] = []
        for i, layer in enumerate(layers):
            host = self.layers[layer]
            keys, aside = self._stage(reader, i, plan)
            if plan.keys is None:  # through staging, then transposed into the pages
                self._staged.append((plan, keys, host))
                mine = [keys.data.cast("B"), *plan.views(plan.values, host, aside)]
            else:  # keys and values straight into the pages: one copy
                mine = plan.views(plan.keys, host, aside) + plan.views(plan.values, host, aside)
            sections.append(mine)
            buffers.extend(mine)
        return Landing(buffers, sections)

    def landed(self, reader: LayerReader, layers: range, j: int) -> None:
        for plan, keys, host in self._staged:
            plan.place_keys(host.keys, keys)
        self._staged = []

    def ready(self, load: object, i: int, layer: int, upto: int) -> None:
        """Nothing to do: the reads wrote the pages."""

    def waited(self, layer: int) -> None:
        """Nothing to do: the reads ran on this thread."""

    # -- internals -----------------------------------------------------------------------------------

    def _plan(self, reader: LayerReader, j: int) -> _ChunkPlan:
        plan = self._plans.get(j)
        if plan is None:
            c, host, header = reader.chunks[j], self.layers[0], reader.headers[j]
            a, b = max(c.start, self.first), min(c.end, self.k)  # placed; the rest is read to be verified
            pages = list(pages_of(self.block_ids, a, b, host.block_size))
            plan = _ChunkPlan(a - c.start, b - a, header.n_tokens, pages, host, key_tile(header))
            self._plans[j] = plan
        return plan

    def _stage(self, reader: LayerReader, i: int, plan: _ChunkPlan) -> tuple[np.ndarray, memoryview]:
        """Staging for the keys of the i-th layer of a read (``[H, T, D]``) and room for the tokens read
        aside, made once per load for the longest chunk."""
        host = self.layers[0]
        H, D = host.heads, host.row // host.keys.itemsize
        if i == len(self._staging):
            most = max(h.n_tokens for h in reader.headers.values())
            keys = np.empty(H * most * D, dtype=host.keys.dtype)
            self._staging.append((keys, memoryview(bytearray(2 * H * most * host.row))))
        keys, aside = self._staging[i]
        return keys[: H * plan.stored * D].reshape(H, plan.stored, D), aside
