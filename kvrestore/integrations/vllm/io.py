"""The vLLM connector's background I/O, without vLLM: an event loop in a daemon thread (`IOThread`), on
which every store operation runs while vLLM's step loop waits only, with a bound, for the layer it is
about to compute (`load`); a bounded saver; and the stored chunks a load reads (`LoadChunk`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import STORE_FAULTS
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread as IOThread
from kvrestore.integrations.vllm.layouts import fp8_sections
from kvrestore.integrations.vllm.stats import log
from kvrestore.stores.base import ChunkStore


class ChunkSaver:
    """Encodes (in `encoding`: `quant.ENCODINGS`) and writes chunks in the background; never blocks its
    caller.

    At most `max_bytes` of KV wait to be written; a chunk that does not fit is dropped (only a future
    cache miss), counted in `dropped` with a warning. A write fault counts in `failed`, with one warning,
    and the store is then left alone for `retry_after_s`: chunks offered meanwhile are neither copied out
    nor written, and count in `failed` (a read-only store warns once per `retry_after_s`, not per chunk).
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        io: IOThread,
        *,
        compression: str = "none",
        max_bytes: int = 1 << 30,
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
        (counted, warned), or while the store is left alone after a write fault (counted in `failed`)."""
        with self._lock:
            if time.monotonic() < self._down_until:
                self.failed += 1
                return False
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
        """Queue `chunk`, for which `nbytes` of room were reserved (given back once it is written or
        has failed: an fp8 cache's chunk is smaller than the room reserved for it). With `ready`, its bytes (pinned memory a copy from the
        GPU is still filling) are read once that event completed, in the writer's thread. With
        `fp8_scales` ([L, 2]: each layer's K and V scale), `chunk.data` holds an fp8 cache's values,
        stored as they are in fp8 chunks (`layouts.fp8_sections`)."""
        fut = self.io.submit(self._write, key, chunk, nbytes, ready, fp8_scales)
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
            self._limiter = anyio.CapacityLimiter(2)  # writes at a time

        def encode() -> bytes:
            if ready is not None:
                ready.synchronize()
            how: dict[str, Any] = dict(encoding=self.encoding, compression=self.compression, seal=self.seal)
            if fp8_scales is not None:
                enc = codec.spec_encoding(self.spec, self.encoding)
                sections = fp8_sections(chunk.data.cpu(), fp8_scales, enc)
                return codec.encode_sections(sections, chunk.start, chunk.n_tokens, self.spec, key, **how)
            tile = self.key_tile if self.encoding == "native" else 0
            if tile and chunk.n_tokens % tile:  # a chunk of part of a tile: keys row-major
                tile = 0
            return codec.encode_chunk(chunk, self.spec, key, key_tile=tile, **how)

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
