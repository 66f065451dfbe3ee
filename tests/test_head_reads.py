"""A reader of some of a chunk's KV heads (a tensor-parallel rank reading a chunk of more heads) reads only
their bytes, plus the header, and verifies each head before use (format 6, `codec.heads`): damage in
another head is not its business, damage in its own is caught and deleted, a forged or spliced head is
refused under a seal, and a chunk without per-head checks (formats 4 and 5) is read whole per layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import anyio
import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.head_slice import sliced
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import PageWrites, SectionPages
from kvrestore.chunkio.pages import PagedCache
from kvrestore.chunkio.parts import SliceRead, read_slice, whole
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import CorruptChunkError, UnauthenticatedChunkError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.integrations.vllm.layouts import kv_views
from kvrestore.stores import MemoryStore
from kvrestore.stores.wrapper import WrapperStore

from .forgery import SecondPreimages
from .paged import gather_chunk

SPEC = ModelSpec("tiny", 3, 2, 32, 100, torch.float32, "ab" * 16)
T = 64  # tokens a chunk: a head's keys of a layer are T * D * 4 = 8 KiB, more than a header probe
KEYS = [f"{j:x}" * 32 for j in range(10, 13)]
HEAD = T * SPEC.head_dim * 4  # bytes of one head's keys (or values) of one layer
SECRET = Seal(b"s" * 32)


class Counting(WrapperStore):
    """`inner`, counting the bytes its reads return."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.read = 0

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        got = await self.inner.get_range(key, start, end)
        self.read += len(got or b"")
        return got

    async def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        got = await self.inner.get_ranges(key, ranges)
        self.read += sum(len(g or b"") for g in got)
        return got


def _prompt(chunks: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.num_layers, 2, SPEC.num_kv_heads, chunks * T, SPEC.head_dim, generator=g)


def _blob(kv: torch.Tensor, j: int = 0, key: str | None = None, **kw) -> bytes:
    data = kv[:, :, :, j * T : (j + 1) * T].clone()
    return codec.encode_chunk(KVChunk(j * T, data), SPEC, key or KEYS[j], **kw)


def _store(blobs: dict[str, bytes]) -> Counting:
    store = Counting(MemoryStore())
    for key, blob in blobs.items():
        anyio.run(store.put, key, blob)
    store.read = 0
    return store


def _read(store, heads, seal=None, damaged=None) -> SliceRead:
    layout = (whole(SPEC),)  # tp 1's chunk, or a `Restorer`'s
    return anyio.run(
        lambda: read_slice(store, SPEC, KEYS[0], 0, T, layout, heads, (0, 3), seal=seal, damaged=damaged)
    )


def _kv_bytes(blob: bytes) -> int:
    """The bytes of a chunk's sections (all of its KV)."""
    return len(blob) - codec.read_header(blob)[0].layers[0].offset


def _head_range(blob: bytes, layer: int, head: int, half: int = 0) -> tuple[int, int]:
    """Where head `head`'s keys (`half` 0) or values (1) of `layer` lie in `blob`."""
    header, _ = codec.read_header(blob)
    start = header.layers[layer].offset + (half * SPEC.num_kv_heads + head) * HEAD
    return start, start + HEAD


# -- the format ------------------------------------------------------------------------------------------


def test_native_uncompressed_chunks_of_several_heads_carry_per_head_checks_and_others_do_not():
    kv = _prompt()
    version = {
        "native": codec.read_header(_blob(kv))[0].version,
        "tiled": codec.read_header(_blob(kv, key_tile=8))[0].version,
        "zstd": codec.read_header(_blob(kv, compression="zstd"))[0].version,
        "int8": codec.read_header(_blob(kv, encoding="int8"))[0].version,
        "asked not to": codec.read_header(_blob(kv, head_checks=False))[0].version,
    }
    assert version == {"native": 6, "tiled": 6, "zstd": 4, "int8": 4, "asked not to": 4}
    one_head = dataclasses.replace(SPEC, num_kv_heads=1)
    blob = codec.encode_chunk(KVChunk(0, kv[:, :, :1, :T].clone()), one_head, KEYS[0])
    assert codec.read_header(blob)[0].version == codec.PLAIN_VERSION  # nothing to read apart
    # a head's keys and values, tiled or not, are two ranges of its section
    for tile in (0, 8):
        blob = _blob(kv, key_tile=tile)
        header, _ = codec.read_header(blob)
        assert codec.head_ranges(header, [1], (1, 2)) == [
            _head_range(blob, 1, 1, 0),
            _head_range(blob, 1, 1, 1),
        ]


def test_a_head_tag_binds_the_layer_and_the_head():
    """Head tags have nonces of their own: the same bytes get another tag at another head, layer, or as a
    section, and under another chunk's salt."""
    data = [b"k" * 64, b"v" * 64]
    tags = SECRET.sections(b"\x00" * 16)
    seen = {
        tags.head_tag(0, 0, data),
        tags.head_tag(0, 1, data),
        tags.head_tag(1, 0, data),
        tags.tag(0, data),
        SECRET.sections(b"\x01" * 16).head_tag(0, 0, data),
    }
    assert len(seen) == 5


def test_a_big_models_header_still_fits_the_probe_signed():
    """The per-head checks lie in a table after the header: 19 KB of them for 80 layers of 8 heads, signed,
    and the header a reader of whole sections reads first is as small as a format-4 one."""
    spec = ModelSpec("big", 80, 8, 128, 100, torch.float16, "ab" * 16)
    data = torch.zeros(80, 2, 8, 16, 128, dtype=torch.float16)
    blob = codec.encode_chunk(KVChunk(0, data), spec, KEYS[0], seal=SECRET)
    header, end = codec.read_header(blob)
    assert header.version == 6 and end <= codec.HEADER_PROBE
    lo, hi = codec.head_table_span(header)
    assert lo == codec.body_start_after(end) and hi - lo >= 80 * 8 * 24


# -- bytes read ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("tile", [0, 8])
def test_a_tp2_rank_reads_only_its_heads_of_a_whole_chunk(signed, tile):
    seal = SECRET if signed else None
    kv = _prompt()
    blob = _blob(kv, seal=seal, key_tile=tile)
    store = _store({KEYS[0]: blob})
    share = SPEC.num_layers * 2 * HEAD  # one head's keys and values of every layer
    for rank in (0, 1):
        store.read = 0
        got = _read(store, (rank, rank + 1), seal)
        assert torch.equal(got.kv, kv[:, :, rank : rank + 1, :T])
        # the header probe, then exactly the rank's heads: half the chunk's KV
        assert got.bytes_read == store.read == codec.HEADER_PROBE + share
        assert share * 2 == _kv_bytes(blob)


@pytest.mark.parametrize("old", ["format 4", "format 5"])
def test_a_chunk_without_per_head_checks_is_still_read_whole_per_layer(old):
    kv = _prompt()
    blob = _blob(kv, head_checks=False, key_tile=8 if old == "format 5" else 0)
    assert codec.read_header(blob)[0].version == {"format 4": 4, "format 5": 5}[old]
    store = _store({KEYS[0]: blob})
    got = _read(store, (1, 2))
    assert torch.equal(got.kv, kv[:, :, 1:2, :T])
    assert got.bytes_read == store.read == len(blob)  # every section whole (the probe not read again)


# -- damage and forgery ----------------------------------------------------------------------------------


def test_damage_in_one_head_fails_its_readers_only():
    kv = _prompt()
    blob = bytearray(_blob(kv))
    a, _ = _head_range(bytes(blob), 2, 1, half=1)  # layer 2, head 1's values
    blob[a + 100] ^= 0x10
    store = _store({KEYS[0]: bytes(blob)})
    assert torch.equal(_read(store, (0, 1)).kv, kv[:, :, :1, :T])  # head 0's bytes are intact
    damaged: list[str] = []
    with pytest.raises(CorruptChunkError, match="layer 2 head 1"):
        _read(store, (1, 2), damaged=damaged)
    assert damaged == [KEYS[0]]  # proven damage: the caller deletes it


@pytest.mark.parametrize("signed", [False, True])
def test_a_damaged_or_forged_head_table_fails_a_reader_by_head_only(monkeypatch, signed):
    """The head table is checked before its sums or tags are used: a flipped byte is damage; rewritten
    under a seal to keep its xxh3-64 (new sums for forged heads), its tag refuses it. A reader of every
    head never reads it."""
    preimages = SecondPreimages(monkeypatch)
    seal = SECRET if signed else None
    kv = _prompt()
    genuine = _blob(kv, seal=seal)
    header, _ = codec.read_header(genuine)
    lo, hi = codec.head_table_span(header)
    table = bytearray(genuine[lo:hi])
    table[3] ^= 0x40  # head 0 of layer 0's sum
    damaged = genuine[:lo] + bytes(table) + genuine[hi:]
    store = _store({KEYS[0]: damaged})
    assert torch.equal(_read(store, (0, 2), seal).kv, kv[:, :, :, :T])  # whole: the table is not read
    with pytest.raises(CorruptChunkError, match="head table"):
        _read(store, (1, 2), seal)
    if signed:
        preimages.keep(bytes(table), header.head_sum)  # type: ignore[attr-defined]
        with pytest.raises(UnauthenticatedChunkError, match="head table"):
            _read(store, (1, 2), seal)


def _forged(blob: bytes, preimages: SecondPreimages, layer: int, head: int, bytes_from: bytes) -> bytes:
    """`blob` with head `head` of `layer` holding `bytes_from` (its keys then values), the header kept, and
    the reader's xxh3-64 of the forged head made the genuine one's (`SecondPreimages`)."""
    header, _ = codec.read_header(blob)
    out = bytearray(blob)
    (ka, kb), (va, vb) = _head_range(blob, layer, head, 0), _head_range(blob, layer, head, 1)
    out[ka:kb], out[va:vb] = bytes_from[:HEAD], bytes_from[HEAD:]
    lo, hi = codec.head_table_span(header)
    sums = codec.read_head_checks(header, blob[lo:hi]).sums  # the table is read without the secret
    preimages.keep(bytes_from, int(sums[layer * SPEC.num_kv_heads + head]))
    return bytes(out)


def _head_bytes(blob: bytes, layer: int, head: int) -> bytes:
    (ka, kb), (va, vb) = _head_range(blob, layer, head, 0), _head_range(blob, layer, head, 1)
    return blob[ka:kb] + blob[va:vb]


def test_a_head_forged_or_spliced_under_a_seal_is_refused_by_its_tag(monkeypatch):
    """A writer without the secret keeps the signed header and rewrites head 1 of layer 1 so that its
    xxh3-64 still holds: with new KV, with another chunk's head, another head's, another layer's. The
    head's tag refuses each (a miss, nothing deleted); the other head still reads; a reader without a
    secret, checksums only, is fooled (checksums are not signatures)."""
    preimages = SecondPreimages(monkeypatch)
    kv = _prompt(seed=1)
    genuine = _blob(kv, seal=SECRET)
    other = _blob(_prompt(seed=2), seal=SECRET)  # another chunk, same secret, same key
    new_kv = torch.randn(2 * HEAD // 4).numpy().tobytes()
    sources = {
        "new KV": new_kv,
        "another chunk": _head_bytes(other, 1, 1),
        "another head": _head_bytes(genuine, 1, 0),
        "another layer": _head_bytes(genuine, 2, 1),
    }
    for what, source in sources.items():
        forged = _forged(genuine, preimages, 1, 1, source)
        store = _store({KEYS[0]: forged})
        assert torch.equal(_read(store, (0, 1), SECRET).kv, kv[:, :, :1, :T]), what
        damaged: list[str] = []
        with pytest.raises(UnauthenticatedChunkError, match="layer 1 head 1"):
            _read(store, (1, 2), SECRET, damaged=damaged)
        assert damaged == [], what  # a forgery is a miss, never deleted
    unsigned = _forged(_blob(kv), preimages, 1, 1, new_kv)
    fooled = _read(_store({KEYS[0]: unsigned}), (1, 2)).kv
    assert not torch.equal(fooled, kv[:, :, 1:2, :T])


# -- a rank's pages (the connector's cross-layout load, vLLM-free) ---------------------------------------


def _rank_pages(num_blocks: int = 16, block_size: int = 16) -> tuple[PagedCache, list[torch.Tensor]]:
    """A tp-2 rank's CPU pages (one KV head a layer), as vLLM lays them out."""
    caches = [torch.zeros(num_blocks, 1, block_size, 2 * SPEC.head_dim) for _ in range(SPEC.num_layers)]
    views = [kv_views(c, "cpu", 1, SPEC.head_dim) for c in caches]
    return PagedCache([k for k, _ in views], [v for _, v in views]), caches


@pytest.mark.parametrize("tile", [0, 16])
@pytest.mark.parametrize("head_checks", [True, False])
def test_a_tp2_rank_loads_its_half_of_whole_chunks_into_its_pages(tile, head_checks):
    """What `WorkerSide._cross_load` runs for a tp-2 rank over tp 1's chunks: a layer load of the whole
    chunks into `SectionPages` that takes the rank's head. With per-head checks it reads each chunk's
    header probe and its head's bytes only, half the KV; without, every section whole. The pages hold
    the prompt's KV of the rank's head either way."""
    kv = _prompt(chunks=3)
    k = 3 * T - 20  # the load ends inside the third chunk
    refs = [ChunkRef(j, j * T, (j + 1) * T, KEYS[j]) for j in range(3)]
    blobs = {r.key: _blob(kv, r.index, key_tile=tile, head_checks=head_checks) for r in refs}
    store = _store(blobs)
    block_ids = list(range(15, -1, -1))[: -(-k // 16)]  # pages out of order
    io = LoopThread()
    try:
        for rank in (0, 1):
            store.read = 0
            paged, caches = _rank_pages()
            writes = PageWrites(sliced(paged, (0, 1)), block_ids)
            load = LayerLoad(SPEC, store, refs, k, SectionPages(writes, (rank, rank + 1)))
            load.start(io, 10.0)
            assert all(load.wait(layer) for layer in range(SPEC.num_layers))
            load.future.result(timeout=10)
            assert not load.failed
            got = gather_chunk(caches, "cpu", block_ids, 0, k, 1, SPEC.head_dim)
            assert torch.equal(got, kv[:, :, rank : rank + 1, :k])
            share = 3 * SPEC.num_layers * 2 * HEAD
            body = sum(_kv_bytes(b) for b in blobs.values())
            assert body == 2 * share
            want = 3 * codec.HEADER_PROBE + (share if head_checks else body)
            assert load.bytes_read == store.read == want
    finally:
        io.close()


def test_a_damaged_head_fails_its_chunk_and_is_deleted_a_forged_one_is_kept(monkeypatch):
    """The same load: damage in the rank's head of chunk 1 fails chunk 1's tokens and deletes it; a head
    forged under a seal fails them too and is kept (a writer under another secret may share the
    store); damage in the other rank's head is not read at all."""
    preimages = SecondPreimages(monkeypatch)
    kv = _prompt(chunks=2)
    refs = [ChunkRef(j, j * T, (j + 1) * T, KEYS[j]) for j in range(2)]
    io = LoopThread()

    def load(blobs: dict[str, bytes], rank: int, seal=None):
        store = _store(blobs)
        paged, _ = _rank_pages()
        writes = PageWrites(sliced(paged, (0, 1)), list(range(8)))
        load = LayerLoad(SPEC, store, refs, 2 * T, SectionPages(writes, (rank, rank + 1)), seal=seal)
        load.start(io, 10.0)
        assert all(load.wait(layer) for layer in range(SPEC.num_layers))
        load.future.result(timeout=10)
        return load, store

    try:
        blobs = {r.key: _blob(kv, r.index) for r in refs}
        bad = bytearray(blobs[KEYS[1]])
        a, _ = _head_range(bytes(bad), 1, 1)
        bad[a] ^= 1
        damaged = {**blobs, KEYS[1]: bytes(bad)}
        good, store = load(damaged, rank=0)
        assert not good.failed and io.call(store.get, KEYS[1]) is not None
        failed, store = load(damaged, rank=1)
        assert failed.failed == {1} and failed.failed_ranges() == [(T, 2 * T)]
        assert io.call(store.get, KEYS[1]) is None  # deleted: the next save writes it again

        signed = {r.key: _blob(kv, r.index, seal=SECRET) for r in refs}
        forged = {**signed, KEYS[1]: _forged(signed[KEYS[1]], preimages, 1, 1, b"\x00" * 2 * HEAD)}
        refused, store = load(forged, rank=1, seal=SECRET)
        assert refused.failed == {1} and "UnauthenticatedChunkError" in " ".join(refused.errors)
        assert io.call(store.get, KEYS[1]) is not None  # a forgery is a miss, never deleted
    finally:
        io.close()


def test_an_encoded_chunk_is_read_whole_and_cut_to_the_ranks_head():
    kv = _prompt()
    blob = _blob(kv, encoding="int8")
    store = _store({KEYS[0]: blob})
    paged, caches = _rank_pages()
    block_ids = list(range(4))
    io = LoopThread()
    try:
        dest = SectionPages(PageWrites(paged, block_ids), (1, 2))
        load = LayerLoad(SPEC, store, [ChunkRef(0, 0, T, KEYS[0])], T, dest, encoding="int8")
        load.start(io, 10.0)
        assert all(load.wait(layer) for layer in range(SPEC.num_layers))
        load.future.result(timeout=10)
        body = _kv_bytes(blob)
        assert not load.failed and load.bytes_read == store.read == codec.HEADER_PROBE + body
        want = codec.decode_chunk(blob, SPEC, KEYS[0], 0, T, encoding="int8").data[:, :, 1:2]
        assert torch.equal(gather_chunk(caches, "cpu", block_ids, 0, T, 1, SPEC.head_dim), want)
    finally:
        io.close()
