"""The vLLM connector's loads (no vLLM needed): with a secret, a chunk whose sections were rewritten under
its genuine signed header, keeping every non-keyed checksum (`tests/forgery.py`), fails its tokens (vLLM
recomputes them) on the host-page, layer and device paths, and stays stored; a newer release's chunk
(a format version this reader does not read) fails the same way and stays stored too."""

from __future__ import annotations

import pytest
import torch

from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.codec.seal import Seal
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.integrations.vllm_device import DeviceLayerLoad
from kvrestore.integrations.vllm_io import ChunkSaver, IOThread, LoadChunk
from kvrestore.integrations.vllm_layout import gather_tokens
from kvrestore.integrations.vllm_load import LayerLoad
from kvrestore.integrations.vllm_pages import HostLayer, HostPageLoad
from kvrestore.stores import LocalStore, MemoryStore

from .forgery import SecondPreimages, forge, future_version

H, D, BS, NB, L = 2, 8, 8, 12, 3
SPEC = ModelSpec("tiny", L, H, D, 100, torch.float32, fingerprint="ef" * 16)
SECRET = b"s" * 32
K = 40  # tokens loaded: chunks [0, 16), [16, 32), [32, 40) of [32, 44)


@pytest.fixture
def io():
    t = IOThread()
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
    return [LoadChunk(r.key, r.start, r.end) for r in refs], kv


def _host_pages(store, io, chunks, seal):
    pages = [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]
    load = HostPageLoad(SPEC, store, chunks, K, [HostLayer(p, H, D) for p in pages], range(NB), 2, seal)
    load.start(io)
    assert all(load.wait(layer) for layer in range(L))
    load.cancel("the step ended")
    for deleting in load.deletes:
        deleting.result(timeout=10)
    return load, [gather_tokens(p, "cpu", list(range(NB)), 0, K, H, D) for p in pages]


def _layers(store, io, chunks, seal):
    placed: dict[int, torch.Tensor] = {}

    def place(layer, pieces):
        placed[layer] = torch.cat([p.kv() for p in pieces], dim=2)

    load = LayerLoad(SPEC, store, chunks, K, place, layers_per_read=2, seal=seal)
    load.start(io, 10.0)
    assert all(load.wait(layer) for layer in range(L))
    load.future.result(timeout=10)
    return load, [placed[layer] for layer in range(L)]


def _device(device_path):
    def run(store, io, chunks, seal):
        placed: dict[int, torch.Tensor] = {}
        load = DeviceLayerLoad(
            SPEC,
            store,
            chunks,
            K,
            lambda layer, rows: placed.__setitem__(layer, rows.clone()),
            TransferLane(StagingPool()),
            torch.device("cpu"),
            device_path=device_path,
            seal=seal,
        )
        load.start(io, 10.0)
        assert all(load.wait(layer) for layer in range(L))
        load.future.result(timeout=10)
        return load, [placed[layer] for layer in range(L)]

    return run


LOADS = {
    "host pages": _host_pages,
    "layers": _layers,
    "device, host-checked": _device(False),
    "device path": _device(True),
}


@pytest.mark.parametrize("where", ["memory", "file"])
@pytest.mark.parametrize("key_tile", [0, BS], ids=["row-major", "tiled-as-pages"])
@pytest.mark.parametrize("path", list(LOADS))
def test_a_forged_chunk_fails_its_tokens_on_every_connector_path_and_stays(
    io, tmp_path, where, key_tile, path, preimages
):
    if path == "host pages" and where == "memory" and key_tile:
        pytest.skip("the same reads as from a file")
    store = MemoryStore() if where == "memory" else LocalStore(str(tmp_path))
    chunks, kv = _saved(store, io, Seal(SECRET), key_tile)
    for j, c in enumerate(chunks):
        blob = io.call(store.get, c.key)
        io.call(store.put, c.key, forge(blob, j, preimages, layers=[1]) if j == 1 else blob)
    load, rows = LOADS[path](store, io, chunks, Seal(SECRET))
    assert load.failed == {1} and load.failed_ranges() == [(16, 32)]
    assert "UnauthenticatedChunkError" in " ".join(load.errors)
    for layer in range(L):  # the chunk before it is placed as saved
        assert torch.equal(rows[layer][:, :, :16], kv[layer, :, :, :16])
    assert io.call(store.contains, [c.key for c in chunks]) == [True, True, True]
    # the forgery keeps every non-keyed checksum: a connector without the secret loads it
    fooled, rows = LOADS[path](store, io, chunks, None)
    assert not fooled.failed
    assert not torch.equal(rows[1][:, :, 16:32], kv[1, :, :, 16:32])


@pytest.mark.parametrize("path", list(LOADS))
def test_a_newer_releases_chunk_fails_its_tokens_and_stays(io, tmp_path, path):
    store = LocalStore(str(tmp_path))
    chunks, kv = _saved(store, io, None)
    io.call(store.put, chunks[1].key, future_version(io.call(store.get, chunks[1].key)))
    load, rows = LOADS[path](store, io, chunks, None)
    assert load.failed == {1} and "FormatVersionError" in " ".join(load.errors)
    for layer in range(L):
        assert torch.equal(rows[layer][:, :, :16], kv[layer, :, :, :16])
    assert io.call(store.contains, [c.key for c in chunks]) == [True, True, True]
