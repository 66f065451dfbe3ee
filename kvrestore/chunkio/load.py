"""Moving one stored chunk into a KV cache: bulk read, verify every byte, place; no Python per row.

The path a load lane runs for a chunk, and why each step is shaped so:

1. **Read** with one bulk operation that releases the GIL: a store that already holds the object in
   this process (`ChunkStore.reads_in_memory`) hands out its bytes; any other reads into a pooled
   staging buffer (`ChunkStore.read_into`: one `preadv` for a local directory, the fetched object
   copied once for a remote store).
2. **Check** the header (a few hundred bytes: model, key, position, sizes, zero padding).
3. **Verify and place**, in one worker-thread call:
   * into a CPU cache: xxh3 of every section (python-xxhash releases the GIL), or with a secret its
     GMAC tag (`codec.seal`, the GIL released too), then one numpy copy of the body into the cache's
     token range. Nothing unverified reaches the cache.
   * into a CUDA cache: the body (in pinned staging, or in a pinned `MemoryStore`'s own memory; other
     bytes from memory are first copied into pinned staging with one numpy copy) goes to the device on the load stream with one copy, then the device checksum of every
     layer runs there (`checksums.device_checksums`, two kernels) and only L sums come back. The
     staging buffers belong to the load's `Transfer` (`chunkio.transfer`), which recycles each once
     the upload's event has completed, also when the load fails part-way. A mismatch raises before the
     chunk counts as loaded; its rows are then recomputed, so damaged bytes never survive in the cache.
     With a secret each layer's tag is checked on the host before that layer is queued to go up (the
     next layer's check overlaps this one's copy), so no unauthenticated byte reaches the cache.

A store that reads without the event loop (`ChunkStore.reads_sync`: memory of this process, a local
directory) gets the whole load as blocking calls on the engine's load-lane threads
(`kvrestore.runtime.lanes`): the event loop's share of a chunk is then a queue put and one wake-up. The
read (`ChunkLoader.fetch_sync`) never writes into the cache, so a read that stalls (a network
filesystem) can be abandoned past its deadline or on a cancel, its late bytes dropped; only then are they
checked and placed (`Fetched.place`, bounded work). Other stores are read with their async methods, then
checked and placed in one thread hop.

The host copies are numpy's, on one thread each: torch's CPU `copy_` spreads a large copy over every
core and starves a thread that launches kernels, although it releases the GIL (`../shared/GPU.md`).
A compressed (zstd) chunk is decompressed on the host (`codec.decode_chunk`), then placed the same way.

A quantized chunk (`codec.quant`: the loader's `encoding`, which is the only one it reads) is verified
as stored and decoded where it lands: into a CPU cache after the host check, into a CUDA cache after
the upload of its small bytes and their device check, on the load stream. Compressed and quantized, it
is decompressed and decoded on the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.chunkio.pool import Staging, StagingPool
from kvrestore.chunkio.transfer import Transfer, TransferLane
from kvrestore.codec.checksums import device_checkable, device_checksums
from kvrestore.codec.quant import Encoding
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import (
    ChunkDecodeError,
    CorruptChunkError,
    InvalidInputError,
    MissingChunkError,
    proves_damage,
)
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


class ChunkLoader:
    """Loads verified chunks of one model from one store into KV caches (CPU or CUDA).

    `stream_for(device)` gives the CUDA stream uploads go on (the engine's load lane), None off CUDA.
    `encoding` (`codec.quant.ENCODINGS`) is the one encoding of the chunks it reads: a chunk in another
    is foreign (a miss). With a `seal` (`codec.seal`) it signs nothing but checks every header's MAC
    before it uses a byte of the chunk, and the writers of the restorer sign with the same one. One
    loader serves every load lane of a restorer; its staging pools are shared by them.
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        stream_for: StreamFor | None = None,
        encoding: str = "native",
        seal: Seal | None = None,
    ) -> None:
        self.spec = spec
        self.store = store
        self.seal = seal
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

    async def load(self, key: str, start: int, dest: torch.Tensor) -> int:
        """Read chunk `key` (saved at token `start`) into `dest` ([L, 2, H, T, D], a cache's token range);
        returns the stored bytes read. Raises MissingChunkError, a ChunkDecodeError (damaged, truncated,
        foreign) or a store error; `dest` may then hold part of the chunk, which must be recomputed. A
        `dest` the chunk cannot be placed in as it lies raises InvalidInputError before anything is read:
        the caller's fault, never the chunk's. Cancelled while a blocking store reads, the read is
        abandoned at once (`fetch_abandonable`): nothing it brings is ever written into `dest`."""
        self.check_dest(dest)
        if self.store.reads_sync:  # the read in one thread hop, then the placing in another
            fetched = await fetch_abandonable(self.fetch_sync, key, start, dest)
            return await anyio.to_thread.run_sync(fetched.place, abandon_on_cancel=False)
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

    def fetch_sync(self, key: str, start: int, dest: torch.Tensor) -> Fetched:
        """The store's part of `load`, blocking, from any thread (a load lane's), for a store that
        `reads_sync`: the chunk's object read into bytes of this load's own
        (a staging buffer, or the object a store in memory holds), nothing written into `dest`. A read
        that stalls (a network filesystem) may so be abandoned: `Fetched.place` checks, verifies and
        places the bytes (bounded work), `Fetched.discard` gives them back unused."""
        self.check_dest(dest)
        if self.store.reads_in_memory:
            return Fetched(self, key, start, dest, data=self.store.get_sync(key))
        limit = self.object_limit(dest)
        transfer = self.transfer(dest)
        try:
            staging = transfer.stage(limit)
            size = self._within_limit(key, self.store.read_into_sync(key, staging.view[:limit]), limit)
        except BaseException:
            transfer.close()
            raise
        return Fetched(self, key, start, dest, staged=(transfer, staging, size))

    def check_dest(self, dest: torch.Tensor) -> None:
        """InvalidInputError unless `dest` is a chunk's rows of this model that a load can write in place
        (`core.kv.buffer_problem`)."""
        problem = buffer_problem(self.spec, dest)
        if problem is not None:
            raise InvalidInputError(f"a chunk cannot be loaded into this KV buffer: {problem}")

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
        header = codec.check_object(
            view, self.spec, key, start, int(dest.shape[3]), self.encoding.name, self.seal
        )
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
        header = codec.check_object(
            data, self.spec, key, start, int(dest.shape[3]), self.encoding.name, self.seal
        )
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
            codec.verify_sections(header, data, self.seal)
            if self.encoding.native:  # keys a writer stored in tiles turned row-major on the way
                codec.copy_bytes(dest, codec.body(header, data), codec.key_tile(header))
            else:
                self.encoding.decode(codec.body_sections(header, data), dest)
        else:
            if not self._device_checkable(dest) and self.seal is None:
                codec.verify_sections(header, data)
            # read into pinned staging, else a pinned store's object as it is or one GIL-free copy
            host = staging.tensor if staging is not None else transfer.pinned(data)
            # the body to the device on the load stream, then every layer's device checksum compared;
            # signed, each layer's tag is checked on the host before its bytes are queued to go up
            expected = [s.device_sum for s in header.layers] if self._device_checkable(dest) else None
            body = host[header.layers[0].offset : header.end]
            seal = self.seal
            check = None if seal is None else lambda i: codec.verify_sections(header, data, seal, [i])
            upload_checked(body, dest, expected, transfer, self.encoding, codec.key_tile(header), check)

    def _device_checkable(self, dest: torch.Tensor) -> bool:
        """Whether sections are checked on the device: encoded ones always (whole words), native ones
        where a row is whole words."""
        return not self.encoding.native or device_checkable(self.spec.head_dim * dest.element_size())

    def _place_decoded(
        self, header: codec.ChunkHeader, data: memoryview, dest: torch.Tensor, transfer: Transfer
    ) -> None:
        """A compressed chunk: verified and decompressed on the host, into `dest` or into a buffer
        `transfer` stages, then uploaded."""
        out = dest
        if dest.device.type == "cuda":
            nbytes = dest.numel() * dest.element_size()
            out = transfer.stage(nbytes).tensor[:nbytes].view(dest.dtype).view(dest.shape)
        n_tokens = int(dest.shape[3])
        codec.decode_chunk(
            data,
            self.spec,
            header.key,
            header.start,
            n_tokens,
            out=out,
            encoding=self.encoding.name,
            seal=self.seal,
        )
        if out is not dest:
            with transfer.running():
                dest.copy_(out, non_blocking=True)
            transfer.wait()


def upload_checked(
    host: torch.Tensor,
    dest: torch.Tensor,
    expected: Sequence[int] | None,
    transfer: Transfer,
    encoding: Encoding | None = None,
    key_tile: int = 0,
    check: Callable[[int], None] | None = None,
) -> None:
    """Copy `host` (pinned bytes laid out as `dest`, e.g. a chunk's body or one layer's section) to the
    CUDA tensor `dest` ([n, ...]: n layers) on `transfer`'s stream, hand the buffers `transfer` staged
    back to be reused once the copy has finished, then compare each of the n layers' device checksum
    with `expected` (None: the bytes were verified on the host). With a quantized `encoding`, `host`
    holds the n encoded sections: they go up to a device buffer, are checked there and decoded into
    `dest`, on the stream; native sections whose keys are stored in tiles (`key_tile`,
    `codec.layout`) go up as they are, are checked there and turned into `dest`'s rows. With `check`
    (a signed chunk's host check of one layer's stored bytes, `codec.check_section`), the layers go up
    one copy each, each queued only once `check(i)` has passed: the host checks layer i + 1 while layer
    i is copied, and no unchecked byte reaches `dest` (a failed check raises with the layers before it
    placed). Blocks until the stream has done all of it (the GIL is released meanwhile);
    raises CorruptChunkError on a mismatch, naming the layer."""
    with transfer.running():
        if (encoding is None or encoding.native) and not key_tile:
            stored = dest
            src = host.view(dest.dtype).view(dest.shape)
        else:  # allocated on this stream: reused only after what is queued on it
            stored = torch.empty(
                (dest.shape[0], host.numel() // dest.shape[0]), dtype=torch.uint8, device=dest.device
            )
            src = host.view(stored.shape)
        if check is None:
            stored.copy_(src, non_blocking=True)
        else:
            try:
                for i in range(stored.shape[0]):
                    check(i)
                    stored[i].copy_(src[i], non_blocking=True)
            except BaseException:
                transfer.wait()  # nothing still reads `host` (a pinned store's object) once this raises
                raise
        transfer.copied()
        sums = device_checksums(stored).to("cpu", non_blocking=True) if expected is not None else None
        if stored is not dest and key_tile:
            codec.place_rows(dest, stored.view(dest.dtype).view(dest.shape), key_tile)
        elif stored is not dest:
            assert encoding is not None
            encoding.decode(stored, dest)
    transfer.wait()
    if sums is not None and expected is not None:
        for i, (got, want) in enumerate(zip(sums.tolist(), expected, strict=True)):
            if got != want:
                raise CorruptChunkError(f"layer {i}: device checksum mismatch")


class Fetched:
    """A chunk's object as `ChunkLoader.fetch_sync` read it, not yet placed: in `staged` (the transfer
    holding the staging buffer, the buffer, the size `read_into_sync` returned) or `data` (an object a
    store in memory handed out; None: absent). `place` or `discard` ends it, once. Where `damaged` is a
    list, a `place` that finds the bytes damaged (`proves_damage`) notes the key in it."""

    __slots__ = ("damaged", "data", "dest", "key", "loader", "staged", "start")

    def __init__(
        self,
        loader: ChunkLoader,
        key: str,
        start: int,
        dest: torch.Tensor,
        data: Any = None,
        staged: tuple[Transfer, Staging, int | None] | None = None,
    ) -> None:
        self.loader, self.key, self.start, self.dest = loader, key, start, dest
        self.data, self.staged = data, staged
        self.damaged: list[str] | None = None

    def place(self) -> int:
        """Check, verify and place the bytes in the destination; returns the stored bytes read."""
        try:
            if self.staged is None:
                return self.loader._place_object(self.key, self.start, self.dest, self.data)
            transfer, staging, size = self.staged
            with transfer:
                return self.loader._place_staged(self.key, self.start, self.dest, transfer, staging, size)
        except ChunkDecodeError as exc:
            if self.damaged is not None and proves_damage(exc):
                self.damaged.append(self.key)
            raise

    def discard(self) -> None:
        """Give the bytes back unplaced (the load was abandoned)."""
        if self.staged is not None:
            self.staged[0].close()
        self.data = None


async def fetch_abandonable(
    fetch: Callable[[str, int, torch.Tensor], Fetched], key: str, start: int, dest: torch.Tensor
) -> Fetched:
    """`fetch(key, start, dest)` in a worker thread that a cancellation abandons at once (a deadline, the
    restore's cancel): the thread's read runs on unheeded, and what it brings is discarded when it ends,
    never placed."""
    lock, abandoned = threading.Lock(), [False]

    def run() -> Fetched | None:
        fetched = fetch(key, start, dest)
        with lock:
            if not abandoned[0]:
                return fetched
        fetched.discard()
        return None

    try:
        fetched = await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except BaseException:
        with lock:
            abandoned[0] = True
        raise
    assert fetched is not None  # abandoned only by a cancellation, which raised
    return fetched
