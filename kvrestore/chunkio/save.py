"""Writing chunks: encode each off the event loop and store it, a few at a time (`write_one`).

Two callers, one path. A `Restorer`'s save writes a prompt's chunks and waits (`write_chunks`): a store
fault fails its chunk only (the others are written and stay stored); once every write has ended they
raise one `SaveError` that says which keys were written and which were not. An engine that cannot wait
(vLLM's step) queues them (`ChunkSaver`): at most `max_bytes` of KV wait, and a store that failed a
write is left alone for its back-off (a `DeadlineStore`'s, as a restorer's store is). Any other error is
a bug and propagates as itself, not wrapped in an exception group.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.chunkio.pages import fp8_sections
from kvrestore.chunkio.stored import each
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import STORE_FAULTS, WRITE_FAULTS, SaveError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.deadline import SAVE_TIMEOUT_S, Deadlines, DeadlineStore

log = logging.getLogger("kvrestore.chunkio")


@dataclass
class SaveStats:
    n_chunks: int
    written_chunks: int
    skipped_chunks: int  # already stored
    bytes_written: int
    seconds: float


async def write_one(
    store: ChunkStore,
    spec: ModelSpec,
    key: str,
    chunk: KVChunk,
    *,
    encoding: str = "native",
    compression: str = "none",
    seal: Seal | None = None,
    key_tile: int = 0,
    ready: torch.cuda.Event | None = None,
    fp8_scales: torch.Tensor | None = None,
) -> int:
    """Encode `chunk` (in `encoding`, `codec.quant`; signed with `seal` where given; native chunks of whole
    tiles of `key_tile` tokens with their keys in tiles, `codec.layout`) in a worker thread and store it
    under `key`; returns the bytes written. With `ready`, the chunk's bytes (pinned memory a copy from a
    GPU is still filling) are read once that event completed. With `fp8_scales` ([L, 2]: each layer's K
    and V scale), `chunk.data` holds an fp8 cache's values, stored as they are (`pages.fp8_sections`).
    Store faults propagate."""

    def encode() -> bytes:
        if ready is not None:
            ready.synchronize()
        how: dict[str, Any] = dict(encoding=encoding, compression=compression, seal=seal)
        if fp8_scales is not None:
            sections = fp8_sections(chunk.data.cpu(), fp8_scales, codec.spec_encoding(spec, encoding))
            return codec.encode_sections(sections, chunk.start, chunk.n_tokens, spec, key, **how)
        tile = key_tile if encoding == "native" and chunk.n_tokens % max(key_tile, 1) == 0 else 0
        return codec.encode_chunk(chunk, spec, key, key_tile=tile, **how)

    blob = await anyio.to_thread.run_sync(encode)
    await store.put(key, blob)
    return len(blob)


async def write_chunks(
    store: ChunkStore,
    spec: ModelSpec,
    kv: KVCache,
    refs: list[ChunkRef],
    lanes: int,
    compression: str,
    encoding: str = "native",
    seal: Seal | None = None,
) -> int:
    """Store `refs`' chunks of `kv` (`write_one`), `lanes` at a time; returns the bytes written. Store
    faults (`WRITE_FAULTS`) fail their chunk only: `SaveError` once all writes have ended."""
    nbytes = 0
    written: list[str] = []
    failed: dict[str, Exception] = {}
    limiter = anyio.CapacityLimiter(lanes)

    async def write(ref: ChunkRef) -> None:
        nonlocal nbytes
        async with limiter:
            chunk = kv.chunk(ref.start, ref.end)
            try:
                n = await write_one(
                    store, spec, ref.key, chunk, encoding=encoding, compression=compression, seal=seal
                )
            except WRITE_FAULTS as exc:
                failed[ref.key] = exc
                return
            written.append(ref.key)
            nbytes += n  # after the await: concurrent writes each add their own

    await each(write, refs)  # a bug, not a store fault, is raised as itself
    if failed:
        first = next(iter(failed.values()))
        raise SaveError(
            f"{len(failed)} of {len(refs)} chunks could not be written ({len(written)} were, and stay "
            f"stored); first error: {type(first).__name__}: {first}",
            written,
            failed,
        ) from first
    return nbytes


class ChunkSaver:
    """Writes chunks in the background on `io`'s event loop (`write_one`, `lanes` at a time); never blocks
    its caller.

    At most `max_bytes` of KV wait to be written; a chunk that does not fit is dropped (only a future
    cache miss), counted in `dropped` with a warning. A write fault counts in `failed`, with one warning
    per outage, and the store counts as down for its back-off (`store`, a `DeadlineStore`: one is put
    around any other, backing off `retry_after_s`, each write bounded by `SAVE_TIMEOUT_S`): chunks
    offered meanwhile are neither copied out nor written, and count in `failed` (a read-only store warns
    once per back-off, not per chunk). `key_tile`: native chunks of whole tiles are stored with their
    keys in tiles of this many tokens (0: not): the page size of a cache that keeps its keys so
    (`codec.layout`)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        io: LoopThread,
        *,
        compression: str = "none",
        max_bytes: int = 1 << 30,
        encoding: str = "native",
        seal: Seal | None = None,
        retry_after_s: float = 10.0,
        key_tile: int = 0,
        lanes: int = 2,
    ) -> None:
        self.spec = spec
        if not isinstance(store, DeadlineStore):
            deadlines = Deadlines(None, None, SAVE_TIMEOUT_S, backoff_s=retry_after_s, max_backoff_s=retry_after_s)
            store = DeadlineStore(store, deadlines)
        self.store = store
        self.io = io
        self.key_tile = key_tile
        self.how: dict[str, Any] = dict(
            encoding=codec.spec_encoding(spec, encoding).name,  # `quant.ENCODINGS`: checked here
            compression=compression,
            seal=seal,  # signs every chunk written, where the writer has a secret
        )
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.written = 0
        self.written_bytes = 0
        self.dropped = 0
        self.failed = 0
        self.lanes = lanes
        self._warned = False  # the store's outage is warned of
        self._seen: dict[str, int] = {}  # the counts `take_counts` last returned
        self._lock = threading.Lock()
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop

    def submit(self, key: str, chunk: KVChunk) -> bool:
        """Queue `chunk` (its own memory: the caller must not reuse it) for writing under `key`."""
        if not self.reserve(key, chunk.nbytes):
            return False
        self.submit_reserved(key, chunk, chunk.nbytes)
        return True

    def reserve(self, key: str, nbytes: int) -> bool:
        """Take room for a chunk of `nbytes` before it is copied out (one that would be dropped is not
        copied at all); then `submit_reserved` it or `unreserve` the room. False if there is none
        (counted, warned), or while the store is down (counted in `failed`)."""
        with self._lock:
            if self.store.down_for > 0:
                self.failed += 1
                return False
            self._warned = False  # the back-off is over: the next fault is a new outage
            if self.pending_bytes + nbytes <= self.max_bytes:
                self.pending_bytes += nbytes
                return True
            self.dropped += 1
            dropped, pending = self.dropped, self.pending_bytes
        log.warning(
            "kvrestore: save queue full (%d of %d bytes waiting): dropped chunk %s (%d dropped so far)",
            pending,
            self.max_bytes,
            key[:12],
            dropped,
        )
        return False

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.pending_bytes -= nbytes

    def submit_reserved(
        self,
        key: str,
        chunk: KVChunk,
        nbytes: int,
        ready: torch.cuda.Event | None = None,
        fp8_scales: torch.Tensor | None = None,
    ) -> None:
        """Queue `chunk`, for which `nbytes` of room were reserved (given back once it is written or has
        failed: an fp8 cache's chunk is smaller than the room reserved for it); `ready` and `fp8_scales`
        as `write_one` takes them."""
        fut = self.io.submit(self._write, key, chunk, nbytes, ready, fp8_scales)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(fut)

    async def _write(
        self, key: str, chunk: KVChunk, nbytes: int, ready: torch.cuda.Event | None, fp8_scales: torch.Tensor | None
    ) -> None:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.lanes)
        try:
            async with self._limiter:
                n = await write_one(
                    self.store,
                    self.spec,
                    key,
                    chunk,
                    key_tile=self.key_tile,
                    ready=ready,
                    fp8_scales=fp8_scales,
                    **self.how,
                )
            with self._lock:
                self.written += 1
                self.written_bytes += n
        except STORE_FAULTS as exc:
            self.store.failed()  # a timeout has marked it down already; any other fault does now
            with self._lock:
                self.failed += 1
                first, self._warned = not self._warned, True
            if first:
                log.warning(
                    "kvrestore: could not save chunk %s (%s: %s); not saving to %s for %.0f s",
                    key[:12],
                    type(exc).__name__,
                    exc,
                    self.store.name,
                    self.store.down_for,
                )
        finally:
            with self._lock:
                self.pending_bytes -= nbytes

    def take_counts(self) -> dict[str, int]:
        """The chunks saved (and their bytes), dropped and failed since this was last called."""
        with self._lock:
            now = {
                "saved_chunks": self.written,
                "saved_bytes": self.written_bytes,
                "dropped_chunks": self.dropped,
                "failed_saves": self.failed,
            }
        seen, self._seen = self._seen, now
        return {name: n - seen.get(name, 0) for name, n in now.items()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued write; False if some were still running after `timeout` seconds."""
        with self._lock:
            futures = list(self._futures)
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def finish(self, timeout: float | None = None) -> None:
        """`flush`, then warn of the writes still running after `timeout` seconds and of the chunks that
        were dropped or failed (the end of a process that saved in the background)."""
        if not self.flush(timeout):
            log.warning("kvrestore: some chunk writes were still running at shutdown")
        if self.dropped or self.failed:
            log.warning(
                "kvrestore: %d chunks saved, %d dropped (queue full), %d failed",
                self.written,
                self.dropped,
                self.failed,
            )
