"""open_store("s3://...") against a real S3-compatible server (moto_server on 127.0.0.1)."""

from __future__ import annotations

import time
from functools import partial

import anyio
import anyio.from_thread
import pytest
import torch

from kvrestore import ComputeOnly, KVCache, LoadOnly, Restorer, SyncRestorer, open_store
from kvrestore.stores import BoundedStore, FsspecStore, PrefetchStore, TieredStore

from .conftest import random_tokens
from .test_stores import K1, K2, K3, evict_under_capacity
from .test_stores import test_contract as check_contract

pytest.importorskip("s3fs")  # the kvrestore[s3] extra
boto3 = pytest.importorskip("boto3")  # comes with moto[server], which these tests need anyway
ATOL = 1e-5


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def object_names(server, bucket: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def test_s3_contract(s3_bucket, s3_options):
    store = open_store(f"s3://{s3_bucket}/kv", **s3_options)
    assert isinstance(store, FsspecStore) and store.is_async and not store.local
    check_contract(store)


def test_s3_objects_land_under_prefix(s3_server, s3_bucket, s3_options):
    async def body():
        async with open_store(f"s3://{s3_bucket}/team/model-a", **s3_options) as s:
            await s.put(K1, b"abc")

    run(body)
    assert object_names(s3_server, s3_bucket) == [f"team/model-a/{K1[:2]}/{K1}.kvc"]


@pytest.mark.parametrize("style", ["endpoint_url", "client_kwargs", "env"])
def test_s3_options_the_usual_s3fs_way(s3_server, s3_bucket, monkeypatch, style):
    """endpoint, credentials and addressing style reach botocore however s3fs users pass them."""
    options: dict = {"config_kwargs": {"s3": {"addressing_style": "path"}}}
    if style == "endpoint_url":
        options |= {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
    elif style == "client_kwargs":
        options |= {
            "client_kwargs": {"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"},
            "key": "testing",
            "secret": "testing",
        }
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    store = open_store(f"s3://{s3_bucket}/p", **options)

    async def body():
        async with store:
            await store.put(K1, b"hello")
            return await store.get(K1)

    assert run(body) == b"hello"
    assert object_names(s3_server, s3_bucket) == [f"p/{K1[:2]}/{K1}.kvc"]


def test_s3_store_survives_a_new_event_loop(s3_bucket, s3_options):
    """The s3fs client is bound to its loop: a second anyio.run, or a portal thread, gets a new one."""
    store = open_store(f"s3://{s3_bucket}/loops", **s3_options)

    async def put(data):
        await store.put(K1, data)
        return await store.get(K1)

    assert run(put, b"one") == b"one"
    assert run(put, b"two") == b"two"
    with anyio.from_thread.start_blocking_portal() as portal:
        assert portal.call(put, b"three") == b"three"
        portal.call(store.close)


def test_s3_batch_calls(s3_bucket, s3_options):
    keys = [f"{i:040x}" for i in range(1, 70)]  # more keys than one concurrent batch

    async def body():
        async with open_store(f"s3://{s3_bucket}/batch", **s3_options) as s:
            for k in keys[::2]:
                await s.put(k, k.encode())
            present = await s.contains(keys)
            many = await s.get_many(keys[:6])
            data = bytes(range(256)) * 40
            await s.put(K1, data)
            ranges = await s.get_ranges(K1, [(0, 10), (5000, 6000), (10_000, 20_000), (7, 7)])
            buf = bytearray(1000)
            size = await s.read_into(K1, memoryview(buf))
            await s.put(keys[-1], b"")  # a ranged read of an empty object gets HTTP 416: size 0
            empty = await s.read_into(keys[-1], memoryview(buf))
            return present, many, data, ranges, size, buf, empty

    present, many, data, ranges, size, buf, empty = run(body)
    assert present == [i % 2 == 0 for i in range(len(keys))]
    assert many == [k.encode() if i % 2 == 0 else None for i, k in enumerate(keys[:6])]
    assert ranges == [data[:10], data[5000:6000], data[10_000:], b""]
    assert size == len(buf) + 1 and bytes(buf) == data[:1000]  # one ranged read: "more than fits"
    assert empty == 0


def test_s3_scan_lists_objects_and_skips_foreign_names(s3_server, s3_bucket, s3_options):
    s3_server.client().put_object(Bucket=s3_bucket, Key="scan/readme.txt", Body=b"not a chunk")
    s3_server.client().put_object(Bucket=s3_bucket, Key=f"scan/zz/{K1}.kvc", Body=b"wrong shard")

    async def body():
        async with open_store(f"s3://{s3_bucket}/scan", **s3_options) as s:
            await s.put(K2, b"22")
            await s.put(K3, b"333")
            return await s.scan()

    found = {o.key: o.size for o in run(body)}
    assert found == {K2: 2, K3: 3}


def test_s3_capacity_really_evicts(s3_server, s3_bucket, s3_options):
    store = open_store(f"s3://{s3_bucket}/cap", capacity_bytes=250, **s3_options)
    assert isinstance(store, BoundedStore)

    assert evict_under_capacity(store) == [True, False, True]
    assert object_names(s3_server, s3_bucket) == sorted(f"cap/{k[:2]}/{k}.kvc" for k in (K1, K3))
    assert store.bytes_used == 200 and store.evictions == 1

    # another process opening the same prefix rebuilds its index from a listing and evicts to fit
    smaller = open_store(f"s3://{s3_bucket}/cap", capacity_bytes=150, **s3_options)

    async def reopen():
        async with smaller:
            await smaller.put("d4" * 10, b"4" * 50)
            return await smaller.contains([K1, K3, "d4" * 10])

    assert sum(run(reopen)) == 2 and smaller.bytes_used <= 150


def test_restore_from_s3_equals_full_prefill(llama_backend, s3_bucket, s3_options):
    b = llama_backend
    tokens = random_tokens(100, b.spec.vocab_size, seed=5)
    ref = b.prefill_chunk(tokens, None, 0).data

    async def main():
        async with Restorer(b, open_store(f"s3://{s3_bucket}/m", **s3_options), chunk_size=32) as r:
            assert (await r.save(tokens)).written_chunks == 4
            assert await r.lookup(tokens) == 100
            return await r.restore(tokens, LoadOnly())

    res = run(main)
    assert res.stats.loaded_chunks == 4 and res.stats.failed_loads == 0
    torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_sync_restorer_over_s3(llama_backend, s3_bucket, s3_options):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=6)
    with SyncRestorer(b, open_store(f"s3://{s3_bucket}/sync", **s3_options), chunk_size=32) as r:
        r.save(tokens)
        loaded = r.restore(tokens, LoadOnly())
        computed = r.restore(tokens, ComputeOnly())
    assert loaded.stats.loaded_chunks == 2
    torch.testing.assert_close(loaded.kv.data, computed.kv.data, atol=ATOL, rtol=0)


def test_prefetch_over_s3_reads_ahead(llama_backend, s3_bucket, s3_options):
    """The read-ahead buffer fetches the next chunks of a restore before its lanes ask for them."""
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=7)
    ref = b.prefill_chunk(tokens, None, 0).data
    store = PrefetchStore(open_store(f"s3://{s3_bucket}/pf", **s3_options), depth=4)

    async def main():
        async with Restorer(b, store, chunk_size=16, load_lanes=1) as r:
            await r.save(tokens)
            return await r.restore(tokens, LoadOnly())

    res = run(main)
    assert res.stats.loaded_chunks == 16 and res.stats.failed_loads == 0
    assert store.prefetched >= 12 and store.hits >= 12
    assert store.buffered_bytes == 0  # everything fetched ahead was used
    torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


# -- load: 8 concurrent restores ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight_saved(smollm2, s3_server):
    """8 prompts of 256 tokens, their full-prefill KV, saved once to a bucket (128-token chunks)."""
    b = smollm2
    prompts = [random_tokens(256, b.spec.vocab_size, seed=100 + i) for i in range(8)]
    refs = [b.prefill_chunk(p, None, 0).data for p in prompts]
    url = f"s3://{s3_server.make_bucket()}/load"

    async def save():
        async with Restorer(b, open_store(url, **s3_server.options()), chunk_size=128) as writer:
            for p, ref in zip(prompts, refs, strict=True):
                await writer.save(p, KVCache(b.spec, ref))  # the KV computed above: no compute here

    run(save)
    return prompts, refs, url


@pytest.mark.model
@pytest.mark.parametrize("kind", ["s3", "tiered"])
def test_eight_concurrent_restores(smollm2, eight_saved, s3_options, tmp_path, kind):
    """8 restores at once, each its own prompt: every one exact, no chunk lost; MB/s printed."""
    b = smollm2
    prompts, refs, url = eight_saved

    async def main():
        if kind == "s3":
            store = open_store(url, **s3_options)
        else:  # cold upper tiers: every chunk comes from S3 and is promoted
            store = TieredStore(
                [
                    open_store("memory://", capacity_bytes=64 << 20),
                    open_store(str(tmp_path / "disk"), capacity_bytes=256 << 20),
                    open_store(url, **s3_options),
                ]
            )
        async with Restorer(b, store, chunk_size=128, load_lanes=8) as r:
            out = [None] * 8

            async def one(i):
                out[i] = await r.restore(prompts[i], LoadOnly())

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
            seconds = time.perf_counter() - t0
            if kind == "tiered":
                await store.flush()
                promoted = [s.promoted_in for s in store.stats]
                assert promoted[1] == 16 and promoted[0] > 0  # memory holds what its capacity allows
                assert store.tiers[0].bytes_used <= 64 << 20 and store.tiers[1].bytes_used <= 256 << 20
        return out, seconds

    results, seconds = run(main)
    total = sum(r.stats.bytes_loaded for r in results)
    print(
        f"\n8 concurrent restores from {kind}: {total / 1e6:.1f} MB in {seconds:.2f} s = {total / 1e6 / seconds:.0f} MB/s"
    )
    for res, ref in zip(results, refs, strict=True):
        assert res.stats.loaded_chunks == 2 and res.stats.computed_chunks == 0 and not res.stats.errors
        torch.testing.assert_close(res.kv.data, ref, atol=1e-4, rtol=0)
    assert total >= 8 * 256 * b.spec.kv_bytes_per_token
