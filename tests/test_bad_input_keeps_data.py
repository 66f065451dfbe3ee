"""Bad input never costs stored data: a buffer a restore cannot write is refused up front with a typed
error, and only bytes proven bad delete a chunk (issue #50)."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore import (
    Auto,
    ComputeOnly,
    InvalidInputError,
    KVCache,
    LayerTwoPointer,
    LoadOnly,
    LocalStore,
    MemoryStore,
    Restorer,
    TokenTwoPointer,
)
from kvrestore.chunkio.load import ChunkLoader
from kvrestore.chunkio.read import fetch_chunk_sync, load_chunk
from kvrestore.core.errors import (
    CorruptChunkError,
    MissingChunkError,
    UnauthenticatedChunkError,
)
from kvrestore.core.keys import ChunkRef
from kvrestore.costs.compute import LayerCost
from kvrestore.costs.links import LinkCost
from tests.conftest import random_tokens
from tests.test_profile import make_profile

N_TOKENS, CHUNK = 300, 32


def bad_buffers(spec, n):
    """(what is wrong, a KVCache a restore cannot write in place) for the model `spec`."""
    L, H, D, dt = spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype
    grad = torch.zeros(L, 2, H, n, D, dtype=dt, requires_grad=True)
    return [
        ("one KV head too many", torch.zeros(L, 2, H + 1, n, D, dtype=dt)),
        ("head_dim one too wide", torch.zeros(L, 2, H, n, D + 1, dtype=dt)),
        ("a layer too many", torch.zeros(L + 1, 2, H, n, D, dtype=dt)),
        ("a layer too few", torch.zeros(L - 1, 2, H, n, D, dtype=dt)),
        ("four dimensions", torch.zeros(L, 2, H, n * D, dtype=dt)),
        ("transposed", torch.zeros(L, 2, H, D, n, dtype=dt).transpose(3, 4)),
        ("requires grad", grad),
        ("expanded heads", torch.zeros(L, 2, 1, n, D, dtype=dt).expand(L, 2, H, n, D)),
        ("sparse", torch.zeros(L, 2, H, n, D, dtype=dt).to_sparse()),
    ]


POLICIES = [ComputeOnly, LoadOnly, TokenTwoPointer, LayerTwoPointer, Auto]


def test_a_bad_out_buffer_is_refused_up_front_and_deletes_nothing(llama_backend, tmp_path):
    b = llama_backend
    tokens = random_tokens(N_TOKENS, b.spec.vocab_size, seed=50)
    reference = b.prefill_chunk(tokens, None, 0).data

    async def main():
        store = LocalStore(str(tmp_path / "kv"))
        async with Restorer(b, store, chunk_size=CHUNK) as r:
            await r.save(tokens)
            n_objects = len(await store.scan())
            for what, data in bad_buffers(b.spec, N_TOKENS):
                for policy in POLICIES:
                    with pytest.raises(InvalidInputError, match="out cannot be restored into") as caught:
                        await r.restore(tokens, policy(), out=KVCache(b.spec, data))
                    assert caught.value.__cause__ is None, what  # refused, not a failure translated
                    assert await r.lookup(tokens) == N_TOKENS, (what, policy.__name__)
            assert len(await store.scan()) == n_objects
            # the store is whole: a good buffer loads every chunk, exact
            out = KVCache.empty(b.spec, N_TOKENS)
            result = await r.restore(tokens, LoadOnly(), out=out)
            assert result.stats.loaded_chunks == result.stats.n_chunks
            assert result.kv.data.data_ptr() == out.data.data_ptr()
            torch.testing.assert_close(out.data, reference, atol=1e-4, rtol=0)

    anyio.run(main)


def test_buffers_a_restore_can_write_in_place_are_taken(llama_backend):
    """The layouts a restore writes as they lie: a larger buffer (its head is used), a slice of one along
    layers' neighbours (a token prefix), each exact."""
    b = llama_backend
    tokens = random_tokens(70, b.spec.vocab_size, seed=51)
    reference = b.prefill_chunk(tokens, None, 0).data
    big = KVCache.empty(b.spec, 100)
    prefix = KVCache(b.spec, KVCache.empty(b.spec, 90).data[:, :, :, :80])  # not contiguous, rows are

    async def main():
        async with Restorer(b, MemoryStore(), chunk_size=16) as r:
            await r.save(tokens)
            for out in (big, prefix):
                for policy in (LoadOnly(), TokenTwoPointer(), ComputeOnly()):
                    result = await r.restore(tokens, policy, out=out)
                    torch.testing.assert_close(result.kv.data, reference, atol=1e-4, rtol=0)

    anyio.run(main)


def _first_chunk(restorer, store, tokens):
    return ChunkLoader(restorer.spec, store), restorer.chunks(tokens)[1][0]


@pytest.mark.parametrize("reads_sync", [True, False])
def test_a_loader_refuses_a_destination_it_cannot_fill_and_keeps_the_chunk(
    llama_backend, tmp_path, reads_sync
):
    """Below the restorer: a chunk's load into rows it cannot be placed in raises InvalidInputError
    before reading, and the chunk stays stored."""
    b = llama_backend
    tokens = random_tokens(N_TOKENS, b.spec.vocab_size, seed=52)

    async def main():
        store = LocalStore(str(tmp_path / "kv"))
        async with Restorer(b, store, chunk_size=CHUNK) as r:
            await r.save(tokens)
        loader, ref = _first_chunk(r, store, tokens)
        for what, data in bad_buffers(b.spec, N_TOKENS)[:-1]:  # a sparse tensor has no token slices
            kv = KVCache(b.spec, data)
            with pytest.raises(InvalidInputError, match="cannot be loaded into"):
                if reads_sync:
                    damaged: list[str] = []
                    fetch_chunk_sync(loader, ref, kv, damaged).place()
                else:
                    await load_chunk(loader, ref, kv)
            assert await store.contains([ref.key]) == [True], what

    anyio.run(main)


@pytest.mark.parametrize(
    "error, deleted",
    [
        (CorruptChunkError("layer 0: section checksum mismatch"), True),
        (UnauthenticatedChunkError("no valid MAC under this secret"), False),
        (MissingChunkError("gone"), False),
        (RuntimeError("a device copy failed"), False),
    ],
)
def test_only_bytes_proven_bad_delete_a_chunk(llama_backend, error, deleted):
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=53)

    async def main():
        store = MemoryStore()
        async with Restorer(b, store, chunk_size=CHUNK) as r:
            await r.save(tokens)
        loader, ref = _first_chunk(r, store, tokens)

        async def failing_load(*args):
            raise error

        def failing_fetch_sync(*args):
            raise error

        loader.load = failing_load  # type: ignore[method-assign]
        loader.fetch_sync = failing_fetch_sync  # type: ignore[method-assign]
        kv = KVCache.empty(b.spec, 64)
        with pytest.raises(type(error)):
            await load_chunk(loader, ref, kv)
        damaged: list[str] = []
        with pytest.raises(type(error)):
            fetch_chunk_sync(loader, ref, kv, damaged).place()
        assert await store.contains([ref.key]) == [not deleted]
        assert damaged == ([ref.key] if deleted else [])

    anyio.run(main)


@pytest.mark.parametrize("capacity", [None, 1 << 20])
def test_a_local_store_recreates_its_deleted_directory(tmp_path, capacity):
    """A capped local store (a lock file and reservations in the directory) recovers from the directory
    being deleted as an uncapped one does: the next write makes it again."""
    import shutil

    from kvrestore import open_store

    root = tmp_path / "kv"
    kwargs = {} if capacity is None else {"capacity_bytes": capacity}
    store = open_store(str(root), **kwargs)

    async def main():
        await store.put("ab" * 32, b"first")
        shutil.rmtree(root)
        await store.put("cd" * 32, b"second")
        assert await store.get("cd" * 32) == b"second"
        assert await store.contains(["ab" * 32, "cd" * 32]) == [False, True]

    anyio.run(main)


def test_short_chunks_are_planned_and_run_in_units_that_pay_their_cost(llama_backend, tmp_path):
    """chunk_size=1: `Auto` plans over units of `UNIT_TOKENS` tokens (never the layer axis, which
    reads every chunk per layer), every restore runs in such units, and the KV is exact; the stats
    count the store's chunks.

    The restorer's cost model is fixed (a profile), not learned from these restores: a layer costs a
    nanosecond to compute by it, so no link the loads teach can be predicted to land every layer
    first, and the `LayerTwoPointer` restore runs along layers (not handed to the token axis,
    `restore.layer_wise.WHOLE_CHUNKS`) whatever this machine's speeds."""
    from kvrestore.restore.results import UNIT_TOKENS, Units

    b = llama_backend
    n = 200
    tokens = random_tokens(n, b.spec.vocab_size, seed=54)
    reference = b.prefill_chunk(tokens, None, 0).data
    costs = make_profile(b, layer=LayerCost(1e-9, 0.0, 0.0))

    async def main():
        store = LocalStore(str(tmp_path / "kv"))
        r = Restorer(b, store, chunk_size=1, profile=costs)
        await r.save(tokens)
        assert len(await store.scan()) == n
        results = [
            await r.restore(tokens, policy) for policy in (Auto(), Auto(), LoadOnly(), TokenTwoPointer())
        ]
        r.planner.link.current = LinkCost(1e13, 0.0)  # the fastest link there is: still along layers
        results.append(await r.restore(tokens, LayerTwoPointer()))  # asked for: it still reads every chunk
        return results

    results = anyio.run(main)
    units = -(-n // UNIT_TOKENS)
    for res in results:
        torch.testing.assert_close(res.kv.data, reference, atol=1e-4, rtol=0)
        assert res.stats.n_chunks == n
    for res in results[:4]:
        assert res.stats.computed_chunks + res.stats.loaded_chunks == n
    # the layer axis: every layer once; a chunk whose layers were partly computed, partly loaded,
    # counts in both (which of the two happens depends on the lanes' speeds)
    layers = results[4].stats
    assert layers.axis == "layers" and layers.policy == "layer-wise" and not layers.handoff
    assert layers.computed_layers + layers.loaded_layers == b.spec.num_layers
    assert layers.computed_chunks == n * (layers.computed_layers > 0)
    assert layers.loaded_chunks == n * (layers.loaded_layers > 0)
    for res in results[:4]:
        assert all(e.last_chunk < units for e in res.trace.events)  # unit indices: never a 1-token unit
    for res in results[:2]:
        assert res.plan is not None and "layer-wise" not in res.plan.predicted_s
    assert results[2].stats.loaded_chunks == n and len(results[2].trace.of_kind("load")) == units

    refs = [ChunkRef(i, i, i + 1, f"{i:016x}") for i in range(40)]
    grouped = Units.of(refs, [True] * 33 + [False] * 7, unit=16)
    assert [(u.start, u.end) for u in grouped.refs] == [(0, 16), (16, 32), (32, 40)]
    assert grouped.stored == [True, True, False] and grouped.members is not None
    assert [len(m) for m in grouped.members] == [16, 16, 8]
    assert Units.of(refs[:1], [True], unit=16).members is None  # one chunk is its own unit
