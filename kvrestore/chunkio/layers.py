"""Layer-wise reads of stored chunks: layer l of many chunks, one range read per chunk.

The chunk wire format (`codec`) keeps each layer's K and V in one section, so a restore along layers
(CacheFlow's layer-wise two-pointer, CacheBlend's pipelined loading) reads layer l of chunk 0, 1, ... with
one `get_range` each, concurrently, and places every section at its chunk's token range of the cache.
Each section carries its own checksum, so a layer is verified on its own, without the rest of the object.
Consecutive layers lie back to back, so `read_layers` reads a few of them with one `get_range` per
chunk; the fusor does so on CUDA (`read_plan`), where the loader's host calls per layer compete with a
compute lane bound by its kernel launches. How a read goes up to a device: `chunkio.uploads`.

`open` fetches and checks every chunk's header first (one concurrent round of small reads) and says
which chunks can be read; `read_layer` raises `ChunkLoadFailed` naming the chunks whose section could
not be used. Either way the fault is noted in `errors`, a damaged object is deleted so it is never
served again (`stored.forget`), and nothing unverified reaches the cache -- except with deferred checks
(`chunkio.deferred`), for a caller that keeps the cache to itself until `verify` has passed.

A destination that takes some heads of each chunk (`dest.heads`: a tensor-parallel rank reading a chunk
of more heads) gets, of a chunk with per-head checks (format 6, `codec.heads`), only those heads' bytes:
two range reads a layer, each head verified by the destination before use; of any other chunk the
sections whole, as ever. This is the host path only: the device path verifies whole sections.

A destination that lands bytes where they are used (`dest.Lands`: an engine's host pages) is read by
the blocking face, `open_sync` and `read_layers_sync`, on the caller's thread, from a store that reads
without the event loop: one scatter read per chunk and read, each section verified where it landed.
There a damaged chunk's key goes to `damaged`, for the caller to forget on its event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.chunkio.deferred import DeferredChecks
from kvrestore.chunkio.dest import CacheRows, Destination, Lands
from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.stored import ChunkLoadFailed, each, forget, get_all, layers_name, read_plan
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.chunkio.uploads import LayerUploads
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import (
    LOAD_FAULTS,
    ChunkDecodeError,
    CorruptChunkError,
    InvalidInputError,
    MissingChunkError,
    TruncatedChunkError,
    proves_damage,
)
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.core.streams import on_stream
from kvrestore.stores.base import ChunkStore


class LayerReader:
    """Reads one layer of many stored chunks at a time into a KVCache, or wherever its destination
    (`dest`, `chunkio.dest`: a cache's rows by default) puts the verified sections.
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[ChunkRef],
        lane: TransferLane | None = None,
        defer_checks: bool | None = False,
        ahead: int = 8,
        layers_per_read: int = 4,
        encoding: str = "native",
        device_path: bool = False,
        seal: Seal | None = None,
        dest: Destination | None = None,
    ) -> None:
        self.spec = spec
        self.dest: Destination = dest or CacheRows()  # where the verified sections go
        #: the heads [a, b) of each chunk the destination takes, where it takes some only (`dest`)
        self.heads: tuple[int, int] | None = getattr(self.dest, "heads", None)
        self.seal = seal  # where set, every header's MAC is checked before its sections are read
        self.encoding = codec.spec_encoding(spec, encoding)  # the one it reads: another is foreign
        self.store = store
        self.chunks = list(chunks)
        # where a CUDA cache's sections are uploaded: the staging pool and the stream (None: the current one)
        self.lane = lane or TransferLane(StagingPool(pinned=torch.cuda.is_available()))
        self.headers: dict[int, codec.ChunkHeader] = {}  # of every chunk whose header checked out
        self.dropped: set[int] = set()  # chunks not read any more (a fault, or the caller's `drop`)
        self.opened = False
        self.errors: list[str] = []
        self.why: dict[int, str] = {}  # every chunk not read any more: why (noted in `errors` or not)
        self.damaged: list[str] = []  # keys the blocking face found damaged: to forget
        #: the verified per-head checks of each chunk read by head (`by_head`)
        self.head_checks: dict[int, codec.HeadChecks] = {}
        self.bytes_read = 0
        # Deferred checks (`chunkio.deferred`): None means on a CUDA cache only; True runs the device
        # path on a CPU cache too (tests of the same code, without streams). At most `ahead` layers
        # are queued on the device at once, read `layers_per_read` at a time (`read_plan`).
        self.defer_checks = defer_checks
        # the device path (`chunkio.uploads`) is taken on a CUDA cache or with deferred checks; True
        # takes it on a CPU cache too, checked per read (tests of the same code, without streams)
        self.device_path = device_path
        self.ahead = ahead
        self.layers_per_read = max(1, layers_per_read)
        self.checks: DeferredChecks | None = None

    async def open(self) -> list[bool]:
        """Fetch and check every chunk's header, concurrently; which chunks can be read."""
        await each(self._open_one, range(len(self.chunks)))
        self.opened = True
        return [self.readable(j) for j in range(len(self.chunks))]

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream a CUDA cache's sections are uploaded on (None: the device's current one)."""
        return self.lane.stream

    def readable(self, j: int) -> bool:
        return j in self.headers and j not in self.dropped

    @property
    def unusable(self) -> list[int]:
        """Chunks that cannot be read (after `open`): missing, damaged, or dropped."""
        return [j for j in range(len(self.chunks)) if not self.readable(j)]

    def drop(self, j: int) -> None:
        """Stop reading chunk j (its tokens are computed instead)."""
        self.dropped.add(j)

    async def read_layer(self, layer: int, kv: KVCache) -> int:
        """Place layer `layer` of every open chunk into `kv`; returns the bytes read.

        The sections are fetched concurrently (on the device path a store that `reads_sync` is read in
        the worker thread instead), then verified and placed in one worker-thread call: one thread hop
        per layer, not one per chunk. Raises `ChunkLoadFailed` naming the chunks whose section was
        missing or damaged (the others are placed). With deferred checks the layer is only queued on
        the device when this returns (`wait_placed`) and damage shows in `verify`."""
        return await self.read_layers(range(layer, layer + 1), kv)

    async def read_layers(self, layers: range, kv: KVCache) -> int:
        """`read_layer` for consecutive `layers` at once: one range read per chunk covers all of them
        (their sections lie back to back), and on the device path one upload per chunk, one checksum
        call, one placement per chunk and one `dest.placed` serve them all. A chunk with any section
        missing or damaged is named in `ChunkLoadFailed`; its rows of `layers` are then not to be used
        (they may hold part of what was read)."""
        device_path = kv.data.device.type == "cuda" or bool(self.defer_checks) or self.device_path
        if device_path and self.heads is not None:
            raise InvalidInputError("a destination of some heads is read on the host path only")
        js = [j for j in self.headers if j not in self.dropped]
        sections: dict[int, bytes | memoryview | None] = dict.fromkeys(js)
        failed: list[int] = []
        where = f" {layers_name(layers)}"
        if not (device_path and self.store.reads_sync):  # else each is read in the worker thread

            async def fetch(j: int) -> None:
                try:
                    sections[j] = await self._fetch(j, layers)
                except LOAD_FAULTS as exc:
                    await self._fault(j, exc, where)
                    failed.append(j)
                    del sections[j]

            await each(fetch, js)
        work = self._upload_layers if device_path else self._place_all
        bad = await anyio.to_thread.run_sync(work, layers, sections, kv, abandon_on_cancel=False)
        for j, exc in bad:
            await self._fault(j, exc, where)
            failed.append(j)
        total = sum(self._span_bytes(j, layers) for j in sections if j not in failed)
        self.bytes_read += total
        if failed:
            raise ChunkLoadFailed(sorted(failed), self.errors[-1])
        return total

    def read_plan(self, first: int, stop: int, kv: KVCache) -> list[range]:
        """The `read_layers` calls that cover layers [first, stop) into `kv`: the first layer alone (what
        a restore waits for first, and what the loading controller times), then `layers_per_read` at a
        time where the checks are deferred (fewer host calls, thread hops and kernels per layer: the
        loader shares the host with a compute lane that is bound by its launches), else one by one."""
        return read_plan(first, stop, self.layers_per_read if self.defers(kv) else 1)

    def place(self, layers: range, j: int, data: bytes | memoryview, kv: KVCache) -> None:
        """Verify chunk j's sections of `layers` (`data`: their byte span, `codec.layer_span`) and place
        them through `dest` (on a CPU cache: its token range; blocking)."""
        self.dest.place(self, layers, j, data, kv)

    def _upload_layers(
        self, layers: range, sections: dict[int, bytes | memoryview | None], kv: KVCache
    ) -> list[tuple[int, BaseException]]:
        """A read of `layers` to a CUDA cache (`LayerUploads.upload`); returns the unusable chunks."""
        # the device path of a read, made per read: kept on the reader it would be a reference cycle
        return LayerUploads(self).upload(layers, sections, kv)

    def rows_of(self, layers: range, j: int, kv: KVCache) -> torch.Tensor:
        """Where chunk j's rows of `layers` go in `kv` (`dest`): ``[len(layers), 2, H, n_tokens, D]``."""
        chunk = self.chunks[j]
        return self.dest.rows(layers, chunk.offset, chunk.n_tokens, kv)

    def defers(self, kv: KVCache) -> bool:
        """Whether reads into `kv` defer their checks (`defer_checks`: None means on a CUDA cache)."""
        return bool(self.defer_checks or (self.defer_checks is None and kv.data.device.type == "cuda"))

    def _deferred(self, kv: KVCache) -> DeferredChecks | None:
        """This reader's deferred checks for `kv` (made on first use), or None if it checks each layer."""
        cuda = kv.data.device.type == "cuda"
        if not self.defers(kv):
            return None
        if self.checks is None or self.checks.device != kv.data.device:
            with on_stream(self.stream, kv.data.device):
                self.checks = DeferredChecks(
                    self.headers, len(self.chunks), self.spec.num_layers, kv.data.device
                )
        if cuda and self.stream is not None:  # written on the load stream: not reused before that is done
            kv.data.record_stream(self.stream)
        return self.checks

    def wait_placed(self, layer: int) -> None:
        """Make the current stream wait (on the device) for `layer`, read with deferred checks."""
        if self.checks is not None:
            self.checks.wait(layer)

    def placed_seconds(self, layer: int) -> float | None:
        """The device time of placing `layer` (waiting for it), if it was read with deferred checks."""
        return None if self.checks is None else self.checks.seconds(layer)

    async def verify(self) -> None:
        """Wait for every layer read with deferred checks and read their flags: a chunk with a damaged
        section is faulted (noted, deleted from the store) and `ChunkLoadFailed` names those chunks."""
        checks = self.checks
        if checks is None:
            return
        found = await anyio.to_thread.run_sync(checks.failures, self.stream, abandon_on_cancel=False)
        failed = [j for j in sorted(found) if j not in self.dropped]
        for j in failed:
            error = CorruptChunkError(f"layer {found[j]}: device checksum mismatch")
            await self._fault(j, error, f" layer {found[j]}")
        if failed:
            raise ChunkLoadFailed(failed, self.errors[-1])

    # -- internals -------------------------------------------------------------------------------

    async def _open_one(self, j: int) -> None:
        chunk = self.chunks[j]
        try:
            head = await self._get(chunk.key, 0, codec.HEADER_PROBE)
            if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
                head = await self._get(chunk.key, 0, codec.header_length(head))
            header = codec.probe_header(
                head, self.spec, chunk.key, chunk.start, chunk.n_tokens, self.encoding.name, self.seal
            )
            table = await self._open_heads(j, header, head)
        except LOAD_FAULTS as exc:
            # a chunk gone before the restore reads it is a plain miss; anything else is worth reporting
            await self._fault(j, exc, note=not isinstance(exc, MissingChunkError))
            return
        self.bytes_read += len(head) + table
        self.headers[j] = header

    def _place_all(
        self, layers: range, sections: dict[int, bytes | memoryview | None], kv: KVCache
    ) -> list[tuple[int, BaseException]]:
        """`read_layers` into a CPU cache: verify and place the fetched spans (blocking)."""
        bad: list[tuple[int, BaseException]] = []
        placed = []
        for j, data in sections.items():
            assert data is not None  # fetched: only the device path reads in the worker thread
            try:
                self.place(layers, j, data, kv)
                placed.append(j)
            except ChunkDecodeError as exc:
                bad.append((j, exc))
        self.dest.placed(self, layers, placed, kv)
        return bad

    def by_head(self, j: int) -> bool:
        """Whether chunk j is read by head: the destination takes some of its heads (`dest.heads`) and
        the chunk has per-head checks (`codec.heads`, read and verified at `open`); its span of a read
        is then those heads' keys and values of each layer (`codec.head_sections`), else its sections
        whole."""
        return j in self.head_checks

    async def _open_heads(self, j: int, header: codec.ChunkHeader, head: bytes) -> int:
        """Where chunk j is to be read by head (`by_head`), read and verify its head table (from the
        header probe where it holds it); the bytes read for it."""
        if self.heads in (None, (0, header.num_kv_heads)) or not codec.head_checked(header):
            return 0
        lo, hi = codec.head_table_span(header)
        table = head[lo:hi] if hi <= len(head) else await self._get(self.chunks[j].key, lo, hi)
        self.head_checks[j] = codec.read_head_checks(header, table, self.seal)
        return 0 if hi <= len(head) else len(table)

    async def _fetch(self, j: int, layers: range) -> bytes:
        """Chunk j's span of `layers`: its sections (one range read), or read by head, two ranges a layer
        (`by_head`, in one `get_ranges`)."""
        header, key = self.headers[j], self.chunks[j].key
        if not self.by_head(j):
            return await self._get(key, *codec.layer_span(header, layers))
        assert self.heads is not None
        parts = await get_all(self.store, key, codec.head_ranges(header, layers, self.heads))
        return codec.join_heads(header, layers, self.heads, parts)

    def _span_bytes(self, j: int, layers: range) -> int:
        """The bytes `_fetch` reads of chunk j for `layers`."""
        header = self.headers[j]
        if self.by_head(j):
            assert self.heads is not None
            return sum(b - a for a, b in codec.head_ranges(header, layers, self.heads))
        a, b = codec.layer_span(header, layers)
        return b - a

    async def _get(self, key: str, start: int, end: int) -> bytes:
        data = await self.store.get_range(key, start, end)
        if data is None:
            raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
        return data

    async def _fault(self, j: int, exc: BaseException, where: str = "", note: bool = True) -> None:
        """Stop reading chunk j, note its fault, and delete an object its bytes proved damaged
        (`proves_damage`; best effort: the miss is what matters)."""
        if self._noted(j, exc, where, note):
            await forget(self.store, self.chunks[j].key)

    def _noted(self, j: int, exc: BaseException, where: str, note: bool = True) -> bool:
        """Stop reading chunk j and note why; whether its bytes proved it damaged (`proves_damage`)."""
        self.drop(j)
        self.why[j] = f"chunk {j}{where}: {type(exc).__name__}: {exc}"
        if note:
            self.errors.append(self.why[j])
        return proves_damage(exc)

    # -- the blocking face: destinations that land bytes where they are used -----------------------

    def open_sync(self) -> list[bool]:
        """`open`, blocking, from a store that `reads_sync`: each chunk's header with a scatter read."""
        for j, chunk in enumerate(self.chunks):
            try:
                head = self._scatter_sync(chunk.key, 0, codec.HEADER_PROBE)
                if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
                    head = self._scatter_sync(chunk.key, 0, codec.header_length(head))
                header = codec.probe_header(
                    head, self.spec, chunk.key, chunk.start, chunk.n_tokens, self.encoding.name, self.seal
                )
            except LOAD_FAULTS as exc:
                if self._noted(j, exc, "", note=not isinstance(exc, MissingChunkError)):
                    self.damaged.append(chunk.key)
                continue
            self.bytes_read += len(head)
            self.headers[j] = header
        self.opened = True
        return [self.readable(j) for j in range(len(self.chunks))]

    def _scatter_sync(self, key: str, start: int, n: int) -> memoryview:
        buf = memoryview(bytearray(n))
        got = self.store.scatter_into_sync(key, start, [buf])
        if got is None:
            raise MissingChunkError(f"chunk {key[:12]} is not in the store")
        return buf[:got]

    def read_layers_sync(self, layers: range, kv: KVCache) -> int:
        """`read_layers` into a destination that lands the bytes (`dest.Lands`), blocking: per chunk one
        scatter read of its span into the buffers the destination gives (and one byte past it, to see an
        object longer than its header says), each section verified where it landed, then `landed`."""
        dest = self.dest
        assert isinstance(dest, Lands), "read_layers_sync reads into a destination that lands bytes"
        failed: list[int] = []
        total = 0
        for j in [j for j in self.headers if j not in self.dropped]:
            header, key = self.headers[j], self.chunks[j].key
            try:
                first, end = codec.layer_span(header, layers)
                if not codec.back_to_back(header, layers):
                    raise CorruptChunkError("sections are not back to back")
                landing = dest.landing(self, layers, j)
                past_end = memoryview(bytearray(1))  # filled only if the object is longer than its header says
                got = self.store.scatter_into_sync(key, first, [*landing.buffers, past_end])
                if got is None:
                    raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
                if got < end - first:
                    raise TruncatedChunkError(f"object is {first + got} bytes, its header says {end} or more")
                if layers[-1] == header.num_layers - 1 and got > end - first:
                    raise CorruptChunkError(f"object has bytes past the last section (at byte {end})")
                for layer, parts in zip(layers, landing.sections, strict=True):
                    codec.check_section(header, layer, parts, self.seal)
                dest.landed(self, layers, j)
            except LOAD_FAULTS as exc:
                if self._noted(j, exc, f" {layers_name(layers)}"):
                    self.damaged.append(key)
                failed.append(j)
                continue
            total += end - first
        self.bytes_read += total
        if failed:
            raise ChunkLoadFailed(failed, self.errors[-1])
        return total
