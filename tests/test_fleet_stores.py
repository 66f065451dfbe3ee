"""The stores a fleet shares, Redis and Mooncake's, against real servers on 127.0.0.1: the store contract,
batch and range reads, exact restores, namespaces, signed chunks, read-only mode, damaged objects, typed
errors, and two restorers (two servers of a fleet) sharing one cache."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import anyio
import pytest
import torch

from kvrestore import LoadOnly, Restorer, open_store
from kvrestore.core.errors import InvalidInputError, KVRestoreError, SaveError, StoreError
from kvrestore.core.keys import chunk_keys
from kvrestore.stores import ChunkStore, known_schemes

from .conftest import random_tokens
from .test_stores import K1, K2, K3
from .test_stores import test_contract as check_contract

ATOL = 1e-5
SECRET = b"s" * 32


def run(fn, *args):
    return anyio.run(partial(fn, *args))


#: Mooncake's calls take seconds per test here (a client set up and torn down each time): the slow tier
@pytest.fixture(params=["redis", pytest.param("mooncake", marks=pytest.mark.slow)])
def fleet(request) -> Callable[..., ChunkStore]:
    """`fleet(**options)`: a new store on the test's own prefix of a real Redis or Mooncake server."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        return lambda **o: open_store(url, **o)
    server = request.getfixturevalue("mooncake_server")
    url = request.getfixturevalue("mooncake_url")
    return lambda **o: open_store(url, **server.options(**o))


def test_the_schemes_are_registered():
    for scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster", "mooncake"):
        assert scheme in known_schemes()


def test_contract(fleet):
    check_contract(fleet())


def test_batch_and_range_reads(fleet):
    data = bytes(range(256)) * 40

    async def body():
        async with fleet() as s:
            await s.put(K1, data)
            await s.put(K2, b"two")
            buf = bytearray(1000)
            small = await s.read_into(K1, memoryview(buf))  # the object is larger than the buffer
            prefix = bytes(buf)
            big = bytearray(20_000)
            whole = await s.read_into(K1, memoryview(big))
            return (
                await s.contains([K1, K3, K2]),
                await s.get_many([K2, K3, K1]),
                await s.get_ranges(K1, [(0, 10), (5000, 6000), (10_000, 20_000), (7, 7)]),
                await s.get_range(K3, 0, 4),
                await s.read_into(K3, memoryview(buf)),
                small,
                prefix,
                whole,
                bytes(big[: len(data)]),
            )

    present, many, ranges, missing_range, missing_read, small, prefix, whole, copied = run(body)
    assert present == [True, False, True]
    assert many == [b"two", None, data]
    assert ranges == [data[:10], data[5000:6000], data[10_000:], b""]
    assert missing_range is None and missing_read is None
    assert small == len(data) and prefix == data[:1000]  # its true size, and what fits
    assert whole == len(data) and copied == data


def test_restore_equals_full_prefill_and_a_second_server_shares_it(llama_backend, fleet):
    """One restorer saves; another, over a store opened anew (another server of the fleet), loads
    every chunk and gets the KV a full prefill computes."""
    b = llama_backend
    tokens = random_tokens(100, b.spec.vocab_size, seed=5)
    ref = b.prefill_chunk(tokens, None, 0).data

    async def main():
        async with Restorer(b, fleet(), chunk_size=32) as writer:
            assert (await writer.save(tokens)).written_chunks == 4
        async with Restorer(b, fleet(), chunk_size=32) as reader:
            assert await reader.lookup(tokens) == 100
            return await reader.restore(tokens, LoadOnly())

    res = run(main)
    assert res.stats.loaded_chunks == 4 and res.stats.computed_chunks == 0 and not res.stats.errors
    torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_namespaces_and_signed_chunks(llama_backend, fleet):
    """Another namespace finds nothing; a reader under a secret never uses unsigned chunks (they stay:
    they may be another secret's), and loads the chunks signed under its own."""
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=6)
    ref = b.prefill_chunk(tokens, None, 0).data

    async def main():
        store = fleet()
        plain = Restorer(b, store, chunk_size=32, namespace="tenant-a")
        await plain.save(tokens)
        other = Restorer(b, store, chunk_size=32, namespace="tenant-b")
        assert await other.lookup(tokens) == 0
        guarded = Restorer(b, store, chunk_size=32, namespace="tenant-a", secret=SECRET)
        unsigned = await guarded.restore(tokens, LoadOnly())
        keys = [r.key for r in guarded.chunks(tokens)[1]]
        still = await store.contains(keys)
        signer = Restorer(b, store, chunk_size=32, namespace="tenant-s", secret=SECRET)
        await signer.save(tokens)
        signed = await signer.restore(tokens, LoadOnly())
        for r in (plain, other, guarded, signer):
            await r.close()
        return unsigned, still, signed

    unsigned, still, signed = run(main)
    assert unsigned.stats.loaded_chunks == 0 and all(still)
    assert signed.stats.loaded_chunks == 2
    for res in (unsigned, signed):
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


def test_read_only_reads_and_never_writes(llama_backend, fleet):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=7)

    async def main():
        async with Restorer(b, fleet(), chunk_size=32) as writer:
            await writer.save(tokens[:32])
        ro = fleet(read_only=True)
        with pytest.raises(StoreError, match="read-only"):
            await ro.put(K1, b"x")
        with pytest.raises(StoreError, match="read-only"):
            await ro.delete(K1)
        async with Restorer(b, ro, chunk_size=32) as reader:
            res = await reader.restore(tokens, LoadOnly())
            with pytest.raises(SaveError, match="read-only") as refused:
                await reader.save(tokens)
        return res, refused.value, await fleet().contains([K1])

    res, refused, k1 = run(main)
    assert res.stats.loaded_chunks == 1 and res.stats.computed_chunks == 1
    assert refused.written == () and len(refused.failed) == 1 and k1 == [False]


@pytest.mark.parametrize("fault", ["truncate", "corrupt"])
def test_a_damaged_chunk_is_a_counted_miss_and_deleted(llama_backend, fleet, fault):
    b = llama_backend
    tokens = random_tokens(96, b.spec.vocab_size, seed=8)
    keys = [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)]

    async def main():
        store = fleet()
        async with Restorer(b, store, chunk_size=32) as w:
            await w.save(tokens)
        blob = await store.get(keys[1])
        if fault == "truncate":
            blob = blob[: len(blob) // 2]
        else:
            bad = bytearray(blob)
            bad[len(bad) - 10] ^= 0xFF
            blob = bytes(bad)
        await store.put(keys[1], blob)
        async with Restorer(b, fleet(), chunk_size=32) as r:
            res = await r.restore(tokens, LoadOnly())
        return res, await store.contains(keys)

    res, present = run(main)
    assert res.stats.failed_loads == 1 and res.stats.loaded_chunks == 2 and res.stats.computed_chunks == 1
    assert present == [True, False, True]  # the damaged one deleted (the next save writes it again)
    torch.testing.assert_close(res.kv.data, b.prefill_chunk(tokens, None, 0).data, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "url",
    [
        "redis://",
        "redis://127.0.0.1:notaport",
        "redis://127.0.0.1:6379?db=1",
        "redis://:6379/0",
        "mooncake://",
        "mooncake://127.0.0.1:50051?protocol=tcp",
    ],
)
def test_bad_urls_are_typed_errors(url):
    with pytest.raises(InvalidInputError):
        open_store(url)


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("redis://127.0.0.1:6379", {"colour": "blue"}, "colour"),
        ("redis://127.0.0.1:6379", {"max_connections": 0}, "max_connections"),
        ("redis://127.0.0.1:6379", {"eviction": "lru"}, "capacity"),
        ("redis+cluster://127.0.0.1:7000", {"db": 1}, "one database"),
        ("redis://127.0.0.1:6379", {"ssl_ca_certs": "/ca.pem"}, "rediss://"),
        ("mooncake://127.0.0.1", {"capacity_bytes": 1 << 30}, "storage nodes"),
        ("mooncake://127.0.0.1", {"protocol": "udp"}, "protocol"),
        ("mooncake://127.0.0.1", {"local_buffer_size": 0}, "local_buffer_size"),
        ("mooncake://127.0.0.1", {"colour": "blue"}, "colour"),
    ],
)
def test_bad_options_are_refused_naming_them(url, options, match):
    with pytest.raises((InvalidInputError, TypeError), match=match):
        open_store(url, **options)


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_an_unreachable_server_is_a_store_error_and_fails_fast_after(kind):
    """Nothing listens: the first call is a StoreError (a KVRestoreError), and the next fail at once
    (no connection attempt) until the cool-off ends; each failure counted."""
    from .s3_server import free_port

    port = free_port()
    pytest.importorskip(kind)
    if kind == "redis":
        store = open_store(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=2)
    else:
        store = open_store(
            f"mooncake://127.0.0.1:{port}",
            metadata_server=f"http://127.0.0.1:{free_port()}/metadata",
            local_hostname="127.0.0.1",
        )

    async def body():
        with pytest.raises(StoreError) as first:
            await store.contains([K1])
        with pytest.raises(StoreError, match="unreachable"):
            await store.get(K1)
        await store.close()
        return first.value

    err = run(body)
    assert isinstance(err, KVRestoreError)
    assert store.outage.failures == 2 and store.outage.outages == 1
