"""A store that shows chunks stored as parts (`chunkio.parts`) as whole chunks, to any reader.

`PartsView(store, spec)` answers `contains` for a chunk key when the whole chunk or every part of one
layout is stored (`find_layouts`), and `get` / `get_range` of such a key with the whole chunk: every
part read and verified (`read_slice`), then encoded again as one chunk under the chunk key (signed
with the reader's seal where it has one). A reader above it (a `Restorer`) then checks that object as
it checks any chunk: its key, position, model, and every section. Native encoding only: a quantized
chunk is not re-encoded exactly.

A part that is missing, damaged or forged makes the whole chunk a miss (`get` answers None): never half
a chunk. A part whose bytes proved damaged is deleted (`proves_damage`), as a whole chunk would be. The view keeps the last `KEEP` chunks it assembled (verified KV, which a key names for good), so the
range reads of one chunk assemble it once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvrestore import codec
from kvrestore.chunkio.parts import Layout, find_layouts, part_key, read_slice, reader_layouts, whole
from kvrestore.chunkio.stored import forget
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import ChunkDecodeError, InvalidInputError
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.wrapper import WrapperStore

KEEP = 4  # assembled chunks kept for the range reads that follow their first read


class PartsView(WrapperStore):
    """`inner` with chunks stored as parts of any of `layouts` (default `reader_layouts(spec)`) shown
    whole; writes go to `inner` unchanged."""

    def __init__(
        self,
        inner: ChunkStore,
        spec: ModelSpec,
        layouts: Sequence[Layout] | None = None,
        seal: Seal | None = None,
        encoding: str = "native",
    ) -> None:
        super().__init__(inner)
        if encoding != "native":
            raise InvalidInputError(f"a PartsView shows native chunks only, not {encoding!r} ones")
        self.spec, self.seal = spec, seal
        self.layouts = reader_layouts(spec) if layouts is None else list(layouts)
        self._assembled: OrderedDict[str, bytes] = OrderedDict()

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [found is not None for found in await find_layouts(self.inner, self.spec, keys, self.layouts)]

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)  # a whole chunk is read as it is
        return data if data is not None else await self._assemble(key)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        data = await self.get(key)
        if data is None or len(data) > len(buffer):
            return None if data is None else len(data)
        buffer[: len(data)] = data
        return len(data)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        if key not in self._assembled:
            data = await self.inner.get_range(key, start, end)
            if data is not None:
                return data
        assembled = await self._assemble(key)
        return None if assembled is None else assembled[start:end]

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        return [await self.get_range(key, a, b) for a, b in ranges]

    async def _assemble(self, key: str) -> bytes | None:
        """The chunk `key` stored as the parts of a layout, encoded whole; None where none is stored."""
        if key in self._assembled:
            self._assembled.move_to_end(key)
            return self._assembled[key]
        split = [lo for lo in self.layouts if lo != (whole(self.spec),)]
        (layout,) = await find_layouts(self.inner, self.spec, [key], split)
        if layout is None:
            return None
        first = part_key(key, layout[0], self.spec)
        head = await self.inner.get_range(first, 0, codec.HEADER_PROBE)
        damaged: list[str] = []
        try:
            if head is None:
                return None
            if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
                head = await self.inner.get_range(first, 0, codec.header_length(head)) or b""
            header, _ = codec.read_header(head)  # its position is checked with every part's header
            spec = self.spec
            read = await read_slice(
                self.inner, spec, key, header.start, header.n_tokens, layout,
                (0, spec.num_kv_heads), (0, spec.num_layers), seal=self.seal, damaged=damaged,
            )  # fmt: skip
        except ChunkDecodeError:
            for pkey in damaged:  # only proven damage deletes: the next save writes the part again
                await forget(self.inner, pkey)
            return None  # a missing, damaged or forged part: the chunk is a miss
        data = codec.encode_chunk(KVChunk(header.start, read.kv), self.spec, key, seal=self.seal)
        self._assembled[key] = data
        while len(self._assembled) > KEEP:
            self._assembled.popitem(last=False)
        return data
