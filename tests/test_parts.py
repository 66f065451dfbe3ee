"""Chunks as parts (`chunkio.parts`): what a tensor-parallel rank or a pipeline stage writes, read back
by a reader of any layout, exactly; a missing, damaged or forged part is a miss, never half a chunk."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore.chunkio.parts import (
    Part,
    engine_layout,
    find_layouts,
    leading,
    part_key,
    pp_layers,
    rank_part,
    read_slice,
    reader_layouts,
    slice_part,
    tp_heads,
    whole,
    write_part,
)
from kvrestore.codec import HEADER_PROBE
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import (
    CorruptChunkError,
    ForeignChunkError,
    InvalidInputError,
    MissingChunkError,
    UnauthenticatedChunkError,
)
from kvrestore.core.spec import ModelSpec
from kvrestore.stores import MemoryStore

KEY = "0123456789abcdef" * 2
T = 16


def make_spec(heads: int = 2, layers: int = 4) -> ModelSpec:
    return ModelSpec("tiny", layers, heads, 8, 100, torch.float32, "ab" * 16)


def full_kv(spec: ModelSpec, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.num_layers, 2, spec.num_kv_heads, T, spec.head_dim, generator=g)


def save(store, spec, kv, layout, seal=None, key=KEY) -> None:
    async def go():
        for part in layout:
            await write_part(store, slice_part(kv, part, spec), spec, key, 0, part, seal=seal)

    anyio.run(go)


def read(store, spec, layout, heads, layers, seal=None):
    return anyio.run(lambda: read_slice(store, spec, KEY, 0, T, layout, heads, layers, seal=seal))


def test_heads_and_layers_split_as_vllm_splits_them():
    assert [tp_heads(2, 2, r) for r in range(2)] == [((0, 1), True), ((1, 2), True)]
    # tp 4 over 2 heads: each head on two ranks, written by the first only
    assert [tp_heads(2, 4, r) for r in range(4)] == [
        ((0, 1), True),
        ((0, 1), False),
        ((1, 2), True),
        ((1, 2), False),
    ]
    assert [pp_layers(30, 4, s) for s in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [pp_layers(4, 2, s) for s in range(2)] == [(0, 2), (2, 4)]
    spec = make_spec()
    assert engine_layout(spec, tp=4) == engine_layout(spec, tp=2)
    assert engine_layout(spec, tp=1) == (whole(spec),)
    with pytest.raises(InvalidInputError, match="do not split"):
        tp_heads(6, 4, 0)


def test_a_rank_knows_its_part_and_a_prompt_hits_in_one_layout():
    spec = make_spec(heads=2, layers=4)
    assert rank_part(spec, tp=2, rank=1, pp=2, stage=0) == (Part((1, 2), (0, 2)), True)
    assert rank_part(spec, tp=4, rank=3) == (Part((1, 2), (0, 4)), False)
    tp1, tp2 = engine_layout(spec, 1), engine_layout(spec, 2)
    assert leading([tp2, tp2, tp1, None]) == (tp2, 2)
    assert leading([None, tp1]) == (None, 0)
    assert leading([]) == (None, 0)


def test_part_keys_are_store_keys_and_the_whole_chunk_is_its_own_key():
    spec = make_spec()
    keys = {part_key(KEY, p, spec) for p in engine_layout(spec, 2, 2)}
    assert len(keys) == 4 and KEY not in keys
    assert all(len(k) == len(KEY) and int(k, 16) >= 0 for k in keys)
    assert part_key(KEY, whole(spec), spec) == KEY


@pytest.mark.parametrize("writer", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (6, 2)])
def test_any_slice_of_any_layout_reads_exact(writer):
    spec = make_spec(heads=6, layers=4)
    kv = full_kv(spec)
    store = MemoryStore()
    layout = engine_layout(spec, *writer)
    save(store, spec, kv, layout)
    (found,) = anyio.run(lambda: find_layouts(store, spec, [KEY], reader_layouts(spec, [layout])))
    assert found == layout
    for heads in [(0, 6), (0, 3), (3, 6), (2, 4), (5, 6)]:
        for layers in [(0, 4), (0, 2), (2, 4), (1, 3)]:
            got = read(store, spec, found, heads, layers).kv
            assert torch.equal(got, kv[layers[0] : layers[1], :, heads[0] : heads[1]])


def test_a_rank_reads_only_its_heads_bytes():
    spec = make_spec(heads=2, layers=4)
    kv = full_kv(spec)
    store = MemoryStore()
    save(store, spec, kv, engine_layout(spec, 2))
    share = kv[:, :, :1].numel() * 4
    for heads in [(0, 1), (1, 2)]:
        got = read(store, spec, engine_layout(spec, 2), heads, (0, 4))
        assert share < got.bytes_read <= share + HEADER_PROBE  # its heads' KV, plus one header


def test_a_missing_part_is_a_miss_and_layouts_never_mix():
    spec = make_spec(heads=6, layers=2)
    kv = full_kv(spec)
    store = MemoryStore()
    tp2, tp3 = engine_layout(spec, 2), engine_layout(spec, 3)
    save(store, spec, kv, tp2[:1])  # heads [0, 3) of tp 2
    save(store, spec, kv, tp3[1:])  # heads [2, 6) of tp 3: together they cover every head
    assert anyio.run(lambda: find_layouts(store, spec, [KEY])) == [None]
    with pytest.raises(MissingChunkError):
        read(store, spec, tp2, (0, 6), (0, 2))


def test_a_damaged_part_fails_its_check():
    spec = make_spec()
    store = MemoryStore()
    layout = engine_layout(spec, 2)
    save(store, spec, full_kv(spec), layout)
    pkey = part_key(KEY, layout[1], spec)
    blob = bytearray(anyio.run(lambda: store.get(pkey)))
    blob[-5] ^= 1
    anyio.run(lambda: store.put(pkey, bytes(blob)))
    read(store, spec, layout, (0, 1), (0, 4))  # the other rank's part is intact
    with pytest.raises(CorruptChunkError):
        read(store, spec, layout, (0, 2), (0, 4))


def test_a_part_under_another_parts_key_is_foreign():
    spec = make_spec()
    store = MemoryStore()
    layout = engine_layout(spec, 2)
    save(store, spec, full_kv(spec), layout)
    keys = [part_key(KEY, p, spec) for p in layout]
    moved = anyio.run(lambda: store.get(keys[1]))
    anyio.run(lambda: store.put(keys[0], moved))  # right bytes, right shape, wrong heads
    with pytest.raises(ForeignChunkError):
        read(store, spec, layout, (0, 1), (0, 4))


def test_a_part_forged_without_the_secret_is_refused():
    spec = make_spec()
    store = MemoryStore()
    layout = engine_layout(spec, 2)
    mine, theirs = Seal(b"s" * 32), Seal(b"t" * 32)
    save(store, spec, full_kv(spec), layout[:1], seal=mine)
    save(store, spec, full_kv(spec, seed=1), layout[1:], seal=theirs)  # a writer without our secret
    assert torch.equal(read(store, spec, layout, (0, 1), (0, 4), seal=mine).kv, full_kv(spec)[:, :, :1])
    with pytest.raises(UnauthenticatedChunkError):
        read(store, spec, layout, (0, 2), (0, 4), seal=mine)


def test_a_part_outside_the_model_is_refused():
    with pytest.raises(InvalidInputError, match="not within"):
        part_key(KEY, Part((1, 3), (0, 4)), make_spec())


def test_a_restorer_reads_a_chunk_saved_as_two_head_parts(llama_backend):
    from kvrestore import LoadOnly, Restorer
    from kvrestore.chunkio.parts_view import PartsView
    from kvrestore.core.keys import chunk_keys

    from .conftest import random_tokens

    b = llama_backend
    spec = b.spec
    tokens = random_tokens(80, spec.vocab_size, seed=5)
    ref = b.prefill_chunk(tokens, None, 0).data
    parts = MemoryStore()
    layout = engine_layout(spec, tp=spec.num_kv_heads)  # one head a part: as tp 2 writes
    refs = chunk_keys(tokens, spec.fingerprint, 32)
    for r in refs:  # each rank writes its heads of the prefill's KV
        for part in layout:
            data = slice_part(ref[:, :, :, r.start : r.end], part, spec)
            anyio.run(lambda: write_part(parts, data, spec, r.key, r.start, part))  # noqa: B023

    async def main():
        r = Restorer(b, PartsView(parts, spec), chunk_size=32)
        assert await r.lookup(tokens) == 80
        res = await r.restore(tokens, LoadOnly())
        assert res.stats.loaded_chunks == res.stats.n_chunks == 3
        await parts.delete(part_key(refs[1].key, layout[1], spec))  # one rank's part of chunk 1 gone
        assert await r.lookup(tokens) == 32
        again = await r.restore(tokens, LoadOnly())
        assert (again.stats.loaded_chunks, again.stats.computed_chunks) == (2, 1)
        damaged = part_key(refs[2].key, layout[0], spec)
        blob = bytearray(await parts.get(damaged))
        blob[-3] ^= 1
        await parts.put(damaged, bytes(blob))
        r = Restorer(b, PartsView(parts, spec), chunk_size=32)  # a new reader: nothing assembled yet
        assert await r.lookup(tokens) == 32  # still listed: only reading it proves the damage
        third = await r.restore(tokens, LoadOnly())
        assert (third.stats.loaded_chunks, third.stats.computed_chunks) == (1, 2)
        assert await parts.contains([damaged, part_key(refs[2].key, layout[1], spec)]) == [False, True]
        return res.kv.data, again.kv.data, third.kv.data

    for kv in anyio.run(main):
        torch.testing.assert_close(kv, ref, atol=1e-5, rtol=0)
