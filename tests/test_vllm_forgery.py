"""The vLLM connector's loads (no vLLM needed): with a secret, a chunk whose sections were rewritten under
its genuine signed header, keeping every non-keyed checksum (`tests/forgery.py`), fails its tokens (vLLM
recomputes them) into every page destination of a layer load (host pages filled from the store, pages
from kept sections, pages from a device buffer checked on the host or on the device path), and stays
stored; a newer release's chunk (a format version this reader does not read) fails the same way and
stays stored too."""

from __future__ import annotations

import pytest
import torch

from kvrestore.chunkio.host_pages import HostPages
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import PageWrites, RowPages, SectionPages
from kvrestore.chunkio.pages import PagedCache
from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.codec.seal import Seal
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread
from kvrestore.integrations.vllm.layouts import gather_tokens, kv_views
from kvrestore.stores import LocalStore, MemoryStore

from .forgery import SecondPreimages, forge, future_version

H, D, BS, NB, L = 2, 8, 8, 12, 3
SPEC = ModelSpec("tiny", L, H, D, 100, torch.float32, fingerprint="ef" * 16)
SECRET = b"s" * 32
K = 40  # tokens loaded: chunks [0, 16), [16, 32), [32, 40) of [32, 44)
IDS = list(range(NB))


@pytest.fixture
def io():
    t = LoopThread()
    yield t
    t.close()


@pytest.fixture
def preimages(monkeypatch):
    return SecondPreimages(monkeypatch)


def _saved(store, io, seal, key_tile=0):
    kv = torch.randn(L, 2, H, 44, D)
    refs = chunk_keys(list(range(44)), SPEC.fingerprint, 16)
    saver = ChunkSaver(SPEC, store, io, key_tile=key_tile, seal=seal)
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10) and saver.written == len(refs)
    return refs, kv


def _load(how: str, store, io, refs, seal) -> tuple[LayerLoad, list[torch.Tensor]]:
    """A layer load of [0, K) into pages through the destination `how`; the KV each layer's pages hold."""
    layout = "cpu" if how == "host pages" else "cuda"
    if layout == "cpu":
        pages = [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]
    else:  # NHD in memory, as FlashAttention's
        pages = [torch.zeros(NB, BS, H, 2 * D).permute(0, 2, 1, 3) for _ in range(L)]
    views = [kv_views(p, layout, H, D) for p in pages]
    paged = PagedCache([k for k, _ in views], [v for _, v in views])
    options: dict = {"layers_per_read": 2, "seal": seal}
    if how == "host pages":
        dest = HostPages(paged, IDS, 0, K)
    elif how == "kept sections":
        dest = SectionPages(PageWrites(paged, IDS))
    else:  # a device buffer each read lands in, checked on the host or on the device path
        dest = RowPages(PageWrites(paged, IDS))
        rows = RowPages.buffer(SPEC, [r for r in refs if r.start < K], 2, torch.device("cpu"))
        options |= {"rows": rows, "lane": TransferLane(StagingPool()), "device_path": how == "device path"}
    load = LayerLoad(SPEC, store, refs, K, dest, **options)
    load.start(io, 10.0)
    assert all(load.wait(layer) for layer in range(L))
    if load.future is not None:
        load.future.result(timeout=10)
    load.cancel("the step ended")
    for deleting in load.deletes:
        deleting.result(timeout=10)
    return load, [gather_tokens(p, layout, IDS, 0, K, H, D) for p in pages]


HOWS = ["host pages", "kept sections", "device, host-checked", "device path"]


@pytest.mark.parametrize("where", ["memory", "file"])
@pytest.mark.parametrize("key_tile", [0, BS], ids=["row-major", "tiled-as-pages"])
@pytest.mark.parametrize("how", HOWS)
def test_a_forged_chunk_fails_its_tokens_on_every_connector_path_and_stays(
    io, tmp_path, where, key_tile, how, preimages
):
    if how == "host pages" and where == "memory":
        pytest.skip("host pages are filled from a store that reads without the event loop (a file)")
    store = MemoryStore() if where == "memory" else LocalStore(str(tmp_path))
    refs, kv = _saved(store, io, Seal(SECRET), key_tile)
    for j, r in enumerate(refs):
        blob = io.call(store.get, r.key)
        io.call(store.put, r.key, forge(blob, j, preimages, layers=[1]) if j == 1 else blob)
    load, rows = _load(how, store, io, refs, Seal(SECRET))
    assert load.failed == {1} and load.failed_ranges() == [(16, 32)]
    assert "UnauthenticatedChunkError" in " ".join(load.errors)
    for layer in range(L):  # the chunk before it is placed as saved
        assert torch.equal(rows[layer][:, :, :16], kv[layer, :, :, :16])
    assert io.call(store.contains, [r.key for r in refs]) == [True, True, True]
    # the forgery keeps every non-keyed checksum: a connector without the secret loads it
    fooled, rows = _load(how, store, io, refs, None)
    assert not fooled.failed
    assert not torch.equal(rows[1][:, :, 16:32], kv[1, :, :, 16:32])


@pytest.mark.parametrize("how", HOWS)
def test_a_newer_releases_chunk_fails_its_tokens_and_stays(io, tmp_path, how):
    store = LocalStore(str(tmp_path))
    refs, kv = _saved(store, io, None)
    io.call(store.put, refs[1].key, future_version(io.call(store.get, refs[1].key)))
    load, rows = _load(how, store, io, refs, None)
    assert load.failed == {1} and "FormatVersionError" in " ".join(load.errors)
    for layer in range(L):
        assert torch.equal(rows[layer][:, :, :16], kv[layer, :, :, :16])
    assert io.call(store.contains, [r.key for r in refs]) == [True, True, True]
