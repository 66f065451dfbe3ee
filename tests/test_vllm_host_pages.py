"""`chunkio.host_pages.HostPages`: stored chunks read straight into vLLM's host pages ("cpu" layout),
checked against the pages `scatter_tokens` writes and the backend reads. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.host_pages import CompressedChunkError, HostPages, _ChunkPlan
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.pages import PagedCache
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread as IOThread
from kvrestore.integrations.vllm.layouts import applies, kv_views
from kvrestore.stores import LocalStore, MemoryStore, ThrottledStore

from .paged import gather_tokens

H, D, BS, NB, L = 2, 4, 8, 12, 5


def _spec(dtype: torch.dtype = torch.float32) -> ModelSpec:
    return ModelSpec("tiny", L, H, D, 100, dtype, fingerprint="ef" * 16)


@pytest.fixture
def io():
    t = IOThread()
    yield t
    t.close()


def _saved(store, io, spec, n=44, chunk=16, compression="none", key_tile=0):
    """A prompt of `n` tokens saved in chunks (the last one partial); (chunks, its KV [L, 2, H, n, D]).
    With `key_tile`, the whole chunks' keys are stored in tiles of that many tokens (`codec.layout`)."""
    kv = torch.randn(L, 2, H, n, D).to(spec.dtype)
    refs = chunk_keys(list(range(n)), spec.fingerprint, chunk)
    saver = ChunkSaver(spec, store, io, compression=compression, key_tile=key_tile)
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10) and saver.written == len(refs)
    return refs, kv


def _pages(spec):
    return [torch.zeros(NB, H, BS, 2 * D, dtype=spec.dtype) for _ in range(L)]


def _host_pages(pages, ids, k) -> HostPages:
    views = [kv_views(p, "cpu", H, D) for p in pages]
    return HostPages(PagedCache([k_ for k_, _ in views], [v for _, v in views]), ids, 0, k)


def _load(store, io, spec, chunks, k, pages, ids):
    load = LayerLoad(spec, store, chunks, k, _host_pages(pages, ids, k), layers_per_read=2)
    load.start(io)
    for layer in range(L):  # as vLLM asks: layer by layer
        assert load.wait(layer)
    load.cancel("the step ended")  # what the worker does after every step: a no-op once all is read
    return load


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [40, 32, 8])
@pytest.mark.parametrize("ids", [[9, 3, 11, 0, 5, 7], [2, 3, 4, 5, 6, 7]], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("tile", [0, BS, 4], ids=["row-major", "tiled-as-pages", "other-tiles"])
def test_a_load_puts_each_token_where_the_backend_reads_it_and_nothing_else(
    tmp_path, io, dtype, k, ids, tile, monkeypatch
):
    """Tokens [0, k) land in the request's pages (in or out of order, the last chunk partial, cut at k),
    keys transposed as the backend keeps them; no other slot is written, and the bytes read are the
    chunks' whole sections (each verified). Keys stored a page to a tile go straight into the pages,
    never through staging; keys in other tiles are converted."""
    spec = _spec(dtype)
    store = LocalStore(str(tmp_path))
    chunks, kv = _saved(store, io, spec, key_tile=tile)
    staged: list[int] = []
    original = _ChunkPlan.place_keys
    monkeypatch.setattr(
        _ChunkPlan, "place_keys", lambda self, *a: (staged.append(self.n), original(self, *a))
    )
    # 6 pages of 8 for the 44 tokens; consecutive whole pages take their keys in one copy
    pages = _pages(spec)
    load = _load(store, io, spec, chunks, k, pages, ids)
    assert not load.failed and load.failed_ranges() == [] and load.seconds is not None
    used = [c for c in chunks if c.start < k]
    headers = sum(min(codec.HEADER_PROBE, len(io.call(store.get, c.key))) for c in used)  # read first
    assert load.bytes_read == sum(c.end - c.start for c in used) * spec.kv_bytes_per_token + headers
    for layer in range(L):
        assert torch.equal(gather_tokens(pages[layer], "cpu", ids, 0, k, H, D), kv[layer, :, :, :k])
        untouched = [b for b in range(NB) if b not in ids[: -(-k // BS)]]
        assert not pages[layer][untouched].any()
        if k % BS:  # the rest of the last page holds nothing loaded
            assert not gather_tokens(pages[layer], "cpu", ids, k, -(-k // BS) * BS, H, D).any()
    # the last chunk (12 tokens) is not of whole tiles: its keys are row-major, through staging
    whole = [c for c in used if c.end - c.start == 16]
    assert len(staged) == L * len(used) - (L * len(whole) if tile == BS else 0)


def test_a_memory_store_loads_the_same(io):
    spec = _spec()
    store = MemoryStore()
    chunks, kv = _saved(store, io, spec)
    ids = list(range(NB))[::-1]
    pages = _pages(spec)
    load = _load(store, io, spec, chunks, 40, pages, ids)
    assert not load.failed
    for layer in range(L):
        assert torch.equal(gather_tokens(pages[layer], "cpu", ids, 0, 40, H, D), kv[layer, :, :, :40])


@pytest.mark.parametrize("where", ["header", "first layer", "last layer", "truncated"])
@pytest.mark.parametrize("tile", [0, BS], ids=["row-major", "tiled-as-pages"])
def test_a_damaged_chunk_fails_its_tokens_only_and_is_deleted(tmp_path, io, where, tile):
    """Damage anywhere (a key read straight into the pages included) fails the chunk: vLLM recomputes
    its tokens whatever its pages hold."""
    spec = _spec()
    store = LocalStore(str(tmp_path))
    chunks, kv = _saved(store, io, spec, key_tile=tile)
    blob = bytearray(io.call(store.get, chunks[1].key))
    first = codec.read_header(bytes(blob))[0].layers[0].offset
    if where == "truncated":
        blob = blob[:-3]
    elif where == "header":
        blob[10] ^= 0xFF
    else:
        blob[-5 if where == "last layer" else first + 3] ^= 0xFF
    io.call(store.put, chunks[1].key, bytes(blob))
    ids = list(range(NB))
    pages = _pages(spec)
    load = _load(store, io, spec, chunks, 40, pages, ids)
    assert load.failed == {1} and load.failed_ranges() == [(16, 32)]
    for layer in range(L):  # the chunks before and after it are placed
        assert torch.equal(gather_tokens(pages[layer], "cpu", ids, 0, 16, H, D), kv[layer, :, :, :16])
        assert torch.equal(gather_tokens(pages[layer], "cpu", ids, 32, 40, H, D), kv[layer, :, :, 32:40])
    for deleting in load.deletes:  # deleted in the background: done once these have finished
        deleting.result(timeout=10)
    assert io.call(store.contains, [c.key for c in chunks]) == [True, False, True]


def test_a_missing_chunk_and_a_store_fault_fail_without_raising(tmp_path, io):
    spec = _spec()
    store = LocalStore(str(tmp_path))
    chunks, _ = _saved(store, io, spec)
    io.call(store.delete, chunks[0].key)
    load = _load(store, io, spec, chunks, 40, _pages(spec), list(range(NB)))
    assert load.failed == {0} and "MissingChunkError" in load.errors[0]

    class Broken(LocalStore):
        def scatter_into_sync(self, key, offset, buffers):
            raise OSError("input/output error")

    broken = Broken(str(tmp_path))
    load = _load(broken, io, spec, chunks, 40, _pages(spec), list(range(NB)))
    assert load.failed == {0, 1, 2} and "input/output error" in load.errors[0]


def test_a_compressed_chunk_is_left_for_the_other_load(tmp_path, io):
    """A chunk stored compressed is not read straight into pages: it fails (recomputed) and stays."""
    spec = _spec()
    store = LocalStore(str(tmp_path))
    chunks, _ = _saved(store, io, spec, compression="zstd")
    load = _load(store, io, spec, chunks, 40, _pages(spec), list(range(NB)))
    assert load.failed == {0, 1, 2}
    assert CompressedChunkError.__name__ in load.errors[0]
    assert all(io.call(store.contains, [c.key for c in chunks]))


def test_a_load_not_read_to_the_end_fails_every_chunk(tmp_path, io):
    spec = _spec()
    store = LocalStore(str(tmp_path))
    chunks, _ = _saved(store, io, spec)
    load = LayerLoad(spec, store, chunks, 40, _host_pages(_pages(spec), list(range(NB)), 40))
    load.start(io)
    assert load.wait(0)
    load.cancel("the step ended")
    assert load.failed == {0, 1, 2} and load.seconds is None


def test_where_it_applies(tmp_path):
    local, memory = LocalStore(str(tmp_path)), MemoryStore()
    assert applies(local, "cpu", "native", "none") and applies(memory, "cpu", "native", "none")
    assert not applies(local, "cuda", "native", "none")
    assert not applies(local, "cpu", "int8", "none")
    assert not applies(local, "cpu", "native", "zstd")
    assert not applies(ThrottledStore(local, 1e9), "cpu", "native", "none")  # reads through its loop
