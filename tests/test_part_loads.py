"""A rank's share of chunks stored in another layout than its own (`chunkio.part_loads.share_loads`): of
each stored part over the rank's heads and layers, those, into the rank's pages, for every writer and
reader among tp 1, tp 2, pp 2 and tp 2 x pp 2 (2 KV heads, 4 layers; tp 4 reads too); a stage reads its
layers only."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import PageWrites, SectionPages
from kvrestore.chunkio.pages import PagedCache, gather
from kvrestore.chunkio.part_loads import share_loads
from kvrestore.chunkio.parts import Layout, Part, engine_layout, part_key, rank_part, slice_part, write_part
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.stores import MemoryStore

L, H, D, CHUNK, N, BS = 4, 2, 64, 64, 3, 16
SPEC = ModelSpec("tiny", L, H, D, 100, torch.float32, fingerprint="ab" * 16)
ENGINES = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
READERS = [*ENGINES, (4, 1), (4, 2)]  # tp 4: each of the 2 heads on two ranks (what tp 2 writes)


@pytest.fixture(scope="module")
def io():
    t = LoopThread()
    yield t
    t.close()


@pytest.fixture(scope="module")
def kv() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(L, 2, H, N * CHUNK, D)


REFS = [ChunkRef(i, i * CHUNK, (i + 1) * CHUNK, f"{i:x}" * 32) for i in range(N)]


def stored(kv: torch.Tensor, layout: Layout) -> MemoryStore:
    store = MemoryStore()

    async def save() -> None:
        for r in REFS:
            for part in layout:
                data = slice_part(kv[:, :, :, r.start : r.end], part, SPEC)
                await write_part(store, data, SPEC, r.key, r.start, part)

    anyio.run(save)
    return store


def pages_for(part: Part) -> PagedCache:
    (a, b), (l0, l1) = part.heads, part.layers
    blocks = N * CHUNK // BS + 2
    return PagedCache(
        [torch.zeros(blocks, b - a, BS, D) for _ in range(l0, l1)],
        [torch.zeros(blocks, b - a, BS, D) for _ in range(l0, l1)],
    )


BLOCK_IDS = list(reversed(range(N * CHUNK // BS + 2)))  # pages out of order, as an engine's


def load_share(io, store, mine: Part, layout: Layout, first: int = 0, k: int = N * CHUNK):
    paged = pages_for(mine)
    load = share_loads(
        SPEC, mine, layout, store, REFS, k, paged, lambda pages: PageWrites(pages, BLOCK_IDS), first=first
    )
    load.start(io, timeout=60)
    placed = [load.wait(layer) for layer in range(len(paged.k))]
    load.cancel("done")
    return load, paged, placed


@pytest.mark.parametrize("writer", ENGINES, ids=lambda e: f"w-tp{e[0]}pp{e[1]}")
@pytest.mark.parametrize("reader", READERS, ids=lambda e: f"r-tp{e[0]}pp{e[1]}")
def test_every_rank_reads_exactly_its_heads_and_layers_from_any_layout(io, kv, writer, reader):
    layout = engine_layout(SPEC, *writer)
    store = stored(kv, layout)
    tp, pp = reader
    for rank in range(tp):
        for stage in range(pp):
            mine, _ = rank_part(SPEC, tp, rank, pp, stage)
            load, paged, placed = load_share(io, store, mine, layout, first=CHUNK // 2)
            assert all(placed) and not load.failed, load.errors
            got = gather(list(zip(paged.k, paged.v, strict=True)), BLOCK_IDS, CHUNK // 2, N * CHUNK)
            (a, b), (l0, l1) = mine.heads, mine.layers
            assert torch.equal(got, kv[l0:l1, :, a:b, CHUNK // 2 :])


def test_a_stage_reads_only_its_layers_of_whole_chunks(io, kv):
    store = stored(kv, engine_layout(SPEC))
    mine, _ = rank_part(SPEC, pp=2, stage=1)
    load, _, _ = load_share(io, store, mine, engine_layout(SPEC))
    share = N * 2 * 2 * H * CHUNK * D * 4  # its 2 layers of every chunk, fp32
    assert share <= load.bytes_read <= share + N * codec.HEADER_PROBE


def test_a_damaged_part_fails_its_chunk_on_the_rank_that_reads_it(io, kv):
    layout = engine_layout(SPEC, pp=2)
    store = stored(kv, layout)
    key = part_key(REFS[1].key, layout[1], SPEC)  # layers [2, 4) of chunk 1
    blob = bytearray(anyio.run(store.get, key))
    blob[-9] ^= 1
    anyio.run(store.put, key, bytes(blob))
    whole, _ = rank_part(SPEC)
    load, _, _ = load_share(io, store, whole, layout)
    assert load.failed_ranges() == [(CHUNK, 2 * CHUNK)]
    assert anyio.run(store.get, key) is None  # proven damage: deleted, as every reader does


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_rank_reads_only_its_head_of_whole_chunks(io, kv, rank):
    """Whole chunks carry per-head checks (format 6): a tp-2 rank reads each one's header probe and its
    head's keys and values, half the KV, exactly (`tests/test_head_reads.py` for the checks)."""
    store = stored(kv, engine_layout(SPEC))
    mine, _ = rank_part(SPEC, tp=2, rank=rank)
    load, paged, placed = load_share(io, store, mine, engine_layout(SPEC))
    assert all(placed) and not load.failed, load.errors
    got = gather(list(zip(paged.k, paged.v, strict=True)), BLOCK_IDS, 0, N * CHUNK)
    assert torch.equal(got, kv[:, :, rank : rank + 1])
    share = N * L * 2 * CHUNK * D * 4  # its head of every layer of every chunk, fp32
    assert load.bytes_read == share + N * codec.HEADER_PROBE


@pytest.mark.parametrize("layers", [range(2, 2), range(3, 5), range(-1, 2), range(0, 4, 2)])
def test_layers_that_are_not_some_of_the_chunks_are_refused(layers):
    dest = SectionPages(PageWrites(pages_for(rank_part(SPEC)[0]), BLOCK_IDS))
    with pytest.raises(InvalidInputError, match="layers"):
        LayerLoad(SPEC, MemoryStore(), REFS, N * CHUNK, dest, layers=layers)
