"""Boundary activations: their wire format, saving them, and a stage computing from them (one process)."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore import InvalidInputError, Restorer, codec, open_store
from kvrestore.core.errors import CorruptChunkError, ForeignChunkError, TruncatedChunkError
from kvrestore.distributed import (
    StageBackend,
    StageLayout,
    StagePlan,
    prefill_with_boundaries,
    save_with_boundaries,
)
from tests.conftest import random_tokens

ATOL = 1e-5  # the restore tests' tolerance (tests/test_restorer.py)


def test_boundary_codec_roundtrip_and_damage(llama_backend):
    spec = llama_backend.spec
    hidden = torch.randn(5, 64)
    blob = codec.encode_boundary(hidden, spec, "ab" * 20, 10, 2)
    assert blob[:4] == codec.BOUNDARY_MAGIC
    got = codec.decode_boundary(blob, spec, "ab" * 20, 10, 5, 2, 64)
    assert torch.equal(got, hidden)
    with pytest.raises(ForeignChunkError):  # another layer's activation
        codec.decode_boundary(blob, spec, "ab" * 20, 10, 5, 1, 64)
    with pytest.raises(ForeignChunkError):  # another chunk's
        codec.decode_boundary(blob, spec, "cd" * 20, 10, 5, 2, 64)
    with pytest.raises(TruncatedChunkError):
        codec.decode_boundary(blob[:-1], spec, "ab" * 20, 10, 5, 2, 64)
    flipped = bytearray(blob)
    flipped[-3] ^= 1
    with pytest.raises(CorruptChunkError):
        codec.decode_boundary(bytes(flipped), spec, "ab" * 20, 10, 5, 2, 64)
    with pytest.raises(CorruptChunkError):  # a KV chunk is not a boundary activation
        codec.decode_boundary(b"KVRC" + blob[4:], spec, "ab" * 20, 10, 5, 2, 64)
    assert codec.boundary_key("ab" * 20, 2) != codec.boundary_key("ab" * 20, 3)


def test_layout():
    assert StageLayout.even(30, 4).stages == ((0, 8), (8, 16), (16, 23), (23, 30))
    assert StageLayout.at(4, [1]).boundaries == [1]
    for bad in ([0], [2, 2], [5]):
        with pytest.raises(InvalidInputError):
            StageLayout.at(4, bad)
    with pytest.raises(InvalidInputError):
        StageLayout.even(2, 3)


def test_plan_pipelines_chunks_without_activations():
    layout = StageLayout.even(6, 3)
    # stage 1 lacks chunk 1's activation, stage 2 lacks chunk 2's; chunk 3's KV is not stored
    plan = StagePlan.make(
        layout, [True, True, True, False], [[True, False, True, True], [True, True, False, True]]
    )
    assert plan.receives(1) == [False, True, False, False] and plan.sends(0) == [False, True, False, False]
    assert plan.pipelined(1) == [False, True, True, False]  # it receives 1 and sends 2
    assert plan.stored(0) == [True, False, True, False]
    assert plan.stored(1) == [True, False, False, False]
    assert plan.stored(2) == [True, True, False, False]
    assert plan.wants_boundary(0) == [False] * 4


def test_stages_from_boundaries_equal_full_prefill(llama_backend):
    """Each stage computes its layers from the saved boundary activations alone, chunk by chunk."""
    b = llama_backend
    tokens = random_tokens(70, b.spec.vocab_size, seed=3)
    layout = StageLayout.at(b.spec.num_layers, [1, 2])
    ref = b.prefill_chunk(tokens, None, 0).data
    kv, acts = prefill_with_boundaries(b, tokens, layout)
    torch.testing.assert_close(kv.data, ref, atol=ATOL, rtol=0)
    for a, e in layout.stages:
        stage = StageBackend(b, a, e)
        shard = stage.empty_shard(len(tokens))
        for start in range(0, 70, 32):  # chunks computed in order, each from its own activation
            end = min(70, start + 32)
            hidden = stage.input_of(tokens[start:end]) if a == 0 else acts[a][start:end][None]
            stage.forward_into(hidden, shard, start)
        torch.testing.assert_close(shard, ref[a:e], atol=ATOL, rtol=0)


def test_save_with_boundaries_writes_every_chunk_and_boundary(llama_backend, tmp_path):
    b = llama_backend
    tokens = random_tokens(100, b.spec.vocab_size, seed=4)
    layout = StageLayout.even(b.spec.num_layers, 3)

    async def main():
        store = open_store(f"file://{tmp_path}")
        restorer = Restorer(b, store, chunk_size=32)
        stats = await save_with_boundaries(restorer, tokens, layout)
        _, refs = restorer.chunks(tokens)
        keys = [codec.boundary_key(r.key, layer) for r in refs for layer in layout.boundaries]
        assert all(await store.contains(keys + [r.key for r in refs]))
        blob = await store.get(codec.boundary_key(refs[1].key, layout.boundaries[0]))
        return stats, refs, blob

    stats, refs, blob = anyio.run(main)
    assert (stats.n_chunks, stats.kv_written_chunks, stats.boundary_objects) == (4, 4, 8)
    _, acts = prefill_with_boundaries(b, tokens, layout)
    layer = layout.boundaries[0]
    got = codec.decode_boundary(blob, b.spec, refs[1].key, 32, 32, layer, 64)
    torch.testing.assert_close(got, acts[layer][32:64], atol=0, rtol=0)
