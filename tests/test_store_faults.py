"""Store faults, each produced for real: racing writers, a killed writer, damaged objects, the S3 server
stopped mid-restore, two models in one bucket, path-traversal keys. None may yield a wrong KV cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from functools import partial

import anyio
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import LoadOnly, Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import StoreError
from kvrestore.core.keys import chunk_keys
from kvrestore.stores import FsspecStore, LocalStore, MemoryStore, PrefetchStore, TieredStore
from kvrestore.stores.files import TMP_PREFIX

from .conftest import random_tokens, tiny_model
from .s3_server import CREDENTIALS, MotoServer, free_port
from .test_stores import BAD_KEYS, K1

pytest.importorskip("s3fs")  # the kvrestore[s3] extra
boto3 = pytest.importorskip("boto3")  # comes with moto[server], which these tests need anyway
ATOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def s3_keys(server: MotoServer, bucket: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def make_store(kind: str, tmp_path, server: MotoServer, bucket: str):
    s3 = open_store(f"s3://{bucket}/kv", **server.options())
    if kind == "s3":
        return s3
    return TieredStore([MemoryStore(), open_store(str(tmp_path / "disk"), capacity_bytes=1 << 30), s3])


# -- two writers of one key ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["s3", "tiered"])
def test_racing_writers_of_one_key_never_show_a_partial_object(kind, tmp_path, s3_server, s3_bucket):
    payloads = [bytes([i]) * (200_000 + i) for i in range(6)]
    store = make_store(kind, tmp_path, s3_server, s3_bucket)

    async def body():
        seen: list[bytes | None] = []
        done = anyio.Event()

        async def writer(p: bytes) -> None:
            for _ in range(2):
                await store.put(K1, p)

        async def reader(target) -> None:  # the store, and each tier of a tiered one directly
            n = 0
            while not done.is_set() or n < 5:
                seen.append(await target.get(K1))
                seen.append(await target.get_range(K1, 0, 300_000))
                n += 1
                await anyio.sleep(0)  # a memory tier answers without yielding

        async with anyio.create_task_group() as readers:
            for target in [store, *getattr(store, "tiers", [])]:
                readers.start_soon(reader, target)
            async with anyio.create_task_group() as writers:
                for p in payloads:
                    writers.start_soon(writer, p)
            await store.flush()  # write-back: the lower tiers are written while they are read
            done.set()
        final = [await t.get(K1) for t in getattr(store, "tiers", [store])]
        await store.close()
        return seen, final

    seen, final = run(body)
    assert len(seen) >= 10
    assert all(got is None or got in payloads for got in seen)
    assert all(got in payloads for got in final)  # every tier holds one whole payload
    assert not list(tmp_path.rglob(f"{TMP_PREFIX}*"))


# -- a writer killed mid-write ---------------------------------------------------------------------

KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import anyio
    from kvrestore.stores import FsspecStore

    store = FsspecStore(sys.argv[1])
    os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # die between write and rename
    anyio.run(store.put, sys.argv[2], b"half-written chunk" * 50_000)
    """
)


def test_killed_writer_leaves_a_temp_file_that_is_ignored_and_cleaned(tmp_path):
    root = tmp_path / "kv"
    live = open_store(str(root), capacity_bytes=1 << 20)  # a process that was running all along
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(root), K1],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftovers = list(root.rglob(f"{TMP_PREFIX}*"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 900_000

    async def look(store):
        return await store.contains([K1]), await store.get(K1), [o.key for o in await store.scan()]

    assert run(look, live) == ([False], None, [])  # ignored by a store already open
    reopened = open_store(str(root), capacity_bytes=1 << 20)  # cleaned when a store opens (dead pid)
    assert not list(root.rglob(f"{TMP_PREFIX}*"))
    assert run(look, reopened) == ([False], None, []) and reopened.bytes_used == 0


# -- damaged objects --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["s3", "tiered"])
@pytest.mark.parametrize("fault", ["truncate", "corrupt", "empty"])
def test_damaged_object_is_a_counted_miss_and_deleted(
    llama_backend, tmp_path, s3_server, s3_bucket, kind, fault
):
    b = llama_backend
    tokens = random_tokens(96, b.spec.vocab_size, seed=21)
    keys = [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)]
    s3 = open_store(f"s3://{s3_bucket}/kv", **s3_server.options())

    async def main():
        async with Restorer(b, open_store(f"s3://{s3_bucket}/kv", **s3_server.options()), chunk_size=32) as w:
            await w.save(tokens)
        blob = await s3.get(keys[1])
        if fault == "truncate":
            blob = blob[: len(blob) // 2]
        elif fault == "corrupt":
            bad = bytearray(blob)
            bad[len(bad) - 10] ^= 0xFF
            blob = bytes(bad)
        else:
            blob = b""
        await s3.put(keys[1], blob)  # damaged in S3 only; the upper tiers of a tiered store are cold
        store = make_store(kind, tmp_path, s3_server, s3_bucket)
        async with Restorer(b, store, chunk_size=32) as r:
            res = await r.restore(tokens, LoadOnly())
            await store.flush()
            tiers = getattr(store, "tiers", [store])
            still = [(await t.contains([keys[1]]))[0] for t in tiers]
            others = [(await t.contains([keys[0]]))[0] for t in tiers]
        await s3.close()
        return res, still, others

    res, still, others = run(main)
    assert res.stats.failed_loads == 1 and res.stats.loaded_chunks == 2 and res.stats.computed_chunks == 1
    assert res.stats.errors and "chunk 1" in res.stats.errors[0]
    assert still == [False] * len(still)  # deleted from S3 and never promoted into a tier above
    assert all(others)  # the good chunks were promoted
    torch.testing.assert_close(res.kv.data, b.prefill_chunk(tokens, None, 0).data, atol=ATOL, rtol=0)


# -- the S3 server stops mid-restore ----------------------------------------------------------------


def test_s3_server_stopped_mid_restore_finishes_by_recomputing(llama_backend):
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=22)
    ref = b.prefill_chunk(tokens, None, 0).data
    with MotoServer() as server:  # a private server: this test stops it
        bucket = server.make_bucket()
        url = f"s3://{bucket}/kv"

        async def main():
            async with Restorer(b, open_store(url, **server.options()), chunk_size=32) as w:
                await w.save(tokens)
            store = open_store(url, **server.options())
            r = Restorer(b, store, chunk_size=32, load_lanes=1, load_timeout_s=10)

            def stop_after_first_load(event):
                if event.kind == "load" and server.proc is not None:
                    server.stop()

            # no wall-clock bound: every load is bounded by `load_timeout_s`, and how long the client's
            # retries against a stopped server take depends on the machine, not on kvrestore
            res = await r.restore(tokens, LoadOnly(), on_event=stop_after_first_load)
            down = await r.restore(tokens, LoadOnly())  # server already down at lookup
            await r.close()
            return res, down, store.outage

        res, down, outage = run(main)
    assert outage.outages == 1 and outage.failures >= 2  # one outage, every failed call counted

    assert res.stats.loaded_chunks >= 1 and res.stats.failed_loads >= 1
    assert res.stats.loaded_chunks + res.stats.computed_chunks == 8
    assert any("StoreError" in e for e in res.stats.errors)
    assert down.stats.computed_chunks == 8 and down.stats.errors[0].startswith("lookup: StoreError")
    for r in (res, down):
        torch.testing.assert_close(r.kv.data, ref, atol=ATOL, rtol=0)


def test_unreachable_s3_is_a_store_error_whatever_its_port_number():
    """A connection error names the endpoint, port included; a port such as 41619 holds the digits of
    HTTP 416 (the answer for a range of an empty object), which must not make the chunk look empty."""
    port = free_port(containing="416")  # nothing listens there
    store = open_store(
        "s3://bucket/kv",
        **CREDENTIALS,
        endpoint_url=f"http://127.0.0.1:{port}",
        config_kwargs={"s3": {"addressing_style": "path"}, "retries": {"max_attempts": 1}},
    )

    async def body():
        try:
            with pytest.raises(StoreError, match=str(port)):
                await store.read_into(K1, memoryview(bytearray(64)))
        finally:
            await store.close()

    run(body)


def test_tiered_store_keeps_serving_its_upper_tiers_when_s3_is_gone(llama_backend, tmp_path):
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=23)
    keys = [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)]
    with MotoServer() as server:
        bucket = server.make_bucket()
        memory, disk = MemoryStore(), open_store(str(tmp_path / "disk"), capacity_bytes=1 << 30)
        store = TieredStore([memory, disk, open_store(f"s3://{bucket}/kv", **server.options())])

        async def save():
            async with Restorer(b, store, chunk_size=32) as w:  # close() flushes the write-back
                await w.save(tokens)
            for k in keys[2:]:  # the upper tiers keep only the first two chunks
                await memory.delete(k)
                await disk.delete(k)

        run(save)
        server.stop()

        async def restore():
            async with Restorer(b, store, chunk_size=32) as r:
                return await r.restore(tokens, LoadOnly())

        res = run(restore)
    assert res.stats.loaded_chunks == 2 and res.stats.computed_chunks == 2
    assert store.stats[2].errors >= 1  # the dead tier was asked and counted
    torch.testing.assert_close(res.kv.data, b.prefill_chunk(tokens, None, 0).data, atol=ATOL, rtol=0)


# -- two models, one bucket -------------------------------------------------------------------------


def test_two_models_sharing_a_bucket_never_use_each_others_chunks(s3_server, s3_bucket):
    a = HFBackend(tiny_model("llama", seed=0), name="model-a")
    b = HFBackend(tiny_model("llama", seed=9), name="model-b")
    assert a.spec.fingerprint != b.spec.fingerprint
    tokens = random_tokens(64, a.spec.vocab_size, seed=24)
    url = f"s3://{s3_bucket}/shared"

    async def main():
        ra = Restorer(a, open_store(url, **s3_server.options()), chunk_size=32)
        rb = Restorer(b, open_store(url, **s3_server.options()), chunk_size=32)
        await ra.save(tokens)
        assert await rb.lookup(tokens) == 0  # same tokens, other model: other keys
        await rb.save(tokens)
        # force a cross-use: model A's chunk 0 stored under model B's key
        ka, kb = (chunk_keys(tokens, m.spec.fingerprint, 32)[0].key for m in (a, b))
        await rb.store.put(kb, await ra.store.get(ka))
        res_a = await ra.restore(tokens, LoadOnly())
        res_b = await rb.restore(tokens, LoadOnly())
        await ra.close()
        await rb.close()
        return res_a, res_b

    res_a, res_b = run(main)
    assert len(s3_keys(s3_server, s3_bucket)) == 3  # 2 chunks of A + 1 left of B (its foreign one deleted)
    assert res_a.stats.loaded_chunks == 2 and res_a.stats.failed_loads == 0
    assert res_b.stats.failed_loads == 1 and "ForeignChunkError" in res_b.stats.errors[0]
    torch.testing.assert_close(res_a.kv.data, a.prefill_chunk(tokens, None, 0).data, atol=ATOL, rtol=0)
    torch.testing.assert_close(res_b.kv.data, b.prefill_chunk(tokens, None, 0).data, atol=ATOL, rtol=0)


# -- path traversal -----------------------------------------------------------------------------------

TRAVERSALS = [
    *BAD_KEYS,
    "../../" + "a" * 20,
    "a" * 20 + "/../../x",
    "/etc/passwd",
    "..",
    "a" * 20 + "\x00",
    "%2e%2e%2f" + "a" * 20,
    "a" * 20 + "\\..\\x",
]


@pytest.mark.parametrize("bad", TRAVERSALS)
def test_traversal_keys_are_refused_by_every_store(tmp_path, s3_server, s3_bucket, bad):
    root = tmp_path / "kv"
    stores = [
        FsspecStore(str(root)),
        open_store(str(root), capacity_bytes=1000),
        open_store(f"s3://{s3_bucket}/p", **s3_server.options()),
        TieredStore([MemoryStore(), FsspecStore(str(root))]),
        PrefetchStore(FsspecStore(str(root))),
    ]

    async def body():
        for store in stores:
            for call in (store.get(bad), store.put(bad, b"x"), store.contains([bad]), store.delete(bad)):
                with pytest.raises(ValueError, match="invalid store key"):
                    await call
            await store.close()

    run(body)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []
    assert s3_keys(s3_server, s3_bucket) == []


@settings(max_examples=300, deadline=None)
@given(key=st.text(max_size=80))
def test_every_accepted_key_maps_inside_the_root(tmp_path_factory, key):
    root = str(tmp_path_factory.getbasetemp() / "kv-root")
    local = LocalStore.__new__(LocalStore)
    local.root = root
    remote = FsspecStore.from_filesystem(MemoryFileSystem(), "bucket/prefix")
    try:
        paths = local.path(key), remote.path(key)
    except ValueError:
        return  # refused: nothing to check
    assert os.path.realpath(paths[0]).startswith(root + os.sep)
    assert paths[1] == f"bucket/prefix/{key[:2]}/{key}.kvc" and ".." not in paths[1]


# -- choosing a store for CacheBlend while one is down ------------------------------------------------


def test_choose_blend_store_leaves_out_a_store_that_is_down():
    from kvrestore.blend import StoreCandidate, choose_blend_store
    from kvrestore.core.errors import StoreError
    from kvrestore.costs.compute import LayerCost

    b = HFBackend(tiny_model("llama", layers=2), name="tiny")
    with MotoServer() as server:
        s3 = open_store(f"s3://{server.make_bucket()}/kv", **server.options())
        server.stop()
        memory = StoreCandidate("memory", MemoryStore(), 5.0)
        down = StoreCandidate("s3", s3, 0.02)  # cheapest, but its server is gone

        async def choose(candidates):
            return await choose_blend_store(b, candidates, n_tokens=256, layer_cost=LayerCost(10.0, 0.0, 0.0))

        placement = run(choose, [down, memory])
        assert placement.candidate.name == "memory"
        assert [o.name for o in placement.options] == ["memory"]
        assert "StoreError" in placement.unreachable["s3"]
        assert "s3: left out" in placement.explain()
        with pytest.raises(StoreError, match="none of the candidate stores"):
            run(choose, [down])
        run(s3.close)


def test_faults_and_fallbacks_are_logged(llama_backend, caplog):
    """A damaged chunk (deleted, computed instead) and a store that is down (everything computed) each
    leave a warning on the `kvrestore` logger."""
    import logging

    from kvrestore.core.errors import StoreError

    b = llama_backend
    tokens = random_tokens(96, b.spec.vocab_size, seed=5)
    keys = [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)]

    class DownStore(MemoryStore):
        async def contains(self, keys):
            raise StoreError("connection refused")

    async def main():
        store = MemoryStore()
        r = Restorer(b, store, chunk_size=32, learn=False)
        await r.save(tokens)
        await store.put(keys[1], (await store.get(keys[1]))[:-3])
        damaged = await r.restore(tokens, LoadOnly())
        down = await Restorer(b, DownStore(), chunk_size=32, learn=False).restore(tokens)
        return damaged, down

    with caplog.at_level(logging.WARNING, logger="kvrestore"):
        damaged, down = run(main)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("kvrestore"))
    assert damaged.stats.failed_loads == 1 and f"chunk {keys[1]} is damaged" in text
    assert "1 of 3 stored chunks" in text
    assert down.stats.computed_chunks == 3 and "store lookup failed" in text and "connection refused" in text
