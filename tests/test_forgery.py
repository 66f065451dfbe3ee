"""Signed means unforgeable: chunks whose sections an attacker rewrote under a genuine, validly signed
header, keeping every non-keyed checksum (`tests/forgery.py`), are never used by a reader with the
secret, on every read path, and stay stored (a failed signature deletes nothing). Without the secret the
same forgeries are taken for genuine: the section tag is the only thing standing."""

from __future__ import annotations

import itertools

import anyio
import pytest
import torch

from kvrestore import (
    Auto,
    Blend,
    LayerTwoPointer,
    LoadOnly,
    Restorer,
    TokenTwoPointer,
    codec,
    open_store,
)
from kvrestore.chunkio import ChunkLoader
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader
from kvrestore.chunkio.page_dest import KeptSections
from kvrestore.codec.quant import ENCODINGS
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import UnauthenticatedChunkError, proves_damage
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .forgery import SecondPreimages, forge

SECRET = b"s" * 32
FILL = 7.0
SPEC = ModelSpec("tiny", 3, 2, 8, 100, torch.float32, "ab" * 16)


@pytest.fixture
def preimages(monkeypatch):
    return SecondPreimages(monkeypatch)


def _genuine(encoding: str, compression: str, n_tokens: int, tile: int, seed: int) -> tuple[str, int, bytes]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn((SPEC.num_layers, 2, SPEC.num_kv_heads, n_tokens, SPEC.head_dim), generator=g)
    key, start = f"{seed:040x}", 16 * (seed % 5)
    blob = codec.encode_chunk(
        KVChunk(start, data),
        SPEC,
        key,
        compression=compression,
        encoding=encoding,
        seal=Seal(SECRET),
        key_tile=tile,
    )
    return key, start, blob


def _cases():
    for encoding, compression, n_tokens in itertools.product(ENCODINGS, ("none", "zstd"), (1, 4, 7, 16, 32)):
        tiles = (0, 4) if encoding == "native" and n_tokens % 4 == 0 else (0,)
        for tile in tiles:
            yield encoding, compression, n_tokens, tile


PATHS = ("chunk", "layers", "device path", "deferred", "kept sections", "decode")


def _read(path: str, store: MemoryStore, key: str, start: int, n: int, encoding: str, seal) -> torch.Tensor:
    """Read chunk `key` through `path` into a cache filled with FILL; returns the cache, or raises."""
    kv = KVCache(SPEC, torch.full((SPEC.num_layers, 2, SPEC.num_kv_heads, n, SPEC.head_dim), FILL))
    if path == "chunk":
        ChunkLoader(SPEC, store, encoding=encoding, seal=seal).fetch_sync(key, start, kv.data).place()
        return kv.data
    if path == "decode":
        codec.decode_chunk(
            store.get_sync(key), SPEC, key, start, n, out=kv.data, encoding=encoding, seal=seal
        )
        return kv.data
    dest = KeptSections() if path == "kept sections" else None
    reader = LayerReader(
        SPEC,
        store,
        [ChunkRef(0, start, start + n, key, at=0)],
        encoding=encoding,
        seal=seal,
        dest=dest,
        device_path=path == "device path",
        defer_checks=path == "deferred",
    )

    async def main() -> None:
        assert await reader.open() == [True]  # the header is genuine and validly signed
        await reader.read_layers(range(SPEC.num_layers), kv)
        await reader.verify()

    try:
        anyio.run(main)
    except ChunkLoadFailed as exc:
        if "UnauthenticatedChunkError" in exc.error:
            raise UnauthenticatedChunkError(exc.error) from exc
        raise
    if dest is not None:  # the sections kept as read: what the connector hands its pages
        for layer in range(SPEC.num_layers):
            piece = dest.piece(reader, 0, layer, 0, n)
            kv.data[layer] = piece.kv()
    return kv.data


def test_1500_forged_chunks_are_never_used_and_stay(preimages):
    """1,500 forgeries over every encoding, compression, chunk size and key layout, each read through
    every path in turn: refused before a byte reaches the cache, never deleted. The same forgeries pass
    every non-keyed check: a reader without the secret uses each uncompressed one."""
    seal = Seal(SECRET)
    cases = list(_cases())
    store = MemoryStore()
    refused = fooled = 0
    for i in range(1500):
        encoding, compression, n, tile = cases[i % len(cases)]
        path = PATHS[i % len(PATHS)]
        key, start, blob = _genuine(encoding, compression, n, tile, i)
        forged = forge(blob, i, preimages)
        assert codec.read_header(forged) == codec.read_header(blob)  # the genuine header, MAC and all
        anyio.run(store.put, key, forged)
        kv = torch.full((SPEC.num_layers, 2, SPEC.num_kv_heads, n, SPEC.head_dim), FILL)
        with pytest.raises(UnauthenticatedChunkError) as got:
            kv = _read(path, store, key, start, n, encoding, seal)
        assert not proves_damage(got.value)
        assert bool((kv == FILL).all()), f"{path}: a forged chunk's bytes reached the cache"
        refused += 1
        if compression == "none":  # every non-keyed check passes: only the tag refuses it
            used = _read(path, store, key, start, n, encoding, None)
            genuine = codec.decode_chunk(blob, SPEC, key, start, n, encoding=encoding).data
            assert not torch.equal(used, genuine)
            fooled += 1
    assert refused == 1500 and fooled >= 600
    assert len(store) == 1500  # a failed signature deletes nothing


def test_a_forged_section_alone_is_refused_and_the_rest_of_a_read_is_kept(preimages):
    """Two chunks read together, one layer of one forged: that chunk fails, the other is placed."""
    seal = Seal(SECRET)
    store = MemoryStore()
    (ka, sa, a), (kb, sb, b) = (_genuine("native", "none", 16, 0, s) for s in (1, 2))
    anyio.run(store.put, ka, forge(a, 0, preimages, layers=[2]))
    anyio.run(store.put, kb, b)
    kv = KVCache(SPEC, torch.full((SPEC.num_layers, 2, SPEC.num_kv_heads, 32, SPEC.head_dim), FILL))
    for device_path in (False, True):
        reader = LayerReader(
            SPEC,
            store,
            [ChunkRef(0, sa, sa + 16, ka, at=0), ChunkRef(1, sb, sb + 16, kb, at=16)],
            seal=seal,
            device_path=device_path,
        )

        async def main(reader=reader):
            await reader.open()
            await reader.read_layers(range(0, 2), kv)  # the genuine layers of both
            with pytest.raises(ChunkLoadFailed) as got:
                await reader.read_layers(range(2, 3), kv)
            assert got.value.indices == [0] and "UnauthenticatedChunkError" in got.value.error

        anyio.run(main)
        want = codec.decode_chunk(b, SPEC, kb, sb, 16).data
        assert torch.equal(kv.data[:, :, :, 16:], want)
        assert bool((kv.data[2, :, :, :16] == FILL).all())
    assert len(store) == 2


# -- a restorer, every policy ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [LoadOnly(), TokenTwoPointer(), LayerTwoPointer(), Auto()],
    ids=["load", "token", "layer", "auto"],
)
@pytest.mark.parametrize("url", ["memory", "file"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_restorer_with_the_secret_uses_no_forged_section(
    llama_backend, tmp_path, policy, url, compression, preimages
):
    tokens = random_tokens(100, llama_backend.spec.vocab_size)
    ref = llama_backend.prefill_chunk(tokens, None, 0).data

    async def main():
        store = MemoryStore() if url == "memory" else open_store(f"file://{tmp_path}/kv")
        writer = Restorer(llama_backend, store, chunk_size=32, secret=SECRET, compression=compression)
        await writer.save(tokens)
        _, refs = writer.chunks(tokens)
        for i, r in enumerate(refs):  # every layer of every chunk forged under its genuine header
            await store.put(r.key, forge(await store.get(r.key), i, preimages))
        got = await Restorer(llama_backend, store, chunk_size=32, secret=SECRET).restore(tokens, policy)
        assert got.stats.loaded_chunks == 0 and got.stats.loaded_layers == 0
        torch.testing.assert_close(got.kv.data, ref, atol=1e-5, rtol=0)
        assert all(await store.contains([r.key for r in refs]))  # not deleted
        if compression == "none":  # the forgeries keep every non-keyed checksum: without the secret...
            fooled = await Restorer(llama_backend, store, chunk_size=32).restore(tokens, LoadOnly())
            assert fooled.stats.loaded_chunks == len(refs)
            assert not torch.allclose(fooled.kv.data, ref, atol=1e-2)

    anyio.run(main)


def test_blend_uses_no_forged_section(llama_backend, preimages):
    chunk = random_tokens(40, llama_backend.spec.vocab_size, seed=1)
    suffix = random_tokens(8, llama_backend.spec.vocab_size, seed=2)

    async def main():
        store = MemoryStore()
        guarded = Restorer(llama_backend, store, secret=SECRET)
        await guarded.save_chunk(chunk)
        (key,) = list(store._objects)
        await store.put(key, forge(await store.get(key), 0, preimages))
        got = await guarded.restore_blend([chunk], suffix, Blend(recompute_ratio=0.15))
        assert got.stats.loaded_chunks == 0 and len(store) == 1
        stock = llama_backend.prefill_chunk(torch.cat([chunk, suffix]), None, 0).data
        torch.testing.assert_close(got.kv.data, stock, atol=1e-5, rtol=0)

    anyio.run(main)


# -- boundary activations (stage-parallel restore) ---------------------------------------------------


def test_a_forged_boundary_activation_is_refused_and_an_unsigned_one_too(preimages):
    hidden = torch.randn(16, 24)
    key = "c" * 40
    signed = codec.encode_boundary(hidden, SPEC, key, 16, 2, Seal(SECRET))
    assert torch.equal(codec.decode_boundary(signed, SPEC, key, 16, 16, 2, 24, Seal(SECRET)), hidden)
    assert torch.equal(codec.decode_boundary(signed, SPEC, key, 16, 16, 2, 24), hidden)  # no secret: read
    header_end = codec.PREFIX_SIZE + int.from_bytes(signed[4:8], "little")
    offset = codec.body_start_after(header_end)
    forged = bytearray(signed)
    forged[offset + 5] ^= 0x40
    preimages.keep(
        memoryview(forged)[offset:],
        codec.boundary._BOUNDARY_DECODER.decode(signed[codec.PREFIX_SIZE : header_end]).checksum,
    )
    with pytest.raises(UnauthenticatedChunkError, match="tag"):
        codec.decode_boundary(bytes(forged), SPEC, key, 16, 16, 2, 24, Seal(SECRET))
    assert not torch.equal(codec.decode_boundary(bytes(forged), SPEC, key, 16, 16, 2, 24), hidden)
    unsigned = codec.encode_boundary(hidden, SPEC, key, 16, 2)
    with pytest.raises(UnauthenticatedChunkError, match="unsigned"):
        codec.decode_boundary(unsigned, SPEC, key, 16, 16, 2, 24, Seal(SECRET))
    with pytest.raises(UnauthenticatedChunkError, match="secret"):
        codec.decode_boundary(signed, SPEC, key, 16, 16, 2, 24, Seal(b"another secret of 32 bytes......"))
