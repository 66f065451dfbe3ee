"""TieredStore: fast small stores in front of slow big ones, e.g. `TieredStore([memory, disk, s3])`.

* Reads try the tiers top-down; a hit in a lower tier is copied into every tier above it (promotion, in
  the background, best effort). A tier that fails counts as a miss there; the read raises StoreError
  only when no tier had the object and one of them failed (the restorer then recomputes and reports it).
* Writes go to the top tier and reach the lower ones either in the background (`write="back"`, the
  default: `put` returns once the top tier has the object) or before `put` returns
  (`write="through"`). Write-back keeps every not-yet-flushed object in a bounded dirty buffer of its
  own (`max_dirty_bytes`), so an object is never lost because the top tier evicted it or the event loop
  that was flushing ended; `flush()` / `close()` write whatever is left and raise StoreError naming the
  tier that refused it. When the buffer is full, `put` writes through (back-pressure).
* `contains` asks each tier once for all keys still unanswered (one batch per tier, not per key).
* Capacities and eviction belong to the tiers (`MemoryStore(capacity_bytes=...)`,
  `open_store("file:///...", capacity_bytes=...)`): the tiered store only moves objects between them.

Keys name their content (a chunk's key hashes its whole token prefix and the model), so two copies of one
key are interchangeable; the only race that matters is a `delete` (of an object found corrupt) meeting a
promotion or flush still in flight, and that copy is deleted again when it lands.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

from kvrestore.core.errors import STORE_FAULTS, InvalidInputError, StoreError
from kvrestore.core.settings import check_bool, check_choice, check_instance, check_int
from kvrestore.stores.base import ChunkStore, StoredObject, check_key, copy_object
from kvrestore.stores.tier_moves import TierMoves, TierStats
from kvrestore.stores.wrapper import WrapperStore

WRITE_MODES = ("back", "through")


class TieredStore(WrapperStore):
    """Tiers top (fastest) first; see the module docstring for the read, write and failure rules.

    A wrapper of the top tier (`inner`) that changes every call to reach the tiers below it too; the
    moves between tiers are its part `moves` (`TierMoves`).

    Parameters
    ----------
    tiers: sequence of ChunkStore
        The tiers, fastest first, e.g. `[MemoryStore(capacity_bytes=...), open_store("s3://...")]`.
    write: "back" | "through"
        Whether `put` returns once the top tier has the object (the others get it in the background)
        or once every tier has it.
    promote: bool
        Copy a lower tier's hit into the tiers above it, in the background.
    max_dirty_bytes: int
        Bytes held for write-back at most; past it `put` writes through.
    max_promote_bytes: int
        Bytes of promotions in flight at most; past it a promotion is skipped.
    flush_concurrency, flush_retries: int
        Write-back copies in flight at most; failed rounds in a row before the flusher waits.

    Raises
    ------
    InvalidInputError
        No tiers, an unknown `write`, or a bad count.
    """

    def __init__(
        self,
        tiers: Sequence[ChunkStore],
        *,
        write: str = "back",
        promote: bool = True,
        max_dirty_bytes: int = 1 << 30,
        max_promote_bytes: int = 256 << 20,
        flush_concurrency: int = 4,
        flush_retries: int = 5,
    ) -> None:
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence):
            raise InvalidInputError(f"tiers must be a list of ChunkStores, got {tiers!r}")
        tiers = list(tiers)
        if not tiers:
            raise InvalidInputError("TieredStore needs at least one tier: tiers is empty")
        for t in tiers:
            check_instance("every tier", t, ChunkStore, "a ChunkStore (tiers)")
        check_choice("write", write, WRITE_MODES)
        promote = check_bool("promote", promote)
        max_dirty_bytes = check_int("max_dirty_bytes", max_dirty_bytes)
        max_promote_bytes = check_int("max_promote_bytes", max_promote_bytes)
        flush_concurrency = check_int("flush_concurrency", flush_concurrency)
        flush_retries = check_int("flush_retries", flush_retries)
        super().__init__(tiers[0])
        self.tiers = tiers
        self.write = write
        self.promote = promote
        self.max_dirty_bytes = max_dirty_bytes
        self.name = "tiered(" + " > ".join(t.name for t in tiers) + ")"
        self.moves = TierMoves(
            tiers,
            promote=promote,
            max_promote_bytes=max_promote_bytes,
            flush_concurrency=flush_concurrency,
            flush_retries=flush_retries,
        )
        self.stats: list[TierStats] = self.moves.stats
        self.dirty_hits = 0

    def over_tiers(self, wrap: Callable[[ChunkStore], ChunkStore]) -> TieredStore:
        """This store reached through `wrap(tier)` for each of its tiers (e.g. a `DeadlineStore` each): a
        new object that shares this one's write-back buffer, promotions and counters, so a write through
        either is flushed by both; this one is left as it is."""
        view = copy.copy(self)
        view.tiers = [wrap(t) for t in self.tiers]
        view.inner = view.tiers[0]
        view.moves = self.moves.over(view.tiers)
        return view

    @property
    def dirty_bytes(self) -> int:
        """Bytes held for write-back."""
        return self.moves.sizes.dirty_bytes

    @property
    def pending_writes(self) -> int:
        """Objects accepted by `put` that have not reached every tier yet."""
        return self.moves.pending_writes

    # -- ChunkStore ------------------------------------------------------------------------------------

    @property
    def local_dir(self) -> str | None:  # type: ignore[override]
        return None  # objects live in several tiers, not in the top tier's directory alone

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        errors: list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                data = await tier.get(key)
            except STORE_FAULTS as exc:
                errors.append(self.moves.failed(i, exc))
                continue
            if data is not None:
                self.stats[i].hits += 1
                self.moves.promote_copy(key, data, i)
                return data
            self.stats[i].misses += 1
        return self._dirty_or_miss(key, errors)

    def _dirty_or_miss(self, key: str, errors: list[str]) -> bytes | None:
        e = self.moves.dirty.get(key)
        if e is not None:  # the top tier let it go before the lower ones got it
            self.dirty_hits += 1
            return e.data
        if errors:
            raise StoreError(f"{key[:12]} found in no tier; " + "; ".join(errors))
        return None

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_key(key)
        errors: list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                data = await tier.get_range(key, start, end)
            except STORE_FAULTS as exc:
                errors.append(self.moves.failed(i, exc))
                continue
            if data is not None:
                self.stats[i].hits += 1
                return data
            self.stats[i].misses += 1
        whole = self._dirty_or_miss(key, errors)
        return None if whole is None else whole[start:end]

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        check_key(key)
        errors: list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                got = await tier.get_ranges(key, ranges)
            except STORE_FAULTS as exc:
                errors.append(self.moves.failed(i, exc))
                continue
            if any(g is not None for g in got):
                self.stats[i].hits += 1
                return got
            self.stats[i].misses += 1
        whole = self._dirty_or_miss(key, errors)
        return [None if whole is None else whole[a:b] for a, b in ranges]

    async def read_into(self, key: str, buffer: memoryview) -> int | None:
        """Top tier: its own read_into (straight into the buffer on disk). Lower tiers: as `get` (found
        objects are promoted; one the reader then finds damaged it deletes, which cancels its promotion
        before it starts: `delete` drops the token without awaiting first), copied into the buffer."""
        check_key(key)
        errors: list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                if i == 0 or not self.promote:
                    size = await tier.read_into(key, buffer)
                    if size is None:
                        self.stats[i].misses += 1
                        continue
                    self.stats[i].hits += 1
                    return size
                data = await tier.get(key)
            except STORE_FAULTS as exc:
                errors.append(self.moves.failed(i, exc))
                continue
            if data is None:
                self.stats[i].misses += 1
                continue
            self.stats[i].hits += 1
            self.moves.promote_copy(key, data, i)
            return await copy_object(buffer, data)
        data = self._dirty_or_miss(key, errors)
        return None if data is None else await copy_object(buffer, data)

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        data = bytes(data)
        await self.moves.settle(key)
        old = self.moves.take(key)
        if old is not None:
            old.deleted = False  # same key, same content: let its flush finish normally
        lower = set(range(1, len(self.tiers)))
        inline = (
            self.write == "through"
            or not lower
            or self.moves.sizes.dirty_bytes + len(data) > self.max_dirty_bytes
            or not self.moves.bg.available()
        )
        if inline:
            failed = await self.moves.put_tiers(key, data, range(len(self.tiers)))
            if failed:
                raise StoreError(f"cannot write {key[:12]}: " + "; ".join(failed.values()))
            return
        failed = await self.moves.put_tiers(key, data, [0])
        if failed:  # the top tier refused it: go straight to the others
            failed = await self.moves.put_tiers(key, data, sorted(lower))
            if len(failed) == len(lower):
                raise StoreError(f"cannot write {key[:12]} to any tier: " + "; ".join(failed.values()))
            return
        self.moves.hold(key, data, lower)

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """One batch `contains` per tier for the keys no upper tier had; a failing tier answers no."""
        for k in keys:
            check_key(k)
        out = [k in self.moves.dirty for k in keys]
        todo = [i for i, ok in enumerate(out) if not ok]
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                got = await tier.contains([keys[i] for i in todo])
            except STORE_FAULTS as exc:
                self.moves.failed(t, exc)
                continue
            for i, ok in zip(todo, got, strict=True):
                out[i] = ok
            todo = [i for i in todo if not out[i]]
        return out

    async def delete(self, key: str) -> None:
        check_key(key)
        await self.moves.settle(key)
        self.moves.forget(key)
        failed = await self.moves.delete_tiers(key, range(len(self.tiers)))
        if failed:
            raise StoreError(f"cannot delete {key[:12]}: " + "; ".join(failed.values()))

    async def scan(self) -> list[StoredObject]:
        seen: dict[str, StoredObject] = {}
        for tier in reversed(self.tiers):
            with contextlib.suppress(NotImplementedError):
                for obj in await tier.scan():
                    seen[obj.key] = obj
        return list(seen.values())

    def prefetch(self, keys: Sequence[str]) -> None:
        for tier in self.tiers:
            tier.prefetch(keys)

    async def flush(self) -> None:
        """Wait for promotions and write-back; write what is still dirty; raise if a tier refuses it."""
        await self.moves.bg.wait()
        dirty = self.moves.dirty
        for key, e in list(dirty.items()):
            if not e.busy:
                await self.moves.flush_entry(key, e)
        await self.moves.bg.wait()
        if dirty:
            tiers = sorted({self.tiers[i].name for e in dirty.values() for i in e.pending})
            raise StoreError(
                f"{len(dirty)} objects not yet written to {', '.join(tiers)}; "
                + "; ".join(s.last_error for s in self.stats if s.last_error)
            )
        for tier in self.tiers:
            await tier.flush()

    async def close(self) -> None:
        """Flush, then close every tier (also when the flush failed; its error is raised after)."""
        try:
            await self.flush()
        finally:
            self.moves.bg.cancel()
            for tier in self.tiers:
                with contextlib.suppress(Exception):
                    await tier.close()

    def __repr__(self) -> str:
        return f"TieredStore({self.tiers!r}, write={self.write!r})"


__all__ = ["TierStats", "TieredStore"]
