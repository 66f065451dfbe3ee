"""How a `TieredStore` moves objects between its tiers: promotion of a lower tier's hit into the tiers
above it, and write-back of objects the top tier has accepted into the tiers below it (see
`kvrestore.stores.tiered` for the rules), each in the background and best effort, with per-tier counters.

`TierMoves` is a part of the tiered store (`store.moves`): it owns the write-back buffer, the
promotions in flight, the background tasks and the per-tier counters; the store decides, per call, what
to read, write or delete and hands the moves to it.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import anyio

from kvrestore.core.errors import STORE_FAULTS
from kvrestore.stores.background import Background
from kvrestore.stores.base import ChunkStore, in_order


@dataclass
class TierStats:
    """Counters of one tier as seen through the tiered store."""

    name: str
    hits: int = 0
    misses: int = 0
    errors: int = 0
    promoted_in: int = 0  # objects copied into this tier from a lower one
    flushed_in: int = 0  # write-back copies that reached this tier
    last_error: str | None = None


@dataclass
class Sizes:
    """The counts and the flusher that every view of one `TierMoves` shares."""

    dirty_bytes: int = 0
    promote_bytes: int = 0
    flusher: asyncio.Task[None] | None = None


@dataclass(eq=False)
class DirtyEntry:
    """An object `put` accepted that has not reached every tier yet (write-back's buffer holds it)."""

    data: bytes
    pending: set[int]  # tiers the object has not reached yet
    busy: bool = False
    deleted: bool = False
    idle: asyncio.Event | None = None  # set when a flush in flight ends


class TierMoves:
    """Promotion and write-back between `tiers` (top first), in the background; the parameters are
    `TieredStore`'s. After `flush_retries` failed write-back rounds in a row the flusher waits for the
    next put or flush."""

    def __init__(
        self,
        tiers: Sequence[ChunkStore],
        *,
        promote: bool,
        max_promote_bytes: int,
        flush_concurrency: int,
        flush_retries: int,
    ) -> None:
        self.tiers = tiers
        self.promote = promote
        self.max_promote_bytes = max_promote_bytes
        self.flush_concurrency = flush_concurrency
        self.flush_retries = flush_retries
        self.stats = [TierStats(t.name) for t in tiers]
        self.dirty: dict[str, DirtyEntry] = {}  # accepted by the top tier, not yet by every other
        self._promoting: dict[str, object] = {}
        self.bg = Background()
        self.sizes = Sizes()  # shared by every view (`over`)

    def over(self, tiers: Sequence[ChunkStore]) -> TierMoves:
        """These moves (the same buffer, promotions, counters and background tasks) made through
        `tiers`, one for each of this one's (a wrapper of each, such as a `DeadlineStore`)."""
        view = copy.copy(self)
        view.tiers = tiers
        return view

    # -- bookkeeping ---------------------------------------------------------------------------------

    def failed(self, i: int, exc: BaseException) -> str:
        msg = f"{self.tiers[i].name}: {type(exc).__name__}: {exc}"
        self.stats[i].errors += 1
        self.stats[i].last_error = msg
        return msg

    @property
    def pending_writes(self) -> int:
        """Objects accepted by `put` that have not reached every tier yet."""
        return len(self.dirty)

    def hold(self, key: str, data: bytes, pending: set[int]) -> None:
        """Keep `data`, which the top tier has, until it reaches the tiers `pending`; start the flusher."""
        self.dirty[key] = DirtyEntry(data, pending)
        self.sizes.dirty_bytes += len(data)
        self.kick()

    def take(self, key: str) -> DirtyEntry | None:
        """Stop holding `key` (a new put of it, or a delete); its flush in flight, if any, goes on."""
        e = self.dirty.pop(key, None)
        if e is not None:
            self.sizes.dirty_bytes -= len(e.data)
        return e

    def forget(self, key: str) -> None:
        """`key` is being deleted: its held copy and any promotion not yet written are dropped, and a
        copy a flush or promotion lands later is deleted again."""
        e = self.take(key)
        if e is not None:
            e.deleted = True
        self._promoting.pop(key, None)

    async def put_tiers(self, key: str, data: bytes, tiers: Iterable[int]) -> dict[int, str]:
        """Write to several tiers at once; returns {tier: error} of those that failed."""
        return await self._on_tiers(lambda tier: tier.put(key, data), tiers)

    async def delete_tiers(self, key: str, tiers: Iterable[int]) -> dict[int, str]:
        """Delete from several tiers at once, also when cancelled; returns {tier: error} of those that
        failed."""
        with anyio.CancelScope(shield=True):
            failures = await self._on_tiers(lambda tier: tier.delete(key), tiers)
        return failures

    async def _on_tiers(
        self, call: Callable[[ChunkStore], Awaitable[None]], tiers: Iterable[int]
    ) -> dict[int, str]:
        failures: dict[int, str] = {}

        async def one(i: int) -> None:
            try:
                await call(self.tiers[i])
            except STORE_FAULTS as exc:
                failures[i] = self.failed(i, exc)

        await in_order([partial(one, i) for i in tiers])
        return failures

    # -- promotion -------------------------------------------------------------------------------------

    def promote_copy(self, key: str, data: bytes, found_in: int) -> None:
        """Copy an object read from tier `found_in` into the tiers above it, in the background."""
        if not self.promote or found_in == 0 or key in self._promoting:
            return
        if self.sizes.promote_bytes + len(data) > self.max_promote_bytes:
            return  # promotions are an optimisation: skip rather than queue without bound
        token = object()
        self._promoting[key] = token
        self.sizes.promote_bytes += len(data)
        if self.bg.spawn(self._promote_task, key, data, found_in, token) is None:
            self._promoting.pop(key, None)
            self.sizes.promote_bytes -= len(data)

    async def _promote_task(self, key: str, data: bytes, found_in: int, token: object) -> None:
        try:
            if self._promoting.get(key) is not token:
                return  # deleted before it started
            failed = await self.put_tiers(key, data, range(found_in))
            written = [i for i in range(found_in) if i not in failed]
            for i in written:
                self.stats[i].promoted_in += 1
            if self._promoting.get(key) is not token:  # deleted while it was written: undo
                await self.delete_tiers(key, written)
        finally:
            self.sizes.promote_bytes -= len(data)
            if self._promoting.get(key) is token:
                del self._promoting[key]

    # -- write-back ------------------------------------------------------------------------------------

    def kick(self) -> None:
        """Make sure a flusher runs on this loop."""
        if not self.bg.is_live(self.sizes.flusher):
            self.sizes.flusher = self.bg.spawn(self._flush_loop)

    async def _flush_loop(self) -> None:
        failures = 0
        while failures < self.flush_retries:
            batch = [(k, e) for k, e in self.dirty.items() if not e.busy][: self.flush_concurrency]
            if not batch:
                return
            # a background task is always an asyncio one (see Background): gather is the plain way
            results = await asyncio.gather(*(self.flush_entry(k, e) for k, e in batch))
            if all(results):
                failures = 0
            else:
                failures += 1
                await anyio.sleep(min(0.05 * 2**failures, 2.0))
        # gave up for now: the entries stay dirty; the next put, flush() or close() tries again

    async def flush_entry(self, key: str, e: DirtyEntry) -> bool:
        """Write one dirty object to the tiers it has not reached; True when none is left."""
        if e.busy:
            return False
        e.busy = True
        e.idle = asyncio.Event()
        try:
            tiers = sorted(e.pending)
            failed = await self.put_tiers(key, e.data, tiers)
            for i in tiers:
                if i not in failed:
                    e.pending.discard(i)
                    self.stats[i].flushed_in += 1
            if e.deleted:  # deleted while it was written: undo
                await self.delete_tiers(key, [i for i in tiers if i not in failed])
                return True
            if not e.pending and self.dirty.get(key) is e:
                del self.dirty[key]
                self.sizes.dirty_bytes -= len(e.data)
            return not failed
        finally:
            e.busy = False
            e.idle.set()

    async def settle(self, key: str) -> None:
        """Wait until no flush of `key` is in flight, so a put or delete after it cannot be overtaken by
        an older object landing in a lower tier."""
        while (e := self.dirty.get(key)) is not None and e.busy and e.idle is not None:
            await e.idle.wait()
