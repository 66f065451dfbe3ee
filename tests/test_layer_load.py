"""`chunkio.layer_load.LayerLoad`: one load, three page destinations, and only what the engine lacks.

An engine whose own prefix cache holds tokens [0, first) of a prompt loads [first, k): the chunks that
end before `first` are not read at all, a chunk that `first` cuts is read whole (its sections are
verified whole) but only its tokens from `first` on are written, and the pages below `first` (the
engine's shared blocks) are never touched. The same for every destination: host pages filled straight
from the store, pages written from kept sections, pages written from a device buffer (the device path,
run here on the host). No vLLM needed: the pages are vLLM's layouts as tensors.
"""

from __future__ import annotations

import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.host_pages import HostPages
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import PageWrites, RowPages, SectionPages
from kvrestore.chunkio.pages import PagedCache
from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.integrations.vllm.layouts import kv_views
from kvrestore.stores import LocalStore, MemoryStore

from .paged import gather_tokens

H, D, BS, NB, L = 2, 4, 8, 12, 5
N, CHUNK = 44, 16  # chunks [0, 16), [16, 32), [32, 44)
SPEC = ModelSpec("tiny", L, H, D, 100, torch.float32, fingerprint="ab" * 16)
SHARED = -7.0  # what the engine's own cache holds in the pages below `first`


@pytest.fixture
def io():
    t = LoopThread()
    yield t
    t.close()


def _saved(store, io, key_tile: int = 0):
    kv = torch.randn(L, 2, H, N, D)
    refs = chunk_keys(list(range(N)), SPEC.fingerprint, CHUNK)
    saver = ChunkSaver(SPEC, store, io, key_tile=key_tile)
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10) and saver.written == len(refs)
    return refs, kv


def _pages(layout: str) -> list[torch.Tensor]:
    if layout == "cpu":
        return [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]
    return [torch.zeros(NB, BS, H, 2 * D).permute(0, 2, 1, 3) for _ in range(L)]  # "cuda", NHD in memory


def _paged(pages: list[torch.Tensor], layout: str) -> PagedCache:
    views = [kv_views(p, layout, H, D) for p in pages]
    return PagedCache([k for k, _ in views], [v for _, v in views])


def _load(how: str, store, refs, first: int, k: int, pages, ids, io) -> LayerLoad:
    layout = "cpu" if how == "host pages" else "cuda"
    paged = _paged(pages, layout)
    options: dict = {"layers_per_read": 2}
    if how == "host pages":
        dest = HostPages(paged, ids, first, k)
    elif how == "kept sections":
        dest = SectionPages(PageWrites(paged, ids))
    else:  # the device path, on host pages
        dest = RowPages(PageWrites(paged, ids))
        chunks = [r for r in refs if r.start < k and r.end > first]
        rows = RowPages.buffer(SPEC, chunks, 2, torch.device("cpu"))
        options |= {"rows": rows, "lane": TransferLane(StagingPool()), "device_path": True}
    load = LayerLoad(SPEC, store, refs, k, dest, first=first, **options)
    load.start(io, 10.0)
    for layer in range(L):  # as the engine asks: layer by layer
        assert load.wait(layer)
    if load.future is not None:
        load.future.result(timeout=10)
    load.cancel("the step ended")  # a no-op once every layer is placed
    return load


HOWS = ["host pages", "kept sections", "device rows"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("tile", [0, BS], ids=["row-major", "tiled-as-pages"])
@pytest.mark.parametrize("first, k", [(24, 40), (16, 40), (8, 16), (0, 40)])
def test_only_the_tokens_the_engine_lacks_are_read_and_written(tmp_path, io, how, tile, first, k):
    store = LocalStore(str(tmp_path)) if how == "host pages" else MemoryStore()
    refs, kv = _saved(store, io, key_tile=tile)
    ids = [9, 3, 11, 0, 5, 7]
    layout = "cpu" if how == "host pages" else "cuda"
    pages = _pages(layout)
    for p in pages:
        p.fill_(SHARED)
    below = [r for r in refs if r.end <= first]  # held by the engine: never read
    for r in below:  # gone from the store: a load that read them would fail
        io.call(store.delete, r.key)
    load = _load(how, store, refs, first, k, pages, ids, io)
    assert not load.failed and load.failed_ranges() == []
    read = [r for r in refs if r.start < k and r.end > first]
    assert [c.key for c in load.chunks] == [r.key for r in read]
    sections = sum(r.n_tokens for r in read) * SPEC.kv_bytes_per_token  # each read chunk read whole
    headers = sum(min(codec.HEADER_PROBE, len(io.call(store.get, r.key))) for r in read)
    assert load.bytes_read == sections + headers
    for layer in range(L):
        got = gather_tokens(pages[layer], layout, ids, 0, N, H, D)
        assert torch.equal(got[:, :, first:k], kv[layer, :, :, first:k])
        assert (got[:, :, :first] == SHARED).all()  # the engine's own pages: untouched
        assert (got[:, :, k:] == SHARED).all()


@pytest.mark.parametrize("how", HOWS)
def test_a_damaged_chunk_past_first_fails_from_its_first_token(tmp_path, io, how):
    """A chunk `first` cuts that fails its checks fails its tokens from `first` on (never the engine's own
    below it), and the object is deleted."""
    store = LocalStore(str(tmp_path)) if how == "host pages" else MemoryStore()
    refs, _ = _saved(store, io)
    blob = bytearray(io.call(store.get, refs[1].key))
    blob[-5] ^= 0xFF  # the last layer's section
    io.call(store.put, refs[1].key, bytes(blob))
    pages = _pages("cpu" if how == "host pages" else "cuda")
    load = _load(how, store, refs, 24, 40, pages, [9, 3, 11, 0, 5, 7], io)
    assert load.failed == {0} and load.failed_ranges() == [(24, 32)]  # chunk 0 of the load: refs[1]
    for deleting in load.deletes:
        deleting.result(timeout=10)
    assert io.call(store.contains, [r.key for r in refs]) == [True, False, True]


def test_a_load_must_have_the_chunks_of_what_it_loads():
    refs = chunk_keys(list(range(N)), SPEC.fingerprint, CHUNK)
    dest = SectionPages(PageWrites(_paged(_pages("cuda"), "cuda"), list(range(NB))))
    for first, k in [(0, 50), (20, 20), (30, 10)]:
        with pytest.raises(InvalidInputError, match="cover"):
            LayerLoad(SPEC, MemoryStore(), refs, k, dest, first=first)
    with pytest.raises(InvalidInputError, match="cover"):
        LayerLoad(SPEC, MemoryStore(), refs[1:], 40, dest, first=8)
