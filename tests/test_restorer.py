"""Restorer on tiny models: every policy equals a plain full prefill; faults degrade to recomputation."""

from __future__ import annotations

import asyncio
import inspect
import threading

import anyio
import numpy as np
import pytest
import torch

from kvrestore import (
    ComputeOnly,
    InvalidInputError,
    KVCache,
    LoadOnly,
    Restorer,
    StoreError,
    SyncRestorer,
    UnsupportedURLError,
    open_store,
)
from kvrestore.core.keys import chunk_keys
from kvrestore.core.sync import public_coroutines
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .waiting import wait_until

ATOL = 1e-5


def full_prefill(backend, tokens):
    return backend.prefill_chunk(tokens, None, 0).data


def run(fn, *args):
    return anyio.run(fn, *args)


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path) -> ChunkStore:
    return MemoryStore() if request.param == "memory" else open_store(f"file://{tmp_path}/kv")


@pytest.mark.parametrize("n_tokens", [1, 31, 32, 100])
def test_compute_and_load_equal_full_prefill(tiny_backend, store, n_tokens):
    tokens = random_tokens(n_tokens, tiny_backend.spec.vocab_size)
    ref = full_prefill(tiny_backend, tokens)

    async def main():
        r = Restorer(tiny_backend, store, chunk_size=32)
        computed = await r.restore(tokens, ComputeOnly())
        assert computed.stats.computed_chunks == computed.stats.n_chunks
        assert computed.stats.loaded_chunks == 0
        saved = await r.save(tokens)
        assert saved.written_chunks == saved.n_chunks == -(-n_tokens // 32)
        assert await r.lookup(tokens) == n_tokens
        again = await r.save(tokens)
        assert again.written_chunks == 0 and again.skipped_chunks == again.n_chunks
        loaded = await r.restore(tokens, LoadOnly())
        assert loaded.stats.loaded_chunks == loaded.stats.n_chunks
        assert loaded.stats.computed_chunks == 0
        assert loaded.stats.bytes_loaded > 0
        return computed.kv.data, loaded.kv.data

    computed, loaded = run(main)
    torch.testing.assert_close(computed, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(loaded, ref, atol=ATOL, rtol=0)


def test_load_only_computes_what_is_missing(llama_backend):
    b = llama_backend
    tokens = random_tokens(128, b.spec.vocab_size, seed=3)
    store = MemoryStore()

    async def main():
        r = Restorer(b, store, chunk_size=32)
        await r.save(tokens)
        keys = chunk_keys(tokens, b.spec.fingerprint, 32)
        await store.delete(keys[1].key)  # a hole in the middle
        assert await r.lookup(tokens) == 32
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.loaded_chunks == 3 and res.stats.computed_chunks == 1
        return res.kv.data

    torch.testing.assert_close(run(main), full_prefill(b, tokens), atol=ATOL, rtol=0)


def test_longer_prompt_reuses_stored_prefix(llama_backend):
    b = llama_backend
    tokens = random_tokens(100, b.spec.vocab_size, seed=4)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32)
        await r.save(tokens[:70])  # chunks 0, 1 full; chunk 2 partial (6 tokens)
        assert await r.lookup(tokens) == 64  # the partial chunk is not a prefix of the longer prompt
        res = await r.restore(tokens, LoadOnly())
        assert (res.stats.loaded_chunks, res.stats.computed_chunks) == (2, 2)
        return res.kv.data

    torch.testing.assert_close(run(main), full_prefill(b, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "foreign", "empty"])
def test_faulty_chunk_is_recomputed_exactly(llama_backend, tmp_path, fault):
    from kvrestore.backends.hf import HFBackend

    from .conftest import tiny_model

    b = llama_backend
    tokens = random_tokens(96, b.spec.vocab_size, seed=5)
    store = open_store(f"file://{tmp_path}")

    async def main():
        r = Restorer(b, store, chunk_size=32)
        await r.save(tokens)
        keys = [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)]
        blob = await store.get(keys[1])
        if fault == "corrupt":
            bad = bytearray(blob)
            bad[len(bad) // 2] ^= 0xFF
            blob = bytes(bad)
        elif fault == "truncate":
            blob = blob[: len(blob) - 100]
        elif fault == "empty":
            blob = b""
        else:  # another model's chunk written under this key
            other = HFBackend(tiny_model("llama", seed=9))
            other_store = MemoryStore()
            await Restorer(other, other_store, chunk_size=32).save(tokens)
            other_keys = [c.key for c in chunk_keys(tokens, other.spec.fingerprint, 32)]
            blob = await other_store.get(other_keys[1])
        await store.put(keys[1], blob)
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.failed_loads == 1
        assert res.stats.loaded_chunks == 2 and res.stats.computed_chunks == 1
        assert "chunk 1" in res.stats.errors[0]
        assert (await store.contains([keys[1]])) == [False]  # the bad object was removed
        return res.kv.data

    torch.testing.assert_close(run(main), full_prefill(b, tokens), atol=ATOL, rtol=0)


def test_chunks_written_by_other_dtype_are_not_used(tmp_path):
    from kvrestore.backends.hf import HFBackend

    from .conftest import tiny_model

    f32 = HFBackend(tiny_model("llama"))
    f16 = HFBackend(tiny_model("llama"), dtype=torch.bfloat16)
    tokens = random_tokens(64, f32.spec.vocab_size)

    async def main():
        store = open_store(f"file://{tmp_path}")
        await Restorer(f32, store, chunk_size=32).save(tokens)
        assert await Restorer(f16, store, chunk_size=32).lookup(tokens) == 0

    run(main)


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "empty"),
        (torch.tensor([], dtype=torch.long), "empty"),
        ([1, 2, 10_000], "outside the vocabulary"),
        ([1, -5], "outside the vocabulary"),
        ("hello", "not text"),
        ([1.5, 2.0], "integers"),
        ([[1, 2], [3, 4]], "1-D"),
        (np.array([1, 2**64 - 1], dtype=np.uint64), "token id 18446744073709551615 is outside"),
        (np.array([2**63], dtype=np.uint64), "token id 9223372036854775808 is outside"),
    ],
)
def test_bad_tokens_give_clear_errors(llama_backend, bad, message):
    r = Restorer(llama_backend, MemoryStore())
    with pytest.raises(InvalidInputError, match=message):
        run(r.restore, bad)
    with pytest.raises(InvalidInputError, match=message):
        run(r.save, bad)


@pytest.mark.parametrize("size", [0, -1, 2.5])
def test_bad_chunk_size(llama_backend, size):
    with pytest.raises(InvalidInputError, match="chunk_size"):
        Restorer(llama_backend, MemoryStore(), chunk_size=size)


def test_unknown_url_scheme():
    with pytest.raises(UnsupportedURLError, match="nosuch"):
        open_store("nosuch://bucket/x")


def test_sync_facade(llama_backend, tmp_path):
    tokens = random_tokens(80, llama_backend.spec.vocab_size)
    with SyncRestorer(llama_backend, open_store(f"file://{tmp_path}"), chunk_size=32) as r:
        assert r.lookup(tokens) == 0
        r.save(tokens)
        assert r.lookup(tokens) == 80
        res = r.restore(tokens, LoadOnly())
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_every_async_method_has_a_sync_face():
    """SyncRestorer is generated from Restorer: a new public async method cannot be left without its
    blocking twin, nor drift from it in name, signature or docstring."""
    names = public_coroutines(Restorer)
    expected = {"lookup", "save", "restore", "save_chunk", "restore_blend", "choose_blend_store", "close"}
    assert expected <= set(names)
    for name in names:
        face = getattr(SyncRestorer, name, None)
        assert face is not None, f"SyncRestorer has no {name}"
        assert not inspect.iscoroutinefunction(face), f"SyncRestorer.{name} is not blocking"
        if name != "close":  # close also stops the loop: written out, and takes no arguments either way
            assert inspect.signature(face) == inspect.signature(getattr(Restorer, name))
            assert face.__doc__ == getattr(Restorer, name).__doc__
    assert list(inspect.signature(SyncRestorer.close).parameters) == ["self"]


def test_sync_facade_runs_on_one_loop_thread(llama_backend):
    """Every sync call runs on the SyncRestorer's own event loop, one thread for all of them (stores
    that bind connections to a loop keep working), and close stops it."""
    seen = []

    class LoopStore(MemoryStore):
        async def contains(self, keys):
            seen.append((threading.get_ident(), id(asyncio.get_running_loop())))
            return await super().contains(keys)

    tokens = random_tokens(64, llama_backend.spec.vocab_size)
    r = SyncRestorer(llama_backend, LoopStore(), chunk_size=32, learn=False)
    assert r.lookup(tokens) == 0
    r.save(tokens)
    assert r.lookup(tokens) == 64
    assert len(set(seen)) == 1 and seen[0][0] != threading.get_ident()
    r.close()
    r.close()  # twice is fine
    with pytest.raises(RuntimeError):
        r.lookup(tokens)


class GatedStore(MemoryStore):
    """Serves `open_reads` reads, then holds every later one until it is cancelled (or `open_reads` is
    raised), so a restore can be cancelled while loads are in flight."""

    def __init__(self, open_reads: int) -> None:
        super().__init__()
        self.open_reads = open_reads

    async def get(self, key):
        while self.open_reads <= 0:
            await anyio.sleep(0.001)
        self.open_reads -= 1
        return await super().get(key)


def test_cancelled_restore_leaves_nothing_running(llama_backend):
    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size)

    async def main():
        store = GatedStore(open_reads=2)
        r = Restorer(b, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        events: list = []
        finished = []
        threads_before = threading.active_count()
        async with anyio.create_task_group() as tg:

            async def restore() -> None:
                await r.restore(tokens, LoadOnly(), on_event=events.append)
                finished.append(True)

            tg.start_soon(restore)
            await wait_until(lambda: len(events) >= 2)  # the open reads are done, the others held
            tg.cancel_scope.cancel()
        assert not finished and 0 < len(events) < 8  # cancelled part-way
        await anyio.sleep(0)
        # no task of the restore is left: a fresh restore on the same engine runs to the end
        store.open_reads = 8
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.loaded_chunks == 8
        assert threading.active_count() <= threads_before + 1
        return res.kv.data

    torch.testing.assert_close(run(main), full_prefill(b, tokens), atol=ATOL, rtol=0)


def test_trace_records_every_unit(llama_backend):
    tokens = random_tokens(100, llama_backend.spec.vocab_size)

    async def main():
        r = Restorer(llama_backend, MemoryStore(), chunk_size=32)
        await r.save(tokens)
        return await r.restore(tokens, LoadOnly())

    res = run(main)
    loads = res.trace.of_kind("load")
    assert sorted(e.first_chunk for e in loads) == [0, 1, 2, 3]
    assert all(e.end_s >= e.start_s >= 0 for e in res.trace.events)
    assert "load" in res.trace.table()


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_overlong_object_is_a_miss(llama_backend, tmp_path, compression, kind):
    """Bytes past the last section (an object glued to garbage) are detected on both read paths."""
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=6)
    store = MemoryStore() if kind == "memory" else open_store(f"file://{tmp_path}")

    async def main():
        r = Restorer(b, store, chunk_size=32, compression=compression)
        await r.save(tokens)
        ok = await r.restore(tokens, LoadOnly())
        assert ok.stats.loaded_chunks == 2 and ok.stats.failed_loads == 0
        key = chunk_keys(tokens, b.spec.fingerprint, 32)[0].key
        await store.put(key, (await store.get(key)) + b"\0")
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.failed_loads == 1 and res.stats.computed_chunks == 1
        return ok.kv.data, res.kv.data

    ok, res = run(main)
    ref = full_prefill(b, tokens)
    torch.testing.assert_close(ok, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(res, ref, atol=ATOL, rtol=0)


def test_restore_into_a_reused_buffer(llama_backend):
    b = llama_backend
    long, short = random_tokens(96, b.spec.vocab_size, seed=7), random_tokens(40, b.spec.vocab_size, seed=8)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32)
        await r.save(long)
        await r.save(short)
        buf = KVCache.empty(b.spec, 96)
        first = await r.restore(long, LoadOnly(), out=buf)
        assert first.kv.data.data_ptr() == buf.data.data_ptr()
        torch.testing.assert_close(first.kv.data, full_prefill(b, long), atol=ATOL, rtol=0)
        second = await r.restore(short, LoadOnly(), out=buf)  # a shorter prompt uses the buffer's head
        assert second.kv.n_tokens == 40 and second.kv.data.data_ptr() == buf.data.data_ptr()
        torch.testing.assert_close(second.kv.data, full_prefill(b, short), atol=ATOL, rtol=0)
        with pytest.raises(InvalidInputError, match="cannot hold"):
            await r.restore(long, out=KVCache.empty(b.spec, 50))

    run(main)


class DownStore(MemoryStore):
    """A store whose server went away: every call fails."""

    async def contains(self, keys):
        raise StoreError("connection refused")

    async def get(self, key):
        raise StoreError("connection refused")


def test_store_down_degrades_to_compute(llama_backend):
    tokens = random_tokens(70, llama_backend.spec.vocab_size)
    res = run(Restorer(llama_backend, DownStore(), chunk_size=32).restore, tokens, LoadOnly())
    assert res.stats.computed_chunks == 3 and res.stats.loaded_chunks == 0
    assert "connection refused" in res.stats.errors[0]
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_store_dropping_out_mid_restore_degrades_to_compute(llama_backend):
    tokens = random_tokens(128, llama_backend.spec.vocab_size)

    class Flaky(MemoryStore):
        async def get(self, key):
            raise StoreError("server stopped")

    async def main():
        store = Flaky()
        r = Restorer(llama_backend, store, chunk_size=32)
        await r.save(tokens)
        assert await r.lookup(tokens) == 128
        return await r.restore(tokens, LoadOnly())

    res = run(main)
    assert res.stats.failed_loads == 4 and res.stats.computed_chunks == 4
    assert all("server stopped" in e for e in res.stats.errors)
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_hanging_store_is_timed_out_and_recomputed(llama_backend):
    tokens = random_tokens(64, llama_backend.spec.vocab_size)

    class Hang(MemoryStore):
        async def get(self, key):
            await anyio.sleep(3600)

    async def main():
        store = Hang()
        r = Restorer(llama_backend, store, chunk_size=32, load_timeout_s=0.2)
        await r.save(tokens)
        with anyio.fail_after(10):
            return await r.restore(tokens, LoadOnly())

    res = run(main)
    assert res.stats.failed_loads == 2 and res.stats.computed_chunks == 2
    assert "TimeoutError" in res.stats.errors[0]
    torch.testing.assert_close(res.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


class CountingBackend:
    """Wraps a backend and counts the tokens it prefills."""

    def __init__(self, inner):
        self.inner, self.prefilled = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill_chunk(self, tokens, past, start):
        self.prefilled += len(tokens)
        return self.inner.prefill_chunk(tokens, past, start)

    def prefill_into(self, tokens, cache, start, **kwargs):
        self.prefilled += len(tokens)
        return self.inner.prefill_into(tokens, cache, start, **kwargs)


def test_saving_a_grown_prompt_computes_only_the_new_chunks(llama_backend):
    b = CountingBackend(llama_backend)
    tokens = random_tokens(128, llama_backend.spec.vocab_size, seed=9)

    async def main():
        store = MemoryStore()
        r = Restorer(b, store, chunk_size=32)
        await r.save(tokens[:64])
        assert b.prefilled == 64
        stats = await r.save(tokens)  # the conversation grew by two chunks
        assert (stats.written_chunks, stats.skipped_chunks) == (2, 2)
        assert b.prefilled == 64 + 64
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.loaded_chunks == 4
        return res.kv.data

    torch.testing.assert_close(run(main), full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_save_rewrites_a_stored_chunk_that_turned_out_unusable(llama_backend):
    tokens = random_tokens(96, llama_backend.spec.vocab_size, seed=10)

    async def main():
        store = MemoryStore()
        r = Restorer(llama_backend, store, chunk_size=32)
        await r.save(tokens[:64])
        key = chunk_keys(tokens, llama_backend.spec.fingerprint, 32)[1].key
        await store.put(key, b"not a chunk")
        stats = await r.save(tokens)
        assert stats.written_chunks == 2  # the new chunk and the replaced one
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.loaded_chunks == 3 and res.stats.failed_loads == 0
        return res.kv.data

    torch.testing.assert_close(run(main), full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)


def test_chunk_whose_header_outgrows_the_probe_still_loads(tmp_path):
    """250 layers make a header longer than the 4 KiB the in-place read probes: the whole-object path."""
    from kvrestore import codec
    from kvrestore.backends.hf import HFBackend

    from .conftest import tiny_model

    deep = HFBackend(tiny_model("llama", layers=250))
    tokens = random_tokens(40, deep.spec.vocab_size)

    async def main():
        store = open_store(f"file://{tmp_path}")
        r = Restorer(deep, store, chunk_size=32)
        await r.save(tokens)
        key = chunk_keys(tokens, deep.spec.fingerprint, 32)[0].key
        assert codec.header_length(await store.get(key)) > 4096
        return await r.restore(tokens, LoadOnly())

    res = run(main)
    assert res.stats.loaded_chunks == 2 and res.stats.failed_loads == 0
    torch.testing.assert_close(res.kv.data, full_prefill(deep, tokens), atol=ATOL, rtol=0)
