"""A fleet's shared store dies mid-restore and comes back: Redis and Mooncake's master, each killed for
real (SIGKILL) while a restore loads from it. The restore returns the exact KV (what it could not load it
computes); once the server is back, the same `Restorer`, never restarted, saves and loads again within
10 s (its store reconnects by itself). The outage is counted (and logged once)."""

from __future__ import annotations

import time
from functools import partial

import anyio
import pytest
import torch

from kvrestore import LoadOnly, Restorer, open_store
from kvrestore.core.errors import SaveError

from .conftest import random_tokens
from .mooncake_server import MooncakeServer
from .redis_server import RedisServer

ATOL = 1e-5
#: what the issue promises: the server back, saves and loads again within this many seconds
BACK_WITHIN_S = 10.0

pytestmark = pytest.mark.slow


async def answers_again(store, seconds: float) -> float:
    """Wait until `store` answers a lookup (the server is back and reached); the seconds it took."""
    t0 = time.monotonic()
    while True:
        try:
            await store.contains(["ab" * 10])
            return time.monotonic() - t0
        except Exception:
            if time.monotonic() - t0 > seconds:
                raise
            await anyio.sleep(0.1)


def kill_mid_restore_and_come_back(backend, store, kill, start_again):
    """Save, restore while `kill` runs after the first chunk lands, restore again while down, bring the
    server back (`start_again`), then save and restore with the same restorer."""
    tokens = random_tokens(256, backend.spec.vocab_size, seed=31)
    ref = backend.prefill_chunk(tokens, None, 0).data

    async def main():
        r = Restorer(backend, store, chunk_size=32, load_lanes=1, learn=False)
        assert (await r.save(tokens)).written_chunks == 8
        killed = []

        def kill_after_first_load(event):
            if event.kind == "load" and not killed:
                killed.append(True)
                kill()

        during = await r.restore(tokens, LoadOnly(), on_event=kill_after_first_load)
        down = await r.restore(tokens, LoadOnly())
        start_again()
        waited = await answers_again(r.bounded_store, BACK_WITHIN_S)
        await anyio.sleep(max(r.bounded_store.down_for, 0.0))  # a deadline's back-off, if any
        saved = await r.save(tokens)  # the server came back empty: everything is written again
        after = await r.restore(tokens, LoadOnly())
        await r.close()
        return during, down, waited, saved, after

    during, down, waited, saved, after = anyio.run(main)
    assert during.stats.loaded_chunks >= 1 and during.stats.failed_loads >= 1
    assert during.stats.loaded_chunks + during.stats.computed_chunks == 8
    assert down.stats.computed_chunks == 8 and down.stats.loaded_chunks == 0
    for res in (during, down, after):
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)
    assert waited <= BACK_WITHIN_S
    assert saved.written_chunks == 8 and after.stats.loaded_chunks == 8 and not after.stats.errors
    # one outage (what is logged, once), every failed call counted
    assert store.outage.outages == 1 and store.outage.failures >= 2 and not store.outage.down


def test_redis_killed_mid_restore_then_back(llama_backend):
    with RedisServer() as server:
        store = open_store(server.url, socket_connect_timeout=2)

        def start_again():
            server.start()  # the same port

        kill_mid_restore_and_come_back(llama_backend, store, server.kill, start_again)


def test_mooncake_master_killed_mid_restore_then_back(llama_backend):
    with MooncakeServer(segment_size="256MB") as server:
        store = open_store(server.url, **server.options())
        kill_mid_restore_and_come_back(llama_backend, store, server.kill_master, server.start_master)


def test_redis_evicts_by_its_own_maxmemory_and_a_restore_recomputes_what_went(llama_backend):
    """A server with a small `maxmemory` and `allkeys-lru`: saving more than fits evicts the oldest
    chunks; the restore loads what is left and computes the rest, exactly."""
    b = llama_backend
    tokens = random_tokens(4096, b.spec.vocab_size, seed=32)
    ref = b.prefill_chunk(tokens, None, 0).data
    with RedisServer(maxmemory_policy="allkeys-lru") as server:
        client = server.client()
        room = 6 * 256 * b.spec.kv_bytes_per_token  # a third of the prompt's chunks, and buffers
        client.config_set("maxmemory", client.info("memory")["used_memory"] + room)

        async def main():
            async with Restorer(b, open_store(server.url), chunk_size=256) as r:
                try:  # concurrent writes near maxmemory may be refused (OOM): reported, never lost silently
                    written = (await r.save(tokens)).written_chunks
                except SaveError as e:
                    assert all("OutOfMemoryError" in str(x) for x in e.failed.values())
                    written = len(e.written)
                present = await r.store.contains([c.key for c in r.chunks(tokens)[1]])
                res = await r.restore(tokens, LoadOnly())
                return written, present, res

        written, present, res = anyio.run(partial(main))
    assert written > 0 and sum(present) < 16  # more than fits was written: some were evicted
    assert res.stats.loaded_chunks + res.stats.computed_chunks == 16
    torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)
