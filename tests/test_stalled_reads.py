"""A local directory whose reads stall (a network filesystem mount) never holds a restore past its cancel
or its load deadline: the read is abandoned, its chunk computed, and what it brings late is never
written into the KV (issue #50). No clock is asserted on: the reads here block until the test lets
them go, so a restore that returns at all before then has abandoned them."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from kvrestore import (
    Auto,
    BatchEngine,
    KVCache,
    LayerTwoPointer,
    LoadOnly,
    LocalStore,
    Restorer,
    TokenTwoPointer,
)
from kvrestore.chunkio.load import Fetched
from kvrestore.runtime.engine import Engine
from kvrestore.stores import local
from kvrestore.stores.deadline import BACKOFF_S
from kvrestore.stores.wrapper import WrapperStore

from .conftest import random_tokens
from .waiting import wait_until

N_TOKENS, CHUNK, LANES = 300, 32, 2
ATOL = 1e-4


class Stall:
    """Makes every read of a file by `LocalStore` block until `release` is set, once `on` is set;
    counts the reads that began to block (`began`) and that still block (`blocked`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.began = self.blocked = 0
        for name in ("_read_file_into", "_read_ranges"):
            monkeypatch.setattr(local, name, self.stalling(getattr(local, name)))

    def stalling(self, read):
        def stalled(*args):
            if self.on:
                with self.lock:
                    self.began += 1
                    self.blocked += 1
                try:
                    self.release.wait(60)  # only a bound on a hang
                finally:
                    with self.lock:
                        self.blocked -= 1
            return read(*args)

        return stalled


@pytest.fixture
def stall(monkeypatch):
    s = Stall(monkeypatch)
    yield s
    s.release.set()  # the abandoned reads end, and their threads with them


def nan_buffer(spec) -> KVCache:
    return KVCache(spec, torch.full_like(KVCache.empty(spec, N_TOKENS).data, float("nan")))


POLICIES = [LoadOnly, TokenTwoPointer, LayerTwoPointer, Auto]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
@pytest.mark.parametrize("batch", [False, True], ids=["engine", "batch-engine"])
def test_a_cancelled_restore_returns_while_its_read_is_stalled(
    llama_backend, tmp_path, stall, monkeypatch, policy, batch
):
    """Cancelled while a read stalls, a restore returns with the read still blocked; the engine serves
    the next restore, and once the read ends what it brought is dropped: the buffer the cancelled restore
    left is never written again."""
    b = llama_backend
    tokens = random_tokens(N_TOKENS, b.spec.vocab_size, seed=60)
    reference = b.prefill_chunk(tokens, None, 0).data
    out = nan_buffer(b.spec)
    snapshot: list[torch.Tensor] = []  # the buffer as the cancelled restore left it
    discarded: list[object] = []  # reads that ended after they were abandoned
    discard = Fetched.discard

    def counted(self):
        discarded.append(self)
        discard(self)

    monkeypatch.setattr(Fetched, "discard", counted)

    async def run(engine):
        store = LocalStore(str(tmp_path / "kv"))
        await Restorer(b, store, chunk_size=CHUNK).save(tokens)
        r = Restorer(b, store, chunk_size=CHUNK, engine=engine)
        returned: list[int] = []
        scope = anyio.CancelScope()

        async def restore() -> None:
            with scope:
                await r.restore(tokens, policy(), out=out)
            returned.append(stall.blocked)
            snapshot.append(out.data.clone())

        stall.on = True
        async with anyio.create_task_group() as tg:
            tg.start_soon(restore)
            await wait_until(lambda: stall.blocked >= 1 or returned)
            assert stall.blocked >= 1, "the restore read nothing"
            scope.cancel()
            await wait_until(lambda: returned)
        assert returned[0] >= 1  # it returned with its reads still stalled
        stall.on = False  # the store answers again; the stalled reads still block
        after = await r.restore(tokens, LoadOnly())
        torch.testing.assert_close(after.kv.data, reference, atol=ATOL, rtol=0)
        stall.release.set()  # the abandoned reads end: each chunk read is discarded, never placed
        fetches = 0 if policy is LayerTwoPointer else returned[0]  # layer reads return bytes, dropped
        await wait_until(lambda: stall.blocked == 0 and len(discarded) >= fetches)

    async def main():
        if batch:
            async with BatchEngine(load_lanes=LANES) as engine:
                await run(engine)
        else:
            await run(Engine(load_lanes=LANES))

    anyio.run(main)
    torch.testing.assert_close(out.data, snapshot[0], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("policy", [LoadOnly, TokenTwoPointer, LayerTwoPointer], ids=lambda p: p.__name__)
@pytest.mark.parametrize("batch", [False, True], ids=["engine", "batch-engine"])
def test_a_read_past_its_deadline_is_abandoned_and_its_chunk_computed(
    llama_backend, tmp_path, stall, policy, batch
):
    """Every read stalls for good: each load times out, the store counts as down (the loads after the
    first deadline are not started), and the restore ends, exact, with the reads still blocked. (The
    two-pointers may compute everything before a read times out: they are checked for exactness.)"""
    b = llama_backend
    tokens = random_tokens(N_TOKENS, b.spec.vocab_size, seed=61)
    reference = b.prefill_chunk(tokens, None, 0).data
    down_for: list[float] = []  # how long the store then counts as down

    async def run(engine):
        store = LocalStore(str(tmp_path / "kv"))
        await Restorer(b, store, chunk_size=CHUNK).save(tokens)
        r = Restorer(b, store, chunk_size=CHUNK, engine=engine, load_timeout_s=0.05)
        stall.on = True
        result = await r.restore(tokens, policy())
        down_for[:] = [r.bounded_store.down_for]
        return result, stall.blocked, stall.began

    async def main():
        if batch:
            async with BatchEngine(load_lanes=LANES) as engine:
                return await run(engine)
        return await run(Engine(load_lanes=LANES))

    result, blocked, began = anyio.run(main)
    assert blocked == began  # it ended with every read it began still stalled: it abandoned them
    torch.testing.assert_close(result.kv.data, reference, atol=ATOL, rtol=0)
    assert result.stats.loaded_chunks == 0
    if policy is LoadOnly:  # every chunk waits on a load: each failed, one read per lane began, no more
        assert result.stats.failed_loads == result.stats.n_chunks and 1 <= began <= LANES
        assert 0 < down_for[0] <= BACKOFF_S  # the reads that timed out together are one outage


def test_a_loads_deadline_is_enforced_once_by_the_store_or_by_the_engine(llama_backend, tmp_path):
    """A store whose reads block (a local directory) has each load timed by the engine, which abandons
    the read; any other store is timed by its `DeadlineStore`, read by read, and the engine sets no
    deadline of its own. Either way a read that never ends costs its chunk, computed instead."""

    class Hanging(WrapperStore):
        """Reads through its async methods (no blocking reads), which never answer."""

        async def get(self, key):
            await anyio.sleep_forever()

        async def read_into(self, key, buffer):
            await anyio.sleep_forever()

    b = llama_backend
    tokens = random_tokens(N_TOKENS, b.spec.vocab_size, seed=62)
    reference = b.prefill_chunk(tokens, None, 0).data
    local = LocalStore(str(tmp_path / "kv"))

    async def main():
        await Restorer(b, local, chunk_size=CHUNK).save(tokens)
        blocking = Restorer(b, local, chunk_size=CHUNK, load_timeout_s=0.05)
        hanging = Restorer(b, Hanging(local), chunk_size=CHUNK, load_timeout_s=0.05)
        bounds = [r._parts.engine_load_timeout_s() for r in (blocking, hanging)]
        blocking.load_timeout_s = 0.5  # read at each restore, from its one owner
        bounds.append(blocking._parts.engine_load_timeout_s())
        result = await hanging.restore(tokens, LoadOnly())
        return bounds, result, hanging.bounded_store.timeouts, hanging.bounded_store.down_for

    bounds, result, timeouts, down_for = anyio.run(main)
    assert bounds == [0.05, None, 0.5]
    assert result.stats.loaded_chunks == 0 and result.stats.failed_loads == result.stats.n_chunks
    assert 1 <= timeouts <= 4  # the store's deadline: one read per load lane, the loads after refused
    assert 0 < down_for <= BACKOFF_S  # the reads that timed out together are one outage
    torch.testing.assert_close(result.kv.data, reference, atol=ATOL, rtol=0)
