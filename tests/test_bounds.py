"""Bounded in time and memory, whatever the store or the files on disk do (issue 32).

Stores that misbehave are real: an S3 client (s3fs) against a socket on 127.0.0.1 that accepts and never
answers, and against a proxy in front of a real moto server that holds each answer back. The time
bounds asserted are generous multiples of the deadlines given (never of how fast this machine is): they
catch a call that waits on the client's own timeouts and retries (minutes), nothing finer.
"""

from __future__ import annotations

import time
from functools import partial

import anyio
import pytest
import torch

from kvrestore import LoadOnly, Restorer, open_store
from kvrestore.core.errors import StoreError, StoreTimeoutError
from kvrestore.stores import MemoryStore
from kvrestore.stores.deadline import Deadlines, DeadlineStore

from .conftest import random_tokens
from .hostile_servers import BlackHole, SlowProxy

pytest.importorskip("s3fs")
ATOL = 1e-5
DEADLINE = 0.5
#: what "returns within the deadline" is checked against: ten deadlines, far below the client's own
#: read timeout (20 s) times its retries, which is what a call without a deadline waits
BOUND = 10 * DEADLINE


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def s3_options(endpoint: str) -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


def timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the caller checks which
        return exc, time.monotonic() - t0


def deadline_restorer(b, store, **kw):
    kw = {"lookup_timeout_s": DEADLINE, "load_timeout_s": DEADLINE, "save_timeout_s": DEADLINE, **kw}
    return Restorer(b, store, chunk_size=32, learn=False, **kw)


# -- (1) deadlines: a black hole and a slow server ---------------------------------------------------


def test_black_hole_s3_lookup_restore_and_save_return_within_their_deadlines(llama_backend):
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=1)
    ref = b.prefill_chunk(tokens, None, 0).data
    with BlackHole() as hole:

        def fresh() -> Restorer:  # each call on a restorer that has not seen the store time out yet
            return deadline_restorer(b, open_store("s3://kv/p", **s3_options(hole.endpoint)))

        async def lookup():
            async with fresh() as r:
                return await r.lookup(tokens)

        async def restore():
            async with fresh() as r:
                return await r.restore(tokens)

        async def save():
            async with fresh() as r:
                return await r.save(tokens)

        looked, lookup_s = timed(lambda: run(lookup))
        restored, restore_s = timed(lambda: run(restore))
        saved, save_s = timed(lambda: run(save))
        assert hole.accepted >= 3  # each call did reach the server, which never answered

    assert isinstance(looked, StoreTimeoutError) and lookup_s < BOUND
    assert isinstance(saved, StoreTimeoutError) and save_s < BOUND
    assert restore_s < BOUND + 30  # the deadline, then the tiny model computes all 256 tokens
    assert restored.stats.computed_chunks == 8 and restored.stats.loaded_chunks == 0
    assert restored.stats.errors[0].startswith("lookup: StoreTimeoutError")
    assert restored.stats.seconds >= DEADLINE  # the lookup it waited on is part of the restore's time
    torch.testing.assert_close(restored.kv.data, ref, atol=ATOL, rtol=0)


def test_a_store_that_timed_out_is_not_asked_again_until_its_back_off_ends(llama_backend):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=2)
    with BlackHole() as hole:

        async def main():
            async with deadline_restorer(b, open_store("s3://kv/p", **s3_options(hole.endpoint))) as r:
                with pytest.raises(StoreTimeoutError):
                    await r.lookup(tokens)
                asked = hole.requests
                res = await r.restore(tokens)  # within the back-off: not asked, computed at once
                with pytest.raises(StoreTimeoutError, match="not asked again"):
                    await r.save(tokens)
                return asked, hole.requests, res, r.bounded_store.down_for

        asked, after, res, down_for = run(main)
    assert asked >= 1 and after == asked  # no request reached the server during the back-off
    assert res.stats.computed_chunks == 2 and "not asked again" in res.stats.errors[0]
    assert down_for > 0


def test_back_off_doubles_while_the_store_keeps_timing_out_and_resets_once_it_answers():
    class Hanging(MemoryStore):
        hang = True

        async def contains(self, keys):
            if self.hang:
                await anyio.sleep(60)
            return await super().contains(keys)

    inner = Hanging()
    store = DeadlineStore(inner, Deadlines(lookup_s=0.05, backoff_s=0.1, max_backoff_s=0.25))

    async def main():
        backoffs = []
        for _ in range(3):
            with pytest.raises(StoreTimeoutError):
                await store.contains(["ab" * 8])
            backoffs.append(store._backoff)
            await anyio.sleep(store.down_for + 0.01)
        inner.hang = False
        assert await store.contains(["ab" * 8]) == [False]
        return backoffs, store._backoff

    backoffs, after = run(main)
    assert backoffs == [0.1, 0.2, 0.25] and after == 0.0


@pytest.mark.slow
def test_slow_s3_within_the_deadline_loads_and_past_it_recomputes(llama_backend, s3_server, s3_bucket):
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=3)
    ref = b.prefill_chunk(tokens, None, 0).data
    url = f"s3://{s3_bucket}/slow"

    async def save():
        async with Restorer(b, open_store(url, **s3_server.options()), chunk_size=32, learn=False) as w:
            await w.save(tokens)

    run(save)
    with SlowProxy(s3_server.port, delay_s=0.2) as slow:

        async def restore(lookup_s):
            store = open_store(url, **s3_options(slow.endpoint))
            async with deadline_restorer(b, store, lookup_timeout_s=lookup_s, load_timeout_s=10) as r:
                return await r.restore(tokens, LoadOnly())

        patient = run(restore, 10.0)  # every answer 0.2 s late, well within 10 s: loaded
        hasty, hasty_s = timed(lambda: run(restore, 0.05))  # a lookup cannot answer in 0.05 s: computed

    assert patient.stats.loaded_chunks == 4 and patient.stats.failed_loads == 0
    assert hasty.stats.computed_chunks == 4 and hasty.stats.errors[0].startswith("lookup: StoreTimeoutError")
    assert hasty_s < BOUND + 30
    for res in (patient, hasty):
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_deadlines_are_checked():
    from kvrestore.core.errors import InvalidInputError

    for bad in (0, -1, float("nan"), "2"):
        with pytest.raises(InvalidInputError, match="lookup_timeout_s"):
            Deadlines(lookup_s=bad)
    assert issubclass(StoreTimeoutError, StoreError) and issubclass(StoreTimeoutError, TimeoutError)
