"""PrefetchStore: a bounded read-ahead buffer in front of a store with a round trip (S3, a remote tier).

A load lane that asks for chunk i only after chunk i-1 arrived waits one round trip per chunk. This
wrapper starts those round trips earlier, so the bytes are already here (or on their way) when asked:

* `prefetch(keys)`: an explicit hint, "these keys, in this order, soon" (what an engine would call
  with a policy's load order);
* read-ahead (`readahead=True`): the keys a multi-key `contains` found present are remembered in order;
  when one is read, the next `depth` after it in the direction reads are going (forwards, or backwards
  for a policy that loads from the back, as the two-pointer ones do) are fetched too.

At most `depth` fetches are in flight, and a fetch starts only while the buffer plus the fetches in
flight (sized like the last object) stay within `max_bytes`. An object nobody reads within `max_age_s`
is dropped (counted in `wasted`). A buffered object is handed out once. A fetch that fails
is not retried here: the caller that wanted it sees the error (and recomputes). Background fetches are
asyncio tasks; under another event loop library the wrapper only passes calls through. Range reads,
writes, listings, `flush` and `close` go straight to the inner store (`WrapperStore`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvrestore.core.settings import check_bool, check_int, check_number
from kvrestore.stores.background import Background
from kvrestore.stores.base import ChunkStore, check_key, copy_object
from kvrestore.stores.wrapper import WrapperStore

#: read-ahead sequences remembered at once (one per restore in flight)
MAX_SEQUENCES = 64


@dataclass(eq=False)
class _Sequence:
    keys: list[str]
    last: int | None = None  # index of the last key read, for the direction


class PrefetchStore(WrapperStore):
    """`inner` behind a read-ahead buffer of at most `max_bytes`, `depth` fetches in flight."""

    #: a read-ahead object is handed out as the bytes already fetched
    reads_in_memory = True

    def __init__(
        self,
        inner: ChunkStore,
        *,
        max_bytes: int = 256 << 20,
        depth: int = 8,
        readahead: bool = True,
        max_age_s: float = 30.0,
    ) -> None:
        max_bytes, depth = check_int("max_bytes", max_bytes), check_int("depth", depth)
        readahead = check_bool("readahead", readahead)
        max_age_s = check_number("max_age_s", max_age_s, positive=True)
        super().__init__(inner)
        self.max_bytes = max_bytes
        self.depth = depth
        self.readahead = readahead
        self.max_age_s = max_age_s
        self._typical = 0  # size of the last object fetched: the estimate for those in flight
        self._born: dict[str, float] = {}
        self.buffered_bytes = 0
        self.prefetched = 0  # fetches started ahead of a read
        self.hits = 0  # reads served from the buffer or from a fetch already in flight
        self.wasted = 0  # prefetched objects dropped unread
        self._ready: OrderedDict[str, bytes] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[bytes | None | Exception]] = {}
        self._queue: deque[str] = deque()
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()
        self._position: dict[str, tuple[_Sequence, int]] = {}
        self._bg = Background()

    # -- the buffer ------------------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[str]) -> None:
        """Fetch `keys` into the buffer, and pass the hint on (an inner read-ahead tier joins in)."""
        self._enqueue(keys)
        self.inner.prefetch(keys)

    def _enqueue(self, keys: Sequence[str]) -> None:
        for k in keys:
            check_key(k)
            if k not in self._ready and k not in self._inflight and k not in self._queue:
                self._queue.append(k)
        self._pump()

    def _room(self) -> bool:
        """Whether one more fetch fits: the buffer plus what is in flight, sized like the last objects."""
        if len(self._inflight) >= self.depth:
            return False
        return self.buffered_bytes + (len(self._inflight) + 1) * self._typical <= self.max_bytes

    def _pump(self) -> None:
        self._expire()
        for key in [k for k, t in self._inflight.items() if t.done()]:  # ended with a closed loop
            del self._inflight[key]
        while self._queue and self._room():
            key = self._queue.popleft()
            if key in self._ready or key in self._inflight:
                continue
            task = self._bg.spawn(self._fetch, key)
            if task is None:  # no asyncio loop: no read-ahead
                self._queue.clear()
                return
            self._inflight[key] = task
            self.prefetched += 1

    async def _fetch(self, key: str) -> bytes | None | Exception:
        """The object (buffered), None, or the error (returned, not raised: nobody may await this)."""
        try:
            try:
                data = await self.inner.get(key)
            except Exception as exc:
                return exc
            if data is not None and self._inflight.get(key) is asyncio.current_task():
                self._typical = len(data)
                self._ready[key] = data
                self._born[key] = time.monotonic()
                self.buffered_bytes += len(data)
                self._trim()
            return data
        finally:
            if self._inflight.get(key) is asyncio.current_task():
                del self._inflight[key]
            self._pump()

    def _trim(self) -> None:
        """Over the bound (objects bigger than the last ones): drop the oldest unread."""
        while self.buffered_bytes > self.max_bytes and len(self._ready) > 1:
            self._unbuffer(next(iter(self._ready)))
            self.wasted += 1

    def _expire(self) -> None:
        """Drop objects nobody read within `max_age_s` (a restore that computed them instead)."""
        cutoff = time.monotonic() - self.max_age_s
        while self._ready and self._born.get(next(iter(self._ready)), 0.0) < cutoff:
            self._unbuffer(next(iter(self._ready)))
            self.wasted += 1

    def _unbuffer(self, key: str) -> bytes | None:
        data = self._ready.pop(key, None)
        self._born.pop(key, None)
        if data is not None:
            self.buffered_bytes -= len(data)
        return data

    def _drop(self, key: str) -> None:
        self._unbuffer(key)
        self._inflight.pop(key, None)  # its result will not be buffered
        if key in self._queue:
            self._queue.remove(key)

    async def _take(self, key: str) -> tuple[bool, bytes | None]:
        """(True, bytes) when the buffer has or is fetching `key`, else (False, None)."""
        data = self._unbuffer(key)
        if data is not None:
            self.hits += 1
            self._pump()
            return True, data
        task = self._inflight.get(key)
        if task is not None and self._bg.is_live(task):
            self.hits += 1
            got = await asyncio.shield(task)
            self._unbuffer(key)
            self._pump()
            if isinstance(got, Exception):
                raise got
            return True, got
        return False, None

    def _read_ahead(self, key: str) -> None:
        if not self.readahead or key not in self._position:
            return
        seq, i = self._position[key]
        n = len(seq.keys)
        # the first read picks the direction from where it is; later ones from the one before
        backwards = (i == n - 1 and n > 1) if seq.last is None else i < seq.last
        step = -1 if backwards else 1
        seq.last = i
        nxt = range(i + step, i + step * (self.depth + 1), step)
        self._enqueue([seq.keys[j] for j in nxt if 0 <= j < n])

    def _remember(self, keys: list[str]) -> None:
        """A restore's stored chunks, in order (several restores at once each keep their own)."""
        seq = _Sequence(keys)
        self._sequences[id(seq)] = seq
        for i, k in enumerate(keys):
            self._position[k] = (seq, i)
        while len(self._sequences) > MAX_SEQUENCES:
            _, old = self._sequences.popitem(last=False)
            for k in old.keys:
                if self._position.get(k, (None,))[0] is old:
                    del self._position[k]

    # -- ChunkStore ------------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        self._read_ahead(key)
        found, data = await self._take(key)
        if found:
            return data
        return await self.inner.get(key)

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        check_key(key)
        self._read_ahead(key)
        found, data = await self._take(key)
        if not found:
            return await self.inner.read_into(key, buffer)
        return None if data is None else await copy_object(buffer, data)

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        self._drop(key)
        await self.inner.put(key, data)

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        found = await self.inner.contains(keys)
        if self.readahead and len(keys) > 1:
            self._remember([k for k, ok in zip(keys, found, strict=True) if ok])
        return found

    async def delete(self, key: str) -> None:
        check_key(key)
        self._drop(key)
        await self.inner.delete(key)

    async def close(self) -> None:
        self._queue.clear()
        self._bg.cancel()
        self._inflight.clear()
        self._ready.clear()
        self._born.clear()
        self.buffered_bytes = 0
        await self.inner.close()

    def __repr__(self) -> str:
        return f"PrefetchStore({self.inner!r}, max_bytes={self.max_bytes}, depth={self.depth})"


__all__ = ["PrefetchStore"]
