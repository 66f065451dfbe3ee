"""Reads of several consecutive layers at once (`LayerReader.read_layers`, `read_plan`): what the blend's
loader does on CUDA, run here on a CPU cache through the same device path (deferred checks)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from kvrestore import codec
from kvrestore.backends.hf import HFBackend
from kvrestore.blend import Blend, chunk_key
from kvrestore.blend.chunks import save_chunk
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens, tiny_model
from .test_blend import ATOL, DropsOutStore, _chunks, _cuda_store, _defer_checks, run_blend

LAYERS = 9


@pytest.fixture(scope="module")
def deep() -> HFBackend:
    return HFBackend(tiny_model("llama", layers=LAYERS), name="tiny-llama-9")


def _cache(backend: HFBackend, n: int) -> KVCache:
    s = backend.spec
    return KVCache(s, torch.zeros((s.num_layers, 2, s.num_kv_heads, n, s.head_dim), dtype=s.dtype))


def test_read_plan_takes_the_first_layer_alone_then_a_few_at_a_time(deep):
    spec = deep.spec
    deferred = LayerReader(spec, MemoryStore(), [], defer_checks=True, layers_per_read=4)
    kv = _cache(deep, 4)
    assert deferred.read_plan(1, LAYERS, kv) == [range(1, 2), range(2, 6), range(6, 9)]
    assert deferred.read_plan(1, 2, kv) == [range(1, 2)] and deferred.read_plan(3, 3, kv) == []
    checked = LayerReader(spec, MemoryStore(), [], defer_checks=False, layers_per_read=4)
    assert checked.read_plan(1, 4, kv) == [range(1, 2), range(2, 3), range(3, 4)]  # host checks: one by one


@pytest.mark.parametrize("kind", ["memory", "file", "async-store"])
@pytest.mark.parametrize("per_read,ahead", [(4, 8), (3, 2)], ids=["4-per-read", "3-per-read-2-ahead"])
def test_grouped_reads_give_the_same_blend(deep, kind, per_read, ahead, tmp_path: Path, monkeypatch):
    """Layers read a few at a time (one span per chunk, one checksum call, one placement per chunk,
    one re-rotation) give the KV, logits and selections of the per-layer host-checked reads; with
    `ahead` below a read's size each read waits for the one before it, and the result is the same."""
    chunks = _chunks([40, 17, 64], seed=60)
    suffix = random_tokens(6, 256, seed=63)
    order = [chunks[2], chunks[0], chunks[1]]
    want = run_blend(deep, order, suffix, Blend(recompute_ratio=0.3), saved=chunks)
    _defer_checks(monkeypatch, layers_per_read=per_read, ahead=ahead)
    got = run_blend(
        deep, order, suffix, Blend(recompute_ratio=0.3), store=_cuda_store(kind, tmp_path), saved=chunks
    )
    assert got.stats.loaded_chunks == 3 and not got.stats.errors and got.stats.restarts == 0
    torch.testing.assert_close(got.kv.data, want.kv.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    assert got.stats.recomputed == want.stats.recomputed
    assert got.stats.bytes_loaded == want.stats.bytes_loaded  # the same sections, fewer reads
    assert all(s >= 0 for s in got.stats.load_seconds) and got.stats.load_seconds[0] == 0.0


def _damage_layer(blob: bytes, layer: int) -> bytes:
    header, _ = codec.read_header(blob)
    section = header.layers[layer]
    out = bytearray(blob)
    out[section.offset + section.length // 2] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize("layer", [1, 4, 8], ids=["alone", "inside-a-read", "last-read"])
def test_a_damaged_layer_inside_a_read_restarts_without_the_chunk(deep, layer, monkeypatch):
    """A damaged section in any layer of a multi-layer read is found by the deferred device checks: the
    blend restarts with that chunk recomputed, the object is deleted, the KV equals a full prefill."""
    chunks = _chunks([30, 26], seed=70)
    suffix = random_tokens(4, 256, seed=72)
    store = MemoryStore()

    async def damage() -> str:
        key = (await save_chunk(deep, store, chunks[1]))[0]
        await save_chunk(deep, store, chunks[0])
        await store.put(key, _damage_layer(await store.get(key), layer))
        return key

    key = anyio.run(damage)
    _defer_checks(monkeypatch)
    res = run_blend(deep, chunks, suffix, Blend(recompute_ratio=0.0), store=store, saved=[])
    assert res.stats.missing_chunks == [1] and res.stats.restarts == 1
    assert any(f"layer {layer}: device checksum mismatch" in e for e in res.stats.errors)
    assert anyio.run(store.contains, [key]) == [False]
    full = deep.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("defer", [False, True], ids=["host-checked", "device-path"])
def test_read_layers_places_what_read_layer_places(deep, defer):
    """`read_layers` over a span of layers, on the host-checked path (each section decoded from the
    span) and on the device path, places the same KV as one `read_layer` call per layer; a damaged
    section in the span names its layer, and the other chunk's layers are placed."""
    store = MemoryStore()
    chunks = _chunks([12, 20], seed=80)

    async def go() -> tuple[KVCache, KVCache, ChunkLoadFailed, KVCache]:
        keys = [(await save_chunk(deep, store, c))[0] for c in chunks]
        stored = [
            ChunkRef(j, 0, len(c), k, at=o)
            for j, (k, o, c) in enumerate(zip(keys, [0, 12], chunks, strict=True))
        ]
        one, many = _cache(deep, 32), _cache(deep, 32)
        a = LayerReader(deep.spec, store, stored, defer_checks=defer)
        b = LayerReader(deep.spec, store, stored, defer_checks=defer)
        await a.open()
        await b.open()
        for layer in range(2, 7):
            await a.read_layer(layer, one)
        opened = b.bytes_read
        assert (
            await b.read_layers(range(2, 7), many) == a.bytes_read - opened and b.bytes_read == a.bytes_read
        )
        await store.put(keys[1], _damage_layer(await store.get(keys[1]), 5))
        c = LayerReader(deep.spec, store, stored, defer_checks=defer)
        await c.open()
        damaged = _cache(deep, 32)
        with pytest.raises(ChunkLoadFailed) as caught:
            await c.read_layers(range(3, 7), damaged)
            await c.verify()
        return one, many, caught.value, damaged

    one, many, failed, damaged = anyio.run(go)
    torch.testing.assert_close(many.data, one.data, atol=0, rtol=0)
    assert (
        many.data[2:7].abs().sum() > 0 and many.data[7:].abs().sum() == 0 and many.data[:2].abs().sum() == 0
    )
    assert failed.indices == [1] and "layer 5" in failed.error
    torch.testing.assert_close(damaged.data[3:7, :, :, :12], one.data[3:7, :, :, :12], atol=0, rtol=0)


def test_a_store_that_drops_out_inside_a_read_degrades_to_recompute(deep, monkeypatch):
    """Chunk 1's reads fail from its second read on (layers 2-5): the blend restarts with that chunk's
    tokens recomputed and the KV equals a full prefill; the error names the read's layers."""
    chunks = _chunks([300, 300], seed=90)
    suffix = random_tokens(3, 256, seed=92)
    store = DropsOutStore(ok_reads=1)
    store.key = chunk_key(deep, chunks[1])
    _defer_checks(monkeypatch)
    res = run_blend(deep, chunks, suffix, Blend(recompute_ratio=0.0), store=store)
    assert res.stats.missing_chunks == [1] and res.stats.restarts == 1 and res.stats.loaded_chunks == 1
    assert any("layers 2-5" in e and "ConnectionResetError" in e for e in res.stats.errors)
    full = deep.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)


def test_a_truncated_object_inside_a_read_degrades_to_recompute(deep, monkeypatch):
    """An object cut short in layer 4's section: the read of layers 2-5 finds the span short, the chunk
    is recomputed, the object deleted, and the KV equals a full prefill."""
    chunks = _chunks([30, 26], seed=94)
    suffix = random_tokens(4, 256, seed=96)
    store = MemoryStore()

    async def cut() -> str:
        key = (await save_chunk(deep, store, chunks[1]))[0]
        await save_chunk(deep, store, chunks[0])
        blob = await store.get(key)
        section = codec.read_header(blob)[0].layers[4]
        await store.put(key, blob[: section.offset + section.length // 2])
        return key

    key = anyio.run(cut)
    _defer_checks(monkeypatch)
    res = run_blend(deep, chunks, suffix, Blend(recompute_ratio=0.0), store=store, saved=[])
    assert res.stats.missing_chunks == [1] and res.stats.restarts == 1
    assert any("layers 2-5" in e and "TruncatedChunkError" in e for e in res.stats.errors)
    assert anyio.run(store.contains, [key]) == [False]
    full = deep.prefill_chunk(res.tokens, None, 0).data
    torch.testing.assert_close(res.kv.data, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_device_read_of_many_chunks_places_what_the_host_path_places(deep, where, tmp_path: Path):
    """The device path (run here on a CPU cache) stages every span of a read in one buffer, sends it up
    in one copy, and places each run of consecutive chunks of one length with one copy: four chunks of
    8 tokens and a partial one of 5, one of them damaged in the middle of the run, from memory (the
    spans fetched) and from a file (read into the staging buffer), place exactly what the host-checked
    path places; the damaged chunk is named and its rows are left as they were."""
    from kvrestore.stores.local import LocalStore

    store = MemoryStore() if where == "memory" else LocalStore(str(tmp_path))
    lengths = [8, 8, 8, 8, 5]
    chunks = _chunks(lengths, seed=90)
    offsets = [0, 8, 16, 24, 32]

    async def go(defer: bool, damage: bool) -> tuple[KVCache, list[int]]:
        keys = [(await save_chunk(deep, store, c, overwrite=True))[0] for c in chunks]
        if damage:
            await store.put(keys[2], _damage_layer(await store.get(keys[2]), 4))
        stored = [
            ChunkRef(j, 0, n, k, at=o) for j, (k, o, n) in enumerate(zip(keys, offsets, lengths, strict=True))
        ]
        kv = _cache(deep, 37)
        reader = LayerReader(deep.spec, store, stored, defer_checks=defer)
        await reader.open()
        failed: list[int] = []
        try:
            await reader.read_layers(range(3, 7), kv)
            await reader.verify()
        except ChunkLoadFailed as exc:
            failed = exc.indices
        return kv, failed

    host, none = anyio.run(go, False, False)
    device, also_none = anyio.run(go, True, False)
    assert none == also_none == []
    torch.testing.assert_close(device.data, host.data, atol=0, rtol=0)
    assert all(host.data[3:7, :, :, o].abs().sum() > 0 for o in [0, 8, 16, 24, 32, 36])
    assert host.data[:3].abs().sum() == 0 and host.data[7:].abs().sum() == 0
    damaged, failed = anyio.run(go, True, True)
    assert failed == [2]
    for a, b in [(0, 16), (24, 37)]:  # the chunks around it, placed as one run each side
        torch.testing.assert_close(damaged.data[3:7, :, :, a:b], host.data[3:7, :, :, a:b], atol=0, rtol=0)


def test_a_read_launches_as_many_copies_for_sixteen_chunks_as_for_four(deep):
    """The device path's host calls do not grow with the chunks of a read: their spans share one staging
    buffer and one upload, and consecutive chunks of one length are placed with one copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.n += func.overloadpacket.__name__ == "copy_"
            return func(*args, **(kwargs or {}))

    counted: list[int] = []

    class Counting(LayerReader):
        def _upload_layers(self, layers, sections, kv):  # type: ignore[no-untyped-def]
            with Copies() as mode:
                bad = super()._upload_layers(layers, sections, kv)
            counted.append(mode.n)
            return bad

    async def read(n_chunks: int) -> int:
        store = MemoryStore()
        chunks = _chunks([8] * n_chunks, seed=100)
        keys = [(await save_chunk(deep, store, c))[0] for c in chunks]
        stored = [ChunkRef(i, 0, 8, k, at=8 * i) for i, k in enumerate(keys)]
        reader = Counting(deep.spec, store, stored, defer_checks=True)
        await reader.open()
        await reader.read_layers(range(2, 4), _cache(deep, 8 * n_chunks))
        await reader.verify()
        return counted[-1]

    assert anyio.run(read, 4) == anyio.run(read, 16) == 2  # one upload, one placement


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["pinned-memory", "file"])
def test_a_device_layer_load_on_cuda_places_the_stored_kv(deep, kind, tmp_path: Path):
    """The vLLM connector's load into CUDA pages (a `LayerLoad` into `RowPages`) on a CUDA stream of its
    own, from a pinned memory store (its objects go up as they lie) and from files (through the shared
    staging): each layer's rows equal the stored KV, and a damaged chunk stops the rows of the layers
    read after the damage showed at its first token."""
    from kvrestore.chunkio.layer_load import LayerLoad
    from kvrestore.chunkio.page_dest import RowPages
    from kvrestore.chunkio.pool import StagingPool
    from kvrestore.chunkio.save import ChunkSaver
    from kvrestore.chunkio.transfer import TransferLane
    from kvrestore.core.keys import chunk_keys
    from kvrestore.core.kv import KVChunk
    from kvrestore.core.sync import LoopThread as IOThread

    spec, n, chunk = deep.spec, 72, 16
    store = _cuda_store("pinned-memory" if kind == "pinned-memory" else "file", tmp_path)
    io = IOThread()
    try:
        kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, n, spec.head_dim)
        refs = chunk_keys(list(range(n)), spec.fingerprint, chunk)
        saver = ChunkSaver(spec, store, io)
        for r in refs:
            assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
        assert saver.flush(timeout=30) and saver.written == len(refs)
        chunks = refs
        stream = torch.cuda.Stream()

        class Handed:  # page writes (`page_dest.Writes`) that keep each layer's rows
            queues = False

            def __init__(self) -> None:
                self.placed: dict[int, torch.Tensor] = {}

            def put(self, layer: int, pieces) -> None:
                with torch.cuda.stream(stream):
                    self.placed[layer] = pieces[0].kv().clone()

            def flush(self, layer: int) -> None:
                pass

        def load() -> tuple[LayerLoad, dict[int, torch.Tensor]]:
            handed = Handed()
            got = LayerLoad(
                spec,
                store,
                chunks,
                n,
                RowPages(handed),  # type: ignore[arg-type]
                layers_per_read=2,
                rows=RowPages.buffer(spec, chunks, 2, torch.device("cuda"), stream),
                lane=TransferLane(StagingPool(pinned=True), stream),
            )
            got.start(io, 30.0)
            assert all(got.wait(layer) for layer in range(spec.num_layers))
            got.future.result(timeout=30)
            stream.synchronize()
            return got, handed.placed

        good, placed = load()
        assert not good.failed and sorted(placed) == list(range(spec.num_layers))
        for layer, rows in placed.items():
            assert torch.equal(rows.cpu(), kv[layer])
        blob = bytearray(io.call(store.get, refs[2].key))
        blob[-5] ^= 0xFF  # the last layer's section
        io.call(store.put, refs[2].key, bytes(blob))
        bad, placed = load()
        assert bad.failed == {2}
        last = spec.num_layers - 1
        assert torch.equal(placed[last].cpu(), kv[last, :, :, :32])
    finally:
        io.close()


def test_a_device_read_from_files_fails_a_cut_or_vanished_chunk_and_places_the_rest(deep, tmp_path: Path):
    """Files read into the shared staging buffer: one object cut short inside the read's span and one
    deleted after the headers were read are named (the cut one deleted from the store); the chunks
    around them are placed exactly."""
    from kvrestore.stores.local import LocalStore

    store = LocalStore(str(tmp_path))
    chunks = _chunks([8] * 5, seed=110)

    async def go(damage: bool) -> tuple[KVCache, list[int], list[str], bool]:
        keys = [(await save_chunk(deep, store, c, overwrite=True))[0] for c in chunks]
        stored = [ChunkRef(i, 0, 8, k, at=8 * i) for i, k in enumerate(keys)]
        reader = LayerReader(deep.spec, store, stored, device_path=True)
        await reader.open()
        if damage:
            blob = await store.get(keys[1])
            section = codec.read_header(blob)[0].layers[4]
            await store.put(keys[1], blob[: section.offset + section.length // 2])
            await store.delete(keys[3])
        kv = _cache(deep, 40)
        failed: list[int] = []
        try:
            await reader.read_layers(range(3, 6), kv)
        except ChunkLoadFailed as exc:
            failed = exc.indices
        return kv, failed, reader.errors, (await store.contains([keys[1]]))[0]

    whole, none, _, _ = anyio.run(go, False)
    assert none == [] and whole.data[3:6].abs().sum() > 0
    kv, failed, errors, cut_kept = anyio.run(go, True)
    assert failed == [1, 3] and not cut_kept
    assert any("TruncatedChunkError" in e for e in errors) and any("MissingChunkError" in e for e in errors)
    for j in (0, 2, 4):
        torch.testing.assert_close(
            kv.data[3:6, :, :, 8 * j : 8 * j + 8], whole.data[3:6, :, :, 8 * j : 8 * j + 8]
        )
