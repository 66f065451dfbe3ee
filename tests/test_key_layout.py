"""Chunks whose keys the writer stored in tiles (`codec.layout`, format 5: what the vLLM connector writes
from vLLM's CPU pages): every reader gets the same KV as from a format-4 chunk, verified before use,
and a damaged one is never placed. A format-4 chunk is written as it always was."""

from __future__ import annotations

import zlib

import anyio
import msgspec
import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader
from kvrestore.chunkio.load import ChunkLoader
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import CorruptChunkError, InvalidInputError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.stores import LocalStore, MemoryStore

SPEC = ModelSpec("tiny", 3, 2, 4, 100, torch.float32, fingerprint="cd" * 16)
T = 16  # tokens per chunk
KEYS = [f"{j:x}" * 32 for j in range(10, 13)]


def _prompt(chunks: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(
        SPEC.num_layers,
        2,
        SPEC.num_kv_heads,
        chunks * T,
        SPEC.head_dim,
        generator=torch.Generator().manual_seed(seed),
    )


def _blob(kv: torch.Tensor, j: int, tile: int, **kw) -> bytes:
    return codec.encode_chunk(
        KVChunk(j * T, kv[:, :, :, j * T : (j + 1) * T].clone()), SPEC, KEYS[j], key_tile=tile, **kw
    )


def test_a_tiled_section_holds_each_page_of_keys_column_major_and_the_values_as_always():
    kv = _prompt(1)
    blob = _blob(kv, 0, 8)
    header, _ = codec.read_header(blob)
    assert (header.version, codec.key_tile(header)) == (codec.FORMAT_VERSION, 8)
    s = header.layers[1]
    section = torch.frombuffer(bytearray(blob[s.offset : s.offset + s.length]), dtype=torch.float32)
    keys, values = section.view(2, -1)
    assert torch.equal(keys.view(2, 2, 4, 8)[1, 1], kv[1, 0, 1, 8:16].T)  # head 1, tokens 8-15: [D, 8]
    assert torch.equal(values.view(2, T, 4), kv[1, 1])


def test_a_chunk_without_a_layout_is_format_4_byte_for_byte():
    kv = _prompt(1)
    tiled, _ = codec.read_header(_blob(kv, 0, 8, head_checks=False))
    assert (tiled.version, codec.key_tile(tiled)) == (codec.TILED_VERSION, 8)  # format 5 as it was
    blob = _blob(kv, 0, 0, head_checks=False)
    header, _ = codec.read_header(blob)
    assert header.version == codec.PLAIN_VERSION and codec.key_tile(header) == 0
    assert type(header) is codec.ChunkHeader and "key_tile" not in codec.chunk._ENCODER.encode(header).decode(
        "latin-1"
    )


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("signed", [False, True])
def test_a_whole_tiled_chunk_decodes_to_the_kv_it_was_saved_from(compression, signed):
    seal = Seal(b"s" * 16) if signed else None
    kv = _prompt(1)
    blob = _blob(kv, 0, 4, compression=compression, seal=seal)
    assert torch.equal(codec.decode_chunk(blob, SPEC, KEYS[0], 0, T, seal=seal).data, kv)


def test_tiles_that_do_not_divide_the_chunk_are_refused_as_damage():
    kv = _prompt(1)
    with pytest.raises(InvalidInputError, match="whole tiles"):
        _blob(kv, 0, 5)
    header, end = codec.read_header(_blob(kv, 0, 8))
    bad = msgspec.structs.replace(header, key_tile=5)
    raw = codec.chunk._ENCODER.encode(bad)
    blob = codec.chunk._PREFIX.pack(codec.MAGIC, len(raw), zlib.crc32(raw)) + raw
    with pytest.raises(CorruptChunkError, match="key tiles"):
        codec.read_header(blob)


def _store(kind: str, tmp_path, kv: torch.Tensor, tile: int):
    store = MemoryStore() if kind == "memory" else LocalStore(str(tmp_path))
    for j in range(kv.shape[3] // T):
        anyio.run(store.put, KEYS[j], _blob(kv, j, tile))
    return store


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("tile", [0, 4, 16])
def test_a_restore_load_reads_a_tiled_chunk_as_the_kv_it_was_saved_from(tmp_path, kind, tile, device):
    """`ChunkLoader` (what a `Restorer`'s load lanes run): async, and blocking with `fetch_sync` then `place`; into a
    GPU cache the sections go up as stored, are checked there and turned row-major there."""
    kv = _prompt()
    store = _store(kind, tmp_path, kv, tile)
    loader = ChunkLoader(SPEC, store)
    for j in range(3):
        dest = torch.zeros(SPEC.num_layers, 2, SPEC.num_kv_heads, T, SPEC.head_dim, device=device)
        anyio.run(loader.load, KEYS[j], j * T, dest)
        assert torch.equal(dest.cpu(), kv[:, :, :, j * T : (j + 1) * T])
        if store.reads_sync:
            dest.zero_()
            loader.fetch_sync(KEYS[j], j * T, dest).place()
            assert torch.equal(dest.cpu(), kv[:, :, :, j * T : (j + 1) * T])
    if device == "cuda":  # a damaged key is caught by the device checksum, never placed as KV
        blob = bytearray(anyio.run(store.get, KEYS[1]))
        blob[codec.read_header(bytes(blob))[0].layers[0].offset + 5] ^= 0xFF
        anyio.run(store.put, KEYS[1], bytes(blob))
        with pytest.raises(CorruptChunkError):
            anyio.run(loader.load, KEYS[1], T, torch.zeros_like(dest))


@pytest.mark.parametrize("path", ["host", "device-path", "deferred", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_layer_reads_of_tiled_chunks_place_the_kv_and_fail_a_damaged_one(tmp_path, kind, path):
    """`LayerReader` on a CPU cache: checked on the host, through the device path (checked per read),
    and with deferred checks. A chunk damaged in a key tile is named and never counts as placed."""
    kv = _prompt()
    store = _store(kind, tmp_path, kv, 8)
    stored = [ChunkRef(j, j * T, (j + 1) * T, KEYS[j]) for j in range(3)]

    async def read(damage: bool) -> tuple[KVCache, list[int]]:
        if damage:
            blob = bytearray(await store.get(KEYS[1]))
            blob[codec.read_header(bytes(blob))[0].layers[1].offset + 5] ^= 0xFF  # a key of layer 1
            await store.put(KEYS[1], bytes(blob))
        reader = LayerReader(
            SPEC, store, stored, defer_checks=path == "deferred", device_path=path == "device-path"
        )
        await reader.open()
        out = KVCache.empty(SPEC, 3 * T, device="cuda" if path == "cuda" else "cpu")
        out.data.zero_()
        failed: list[int] = []
        for layers in reader.read_plan(0, SPEC.num_layers, out):
            try:
                await reader.read_layers(layers, out)
            except ChunkLoadFailed as exc:
                failed += exc.indices
        try:
            await reader.verify()
        except ChunkLoadFailed as exc:
            failed += exc.indices
        return out, failed

    whole, failed = anyio.run(read, False)
    assert failed == [] and torch.equal(whole.data.cpu(), kv)
    damaged, failed = anyio.run(read, True)
    assert failed == [1]
    for j in (0, 2):
        assert torch.equal(damaged.data[..., j * T : (j + 1) * T, :].cpu(), kv[..., j * T : (j + 1) * T, :])
    assert not anyio.run(store.contains, [KEYS[1]])[0]  # deleted: proven damaged
