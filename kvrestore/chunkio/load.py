"""Moving one stored chunk into a KV cache: bulk read, verify every byte, place; no Python per row.

The path a load lane runs for a chunk, and why each step is shaped so:

1. **Read** with one bulk operation that releases the GIL: a store that already holds the object in
   this process (`ChunkStore.reads_in_memory`) hands out its bytes; any other reads into a pooled
   staging buffer (`ChunkStore.read_into`: one `preadv` for a local directory, the fetched object
   copied once for a remote store).
2. **Check** the header (a few hundred bytes: model, key, position, sizes, zero padding).
3. **Verify and place**, in one worker-thread call:
   * into a CPU cache: xxh3 of every section (python-xxhash releases the GIL), then one numpy copy of
     the body into the cache's token range. Nothing unverified reaches the cache.
   * into a CUDA cache: the body (in pinned staging, or in a pinned `MemoryStore`'s own memory; other
     bytes from memory are first copied into pinned staging with one numpy copy) goes to the device on the load stream with one copy, then the device checksum of every
     layer runs there (`checksums.device_checksums`, two kernels) and only L sums come back. The
     staging buffers belong to the load's `Transfer` (`chunkio.transfer`), which recycles each once
     the upload's event has completed, also when the load fails part-way. A mismatch raises before the
     chunk counts as loaded; its rows are then recomputed, so damaged bytes never survive in the cache.

A store that reads without the event loop (`ChunkStore.reads_sync`: memory of this process, a local
directory) gets the whole load as one blocking call, `ChunkLoader.load_sync`, which the engine runs on
its load-lane threads (`kvrestore.runtime.lanes`): the event loop's share of a chunk is then a queue put and
one wake-up. Other stores are read with their async methods, then checked and placed in one thread hop.

The host copies are numpy's, on one thread each: torch's CPU `copy_` spreads a large copy over every
core and starves a thread that launches kernels, although it releases the GIL (`../shared/GPU.md`).
A compressed (zstd) chunk is decompressed on the host (`codec.decode_chunk`), then placed the same way.

A quantized chunk (`codec.quant`: the loader's `encoding`, which is the only one it reads) is verified
as stored and decoded where it lands: into a CPU cache after the host check, into a CUDA cache after
the upload of its small bytes and their device check, on the load stream. Compressed and quantized, it
is decompressed and decoded on the host.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch

from kvrestore import codec
from kvrestore.chunkio.pool import Staging, StagingPool
from kvrestore.chunkio.transfer import Transfer, TransferLane
from kvrestore.codec.checksums import device_checkable, device_checksums
from kvrestore.codec.quant import Encoding
from kvrestore.core.errors import CorruptChunkError, InvalidInputError, MissingChunkError, TruncatedChunkError
from kvrestore.core.kv import buffer_problem
from kvrestore.core.spec import ModelSpec
from kvrestore.stores.base import ChunkStore

#: room for the header and its padding in a staging buffer sized from the chunk's KV bytes
HEADER_ROOM = 64 * 1024
#: the first read of a chunk that goes straight into a cache: its header (a few KiB for 100+ layers)
PROBE_BYTES = 16 * 1024


def zstd_bound(nbytes: int) -> int:
    """zstd's worst-case compressed size of `nbytes` (its ZSTD_COMPRESSBOUND): what a section of a
    compressed chunk can take at most."""
    small = (128 * 1024 - nbytes) >> 11 if nbytes < 128 * 1024 else 0
    return nbytes + (nbytes >> 8) + small


StreamFor = Callable[[torch.device], "torch.cuda.Stream | None"]


def row_blocks(dest: torch.Tensor) -> list[list[memoryview]] | None:
    """Writable byte views of a CPU cache range [L, 2, H, T, D], per layer its 2*H runs of T rows in the
    order a stored section holds them; None unless each run is contiguous (rows back to back)."""
    t = dest.view(torch.uint8)
    n_layers, kv, heads, n_tokens, row = t.shape
    s_layer, s_kv, s_head, s_token, s_byte = t.stride()
    if s_byte != 1 or s_token != row or t.numel() == 0:
        return None
    run = n_tokens * row
    span = (n_layers - 1) * s_layer + (kv - 1) * s_kv + (heads - 1) * s_head + run
    whole = memoryview((ctypes.c_ubyte * span).from_address(t.data_ptr())).cast("B")
    firsts = [k * s_kv + h * s_head for k in range(kv) for h in range(heads)]
    return [
        [whole[base + f : base + f + run] for f in firsts] for base in range(0, n_layers * s_layer, s_layer)
    ]


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A numpy uint8 view of a CPU tensor whose last dimension is contiguous (any dtype, bf16 too)."""
    return t.view(torch.uint8).numpy()


class ChunkLoader:
    """Loads verified chunks of one model from one store into KV caches (CPU or CUDA).

    `stream_for(device)` gives the CUDA stream uploads go on (the engine's load lane), None off CUDA.
    `encoding` (`codec.quant.ENCODINGS`) is the one encoding of the chunks it reads: a chunk in another
    is foreign (a miss). One loader serves every load lane of a restorer; its staging pools are shared
    by them.
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        stream_for: StreamFor | None = None,
        encoding: str = "native",
    ) -> None:
        self.spec = spec
        self.store = store
        self.encoding = codec.spec_encoding(spec, encoding)
        self.stream_for = stream_for or (lambda device: None)
        self._pools = {False: StagingPool(pinned=False), True: StagingPool(pinned=True)}

    def pool(self, pinned: bool) -> StagingPool:
        """The staging buffers for CPU destinations (pageable) or uploads to a GPU (pinned)."""
        return self._pools[pinned]

    def lane(self, device: torch.device) -> TransferLane:
        """Where transfers to `device` run: the staging pool for it and the load lane's stream there."""
        return TransferLane(self.pool(pinned=device.type == "cuda"), self.stream_for(device))

    def transfer(self, dest: torch.Tensor) -> Transfer:
        """A transfer of one chunk into `dest` (`Transfer`): its buffers from the pool for `dest`'s
        device, its copies on the load lane's stream there."""
        return Transfer(
            self.pool(pinned=dest.device.type == "cuda"), self.stream_for(dest.device), dest.device
        )

    def close(self) -> None:
        """Give the staging buffers back to the system (the loader stays usable: a later load takes
        new ones)."""
        for pool in self._pools.values():
            pool.close()

    @property
    def reads_sync(self) -> bool:
        """Whether `load_sync` works: the store reads without the event loop (`ChunkStore.reads_sync`)."""
        return self.store.reads_sync

    async def load(self, key: str, start: int, dest: torch.Tensor) -> int:
        """Read chunk `key` (saved at token `start`) into `dest` ([L, 2, H, T, D], a cache's token range);
        returns the stored bytes read. Raises MissingChunkError, a ChunkDecodeError (damaged, truncated,
        foreign) or a store error; `dest` may then hold part of the chunk, which must be recomputed. A
        `dest` the chunk cannot be placed in as it lies raises InvalidInputError before anything is read:
        the caller's fault, never the chunk's."""
        self.check_dest(dest)
        if self.store.reads_sync:  # the whole load in one thread hop
            return await anyio.to_thread.run_sync(self.load_sync, key, start, dest, abandon_on_cancel=False)
        if self.store.reads_in_memory:
            data = await self.store.get(key)
            return await anyio.to_thread.run_sync(self._place_object, key, start, dest, data)
        limit = self.object_limit(dest)
        with self.transfer(dest) as transfer:
            staging = transfer.stage(limit)
            size = self._within_limit(key, await self.store.read_into(key, staging.view[:limit]), limit)
            return await anyio.to_thread.run_sync(
                self._place_staged, key, start, dest, transfer, staging, size
            )

    def load_sync(self, key: str, start: int, dest: torch.Tensor) -> int:
        """`load`, blocking, from any thread (a load lane's), for a store that `reads_sync`: read, check,
        verify and place without the event loop."""
        self.check_dest(dest)
        if self.store.reads_in_memory:
            return self._place_object(key, start, dest, self.store.get_sync(key))
        if dest.device.type != "cuda" and self.encoding.native:
            rows = row_blocks(dest)
            if rows is not None:
                placed = self._scatter_sync(key, start, dest, rows)
                if placed is not None:
                    return placed
        limit = self.object_limit(dest)
        with self.transfer(dest) as transfer:
            staging = transfer.stage(limit)
            size = self._within_limit(key, self.store.read_into_sync(key, staging.view[:limit]), limit)
            return self._place_staged(key, start, dest, transfer, staging, size)

    def check_dest(self, dest: torch.Tensor) -> None:
        """InvalidInputError unless `dest` is a chunk's rows of this model that a load can write in place
        (`core.kv.buffer_problem`)."""
        problem = buffer_problem(self.spec, dest)
        if problem is not None:
            raise InvalidInputError(f"a chunk cannot be loaded into this KV buffer: {problem}")

    def _scatter_sync(
        self, key: str, start: int, dest: torch.Tensor, rows: list[list[memoryview]]
    ) -> int | None:
        """Read an uncompressed chunk straight into a CPU cache's rows (`ChunkStore.scatter_into_sync`: one
        `preadv` of the sections into them for a local file), then verify them there: one pass over the
        bytes fewer than reading into staging and copying. The header comes first, from a small read.
        Returns the object's size, or None where this does not apply (compressed, an outsized header):
        then the chunk is read into staging instead."""
        with Transfer(self.pool(pinned=False)) as transfer:  # the probe is read on the host only
            probe = transfer.stage(PROBE_BYTES + 1)
            got = self.store.scatter_into_sync(key, 0, [probe.view[:PROBE_BYTES]])
            if got is None:
                raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
            head = probe.view[:got]
            if codec.header_length(head) > got:
                return None
            header, header_end = codec.read_header(head)
            codec.check_header(header, self.spec, key, start, int(dest.shape[3]), self.encoding.name)
            if header.compression != "none" or not header.layers or header.layers[0].offset > got:
                return None
            body = header.layers[0].offset
            if any(head[header_end:body]):
                raise CorruptChunkError("nonzero padding between header and sections")
            past_end = probe.view[PROBE_BYTES : PROBE_BYTES + 1]  # filled only if the object is too long
            placed = self.store.scatter_into_sync(
                key, body, [b for layer in rows for b in layer] + [past_end]
            )
        if placed is None:
            raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
        want = header.end - body
        if placed < want:
            raise TruncatedChunkError(f"object is {body + placed} bytes, header says {header.end}")
        if placed > want:
            raise CorruptChunkError(f"object has bytes past the last section (at byte {header.end})")
        codec.verify_scattered(header, rows)
        return header.end

    @staticmethod
    def object_limit(dest: torch.Tensor) -> int:
        """The most bytes a stored chunk for `dest` ([L, 2, H, T, D]) can take: its header room, then
        each layer's section at zstd's worst case (`zstd_bound`). A larger object under the chunk's key
        is not this chunk: it is a miss, and is never read past this size nor staged whole."""
        layers = int(dest.shape[0]) if dest.dim() == 5 else 1
        per_layer = dest.numel() * dest.element_size() // max(layers, 1)
        return HEADER_ROOM + layers * zstd_bound(per_layer)

    @staticmethod
    def _within_limit(key: str, size: int | None, limit: int) -> int | None:
        """`size` as `read_into` returned it, or CorruptChunkError for an object past `limit` bytes."""
        if size is not None and size > limit:
            raise CorruptChunkError(
                f"chunk {key[:12]}: the object has more than {limit} bytes, more than this chunk can take"
            )
        return size

    # -- worker thread -----------------------------------------------------------------------------

    def _place_object(self, key: str, start: int, dest: torch.Tensor, data: Any) -> int:
        """Check, verify and place an object the store handed out (None: it was absent)."""
        if data is None:
            raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
        view = memoryview(data)
        header = codec.check_object(view, self.spec, key, start, int(dest.shape[3]), self.encoding.name)
        with self.transfer(dest) as transfer:
            self._verify_place(header, view, None, dest, transfer)
        return len(view)

    def _place_staged(
        self, key: str, start: int, dest: torch.Tensor, transfer: Transfer, staging: Staging, size: int | None
    ) -> int:
        """Check, verify and place an object read into `staging`, which `transfer` holds (`size` as
        `read_into` returned it)."""
        if size is None:
            raise MissingChunkError(f"chunk {key[:12]} disappeared from the store")
        data = staging.view[: min(size, staging.nbytes)]
        header = codec.check_object(data, self.spec, key, start, int(dest.shape[3]), self.encoding.name)
        self._verify_place(header, data, staging, dest, transfer)
        return len(data)

    def _verify_place(
        self,
        header: codec.ChunkHeader,
        data: memoryview,
        staging: Staging | None,
        dest: torch.Tensor,
        transfer: Transfer,
    ) -> None:
        """Verify and place a checked object (`data`, lying in `staging` where it was read into one) in
        `dest`; `transfer` holds the staging buffers and runs the upload to a CUDA cache."""
        if header.compression != "none":
            self._place_decoded(header, data, dest, transfer)
        elif dest.device.type != "cuda":
            codec.verify_sections(header, data)
            if self.encoding.native:
                rows = _byte_rows(dest)
                np.copyto(rows, np.frombuffer(codec.body(header, data), np.uint8).reshape(rows.shape))
            else:
                self.encoding.decode(codec.body_sections(header, data), dest)
        else:
            if not self._device_checkable(dest):
                codec.verify_sections(header, data)
            # read into pinned staging, else a pinned store's object as it is or one GIL-free copy
            host = staging.tensor if staging is not None else transfer.pinned(data)
            self._upload_verify(header, host, dest, transfer)

    def _device_checkable(self, dest: torch.Tensor) -> bool:
        """Whether sections are checked on the device: encoded ones always (whole words), native ones
        where a row is whole words."""
        return not self.encoding.native or device_checkable(self.spec.head_dim * dest.element_size())

    def _upload_verify(
        self, header: codec.ChunkHeader, host: torch.Tensor, dest: torch.Tensor, transfer: Transfer
    ) -> None:
        """Copy the body (in pinned `host`: staged by `transfer`, or a pinned store's object) to the
        device on the load stream, then compare every layer's device checksum (and decode an encoded
        body into `dest` there)."""
        expected = [section.device_sum for section in header.layers] if self._device_checkable(dest) else None
        upload_checked(host[header.layers[0].offset : header.end], dest, expected, transfer, self.encoding)

    def _place_decoded(
        self, header: codec.ChunkHeader, data: memoryview, dest: torch.Tensor, transfer: Transfer
    ) -> None:
        """A compressed chunk: verified and decompressed on the host, into `dest` or into a buffer
        `transfer` stages, then uploaded."""
        n_tokens = int(dest.shape[3])
        if dest.device.type != "cuda":
            codec.decode_chunk(
                data, self.spec, header.key, header.start, n_tokens, out=dest, encoding=self.encoding.name
            )
            return
        staging = transfer.stage(dest.numel() * dest.element_size())
        host = staging.tensor[: dest.numel() * dest.element_size()].view(dest.dtype).view(dest.shape)
        codec.decode_chunk(
            data, self.spec, header.key, header.start, n_tokens, out=host, encoding=self.encoding.name
        )
        with transfer.running():
            dest.copy_(host, non_blocking=True)
        transfer.wait()


def upload_checked(
    host: torch.Tensor,
    dest: torch.Tensor,
    expected: Sequence[int] | None,
    transfer: Transfer,
    encoding: Encoding | None = None,
) -> None:
    """Copy `host` (pinned bytes laid out as `dest`, e.g. a chunk's body or one layer's section) to the
    CUDA tensor `dest` ([n, ...]: n layers) on `transfer`'s stream, hand the buffers `transfer` staged
    back to be reused once the copy has finished, then compare each of the n layers' device checksum
    with `expected` (None: the bytes were verified on the host). With a quantized `encoding`, `host`
    holds the n encoded sections: they go up to a device buffer, are checked there and decoded into
    `dest`, on the stream. Blocks until the stream has done all of it (the GIL is released meanwhile);
    raises CorruptChunkError on a mismatch, naming the layer."""
    with transfer.running():
        if encoding is None or encoding.native:
            stored = dest
            dest.copy_(host.view(dest.dtype).view(dest.shape), non_blocking=True)
        else:  # allocated on this stream: reused only after what is queued on it
            stored = torch.empty(
                (dest.shape[0], host.numel() // dest.shape[0]), dtype=torch.uint8, device=dest.device
            )
            stored.copy_(host.view(stored.shape), non_blocking=True)
        transfer.copied()
        sums = device_checksums(stored).to("cpu", non_blocking=True) if expected is not None else None
        if stored is not dest:
            assert encoding is not None
            encoding.decode(stored, dest)
    transfer.wait()
    if sums is not None and expected is not None:
        for i, (got, want) in enumerate(zip(sums.tolist(), expected, strict=True)):
            if got != want:
                raise CorruptChunkError(f"layer {i}: device checksum mismatch")
