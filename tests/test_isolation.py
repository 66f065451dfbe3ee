"""Isolation: keys under namespaces and per-position inputs; chunks signed under a secret, so a store's
other writers cannot plant KV (a forged chunk is a miss, never KV, and is not deleted)."""

from __future__ import annotations

import itertools
import struct
import zlib

import anyio
import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrestore import (
    Blend,
    ComputeOnly,
    InvalidInputError,
    LayerTwoPointer,
    LoadOnly,
    Restorer,
    SyncRestorer,
    TokenTwoPointer,
    codec,
    open_store,
)
from kvrestore.chunkio import ChunkLoader
from kvrestore.codec.header import _ENCODER, _PREFIX, MAGIC, PREFIX_SIZE
from kvrestore.codec.quant import ENCODINGS, key_space
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import UnauthenticatedChunkError
from kvrestore.core.keys import chunk_keys, namespaced
from kvrestore.core.kv import KVChunk
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .test_kv_encoding import ComputeFirstLayer

FP = "0123456789abcdef" * 2
SECRET = b"s" * 32
ATOL = 1e-5


def full_prefill(backend, tokens):
    return backend.prefill_chunk(tokens, None, 0).data


# -- keys -------------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=120), st.integers(1, 32), st.text(min_size=1))
def test_a_namespace_changes_every_key_and_none_keeps_todays(tokens, size, namespace):
    bare = chunk_keys(tokens, FP, size)
    assert chunk_keys(tokens, namespaced(FP, None), size) == bare
    named = chunk_keys(tokens, namespaced(FP, namespace), size)
    assert not {r.key for r in bare} & {r.key for r in named}
    other = chunk_keys(tokens, namespaced(FP, namespace + "x"), size)
    assert not {r.key for r in other} & {r.key for r in named}


def test_namespaces_cannot_be_spelled_into_one_another():
    # a namespace that looks like the space of another is hashed: it never lands on that space
    inner = namespaced(FP, "a")
    assert namespaced(FP, inner.removeprefix(FP + "|namespace:")) != inner
    assert namespaced(inner, "b") != namespaced(FP, "a|namespace:b")
    # a tenant's salt never names an adapter's space, nor the other way round
    assert namespaced(FP, "x", kind="adapter") != namespaced(FP, "x")


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=120), st.integers(1, 32), st.data())
def test_an_extra_input_changes_its_chunk_and_every_later_one(tokens, size, data):
    pos = data.draw(st.integers(0, len(tokens) - 1))
    a = chunk_keys(tokens, FP, size, [(pos, b"image-1")])
    b = chunk_keys(tokens, FP, size, [(pos, b"image-2")])
    bare = chunk_keys(tokens, FP, size)
    at = pos // size
    assert [r.key for r in a[:at]] == [r.key for r in b[:at]] == [r.key for r in bare[:at]]
    assert all(x.key != y.key != z.key for x, y, z in zip(a[at:], b[at:], bare[at:], strict=True))


def test_an_extra_input_at_another_position_gives_other_keys():
    tokens = list(range(64))
    a = chunk_keys(tokens, FP, 16, [(20, b"img")])
    b = chunk_keys(tokens, FP, 16, [(21, b"img")])
    assert a[1].key != b[1].key


@pytest.mark.parametrize("bad", ["", 3, b"a"])
def test_a_bad_namespace_is_refused(llama_backend, bad):
    with pytest.raises(InvalidInputError, match="namespace"):
        Restorer(llama_backend, MemoryStore(), namespace=bad)
    r = Restorer(llama_backend, MemoryStore())
    with pytest.raises(InvalidInputError, match="namespace"):
        r.chunks([1, 2, 3], namespace=bad)


def test_an_extra_input_outside_the_prompt_is_refused():
    with pytest.raises(InvalidInputError, match="position 5"):
        chunk_keys([1, 2, 3], FP, 2, [(5, b"x")])


# -- namespaces in the library ----------------------------------------------------------------------


def test_two_namespaces_never_see_each_others_chunks(llama_backend):
    tokens = random_tokens(100, llama_backend.spec.vocab_size)
    ref = full_prefill(llama_backend, tokens)

    async def main():
        store = MemoryStore()
        a = Restorer(llama_backend, store, chunk_size=32, namespace="tenant-a")
        b = Restorer(llama_backend, store, chunk_size=32, namespace="tenant-b")
        await a.save(tokens)
        assert await a.lookup(tokens) == 100
        assert await b.lookup(tokens) == 0
        assert await a.lookup(tokens, namespace="tenant-b") == 0  # a call names another namespace
        assert await b.lookup(tokens, namespace="tenant-a") == 100
        plain = Restorer(llama_backend, store, chunk_size=32)
        assert await plain.lookup(tokens) == 0
        got = await b.restore(tokens, LoadOnly())
        assert got.stats.loaded_chunks == 0 and got.stats.computed_chunks == got.stats.n_chunks
        torch.testing.assert_close(got.kv.data, ref, atol=ATOL, rtol=0)
        got = await b.restore(tokens, LoadOnly(), namespace="tenant-a")
        assert got.stats.loaded_chunks == got.stats.n_chunks
        torch.testing.assert_close(got.kv.data, ref, atol=ATOL, rtol=0)
        await b.save(tokens)  # b's own copy, under b's keys
        assert await b.lookup(tokens) == 100
        assert len(store) == 2 * 4

    anyio.run(main)


def test_a_namespace_shares_with_the_keys_the_connector_uses(llama_backend):
    """The connector keys a request of `cache_salt` "t" under namespaced(key_space, "t"): a Restorer of
    namespace "t" writes and reads the very same keys."""
    tokens = random_tokens(64, llama_backend.spec.vocab_size)
    r = Restorer(llama_backend, MemoryStore(), chunk_size=32, namespace="t")
    _, refs = r.chunks(tokens)
    space = namespaced(key_space(llama_backend.spec.fingerprint, "native"), "t")
    assert [x.key for x in refs] == [x.key for x in chunk_keys(tokens, space, 32)]


def test_sync_restorer_takes_namespaces_too(llama_backend):
    tokens = random_tokens(70, llama_backend.spec.vocab_size)
    with SyncRestorer(llama_backend, MemoryStore(), 32, namespace="a") as r:
        r.save(tokens)
        assert r.lookup(tokens) == 70
        assert r.lookup(tokens, namespace="b") == 0
        r.save(tokens, namespace="b")
        assert r.lookup(tokens, namespace="b") == 70


def test_blend_chunks_are_namespaced(llama_backend):
    chunk = random_tokens(40, llama_backend.spec.vocab_size, seed=1)
    suffix = random_tokens(8, llama_backend.spec.vocab_size, seed=2)

    async def main():
        store = MemoryStore()
        a = Restorer(llama_backend, store, namespace="a")
        key_a = await a.save_chunk(chunk)
        key_b = await a.save_chunk(chunk, namespace="b")
        assert key_a != key_b and len(store) == 2
        plain = Restorer(llama_backend, store)
        assert await plain.save_chunk(chunk) not in (key_a, key_b)
        await store.delete(key_b)
        got = await a.restore_blend([chunk], suffix, Blend(recompute_ratio=0.15), namespace="b")
        assert got.stats.loaded_chunks == 0  # b's chunk is gone: a's is never used for it
        got = await a.restore_blend([chunk], suffix, Blend(recompute_ratio=0.15))
        assert got.stats.loaded_chunks == 1

    anyio.run(main)


# -- signed chunks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"short", "", 12])
def test_a_weak_or_mistyped_secret_is_refused(llama_backend, bad):
    with pytest.raises(InvalidInputError, match="secret"):
        Restorer(llama_backend, MemoryStore(), secret=bad)


def test_the_secret_never_shows_in_a_repr():
    assert "s" * 16 not in repr(Seal(SECRET))


def _forge(spec, key, start, n_tokens, encoding, compression, signer, seed):
    """A well-formed chunk for `key`, checksums and all, of random KV: signed by `signer` (a Seal of
    another secret, or None for unsigned)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(
        (spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim), generator=g, dtype=torch.float32
    ).to(spec.dtype)
    chunk = KVChunk(start, data)
    return codec.encode_chunk(chunk, spec, key, compression=compression, encoding=encoding, seal=signer)


def test_a_thousand_forged_chunks_are_never_used(llama_backend):
    """1,000 forged objects (valid format and checksums, under the right keys) of every encoding,
    compression and size, unsigned or signed under another secret: each is refused before a byte of its
    KV is placed, and stays in the store."""
    spec = llama_backend.spec
    seal = Seal(SECRET)
    signers = [None, Seal(b"another secret of 32 bytes......")]
    cases = list(itertools.product(ENCODINGS, ("none", "zstd"), (1, 7, 32), signers))
    store = MemoryStore()
    refused = 0
    for i in range(1000):
        encoding, compression, n_tokens, signer = cases[i % len(cases)]
        loader = ChunkLoader(spec, store, encoding=encoding, seal=seal)
        key = f"{i:040x}"
        start = 32 * (i % 5)
        anyio.run(store.put, key, _forge(spec, key, start, n_tokens, encoding, compression, signer, i))
        dest = torch.full((spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim), 7.0)
        with pytest.raises(UnauthenticatedChunkError):
            loader.fetch_sync(key, start, dest).place()
        assert bool((dest == 7.0).all()), "a forged chunk's bytes reached the cache"
        refused += 1
    assert refused == 1000 and len(store) == 1000


@pytest.mark.parametrize("policy", [LoadOnly(), TokenTwoPointer(), LayerTwoPointer()], ids=repr)
@pytest.mark.parametrize("url", ["memory", "file"])
def test_forged_chunks_in_the_store_are_misses_and_stay(llama_backend, tmp_path, policy, url):
    tokens = random_tokens(100, llama_backend.spec.vocab_size)
    ref = full_prefill(llama_backend, tokens)

    async def main():
        store = MemoryStore() if url == "memory" else open_store(f"file://{tmp_path}/kv")
        forger = Restorer(llama_backend, store, chunk_size=32)  # a writer without the secret
        _, refs = forger.chunks(tokens)
        for i, r in enumerate(refs):
            forged = _forge(llama_backend.spec, r.key, r.start, r.n_tokens, "native", "none", None, i)
            await store.put(r.key, forged)
        guarded = Restorer(llama_backend, store, chunk_size=32, secret=SECRET)
        got = await guarded.restore(tokens, policy)
        assert got.stats.loaded_chunks == 0
        torch.testing.assert_close(got.kv.data, ref, atol=ATOL, rtol=0)
        assert all(await store.contains([r.key for r in refs]))  # not deleted: maybe another secret's
        # the unguarded reader does use them: that is what the secret prevents
        fooled = await forger.restore(tokens, LoadOnly())
        assert fooled.stats.loaded_chunks == len(refs)
        assert not torch.allclose(fooled.kv.data, ref, atol=1e-2)

    anyio.run(main)


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("axis", ["tokens", "layers"])
def test_signed_chunks_load_under_the_secret_and_without_one(llama_backend, compression, axis):
    """Along tokens every chunk loads; along layers (a `LayerReader`'s reads) every layer but the
    first, whatever the timings (`ComputeFirstLayer`: the tiny model computes a layer before a fetch
    lands, so the two-pointer would race for each). Under another secret nothing loads."""
    tokens = random_tokens(100, llama_backend.spec.vocab_size)
    ref = full_prefill(llama_backend, tokens)
    policy = LoadOnly() if axis == "tokens" else ComputeFirstLayer()

    async def main():
        store = MemoryStore()
        signer = Restorer(llama_backend, store, chunk_size=32, secret=SECRET, compression=compression)
        await signer.save(tokens)
        for reader in (signer, Restorer(llama_backend, store, chunk_size=32)):
            got = await reader.restore(tokens, policy)
            if axis == "tokens":
                assert got.stats.loaded_chunks == got.stats.n_chunks
            else:
                assert got.stats.loaded_layers == llama_backend.spec.num_layers - 1
            assert got.stats.failed_loads == 0 and not got.stats.errors
            torch.testing.assert_close(got.kv.data, ref, atol=ATOL, rtol=0)
        other = Restorer(llama_backend, store, chunk_size=32, secret=b"a different secret, 32 bytes...")
        got = await other.restore(tokens, LoadOnly() if axis == "tokens" else LayerTwoPointer())
        assert got.stats.loaded_chunks == 0 and got.stats.loaded_layers == 0
        torch.testing.assert_close(got.kv.data, ref, atol=ATOL, rtol=0)
        assert len(store) == 4  # neither side empties the store for the other

    anyio.run(main)


def _reheader(blob: bytes, **changes: object) -> bytes:
    """`blob` with header fields changed, its crc fixed (what a forger who edits a signed header does)."""
    header, end = codec.read_header(blob)
    new = _ENCODER.encode(msgspec.structs.replace(header, **changes))
    assert len(new) == end - PREFIX_SIZE
    return _PREFIX.pack(MAGIC, len(new), zlib.crc32(new)) + new + blob[end:]


def test_an_edited_signed_header_fails_its_mac(llama_backend):
    spec = llama_backend.spec
    seal = Seal(SECRET)
    blob = _forge(spec, "a" * 40, 0, 8, "native", "none", seal, 0)
    header, _ = codec.read_header(blob)
    codec.check_object(blob, spec, "a" * 40, 0, 8, seal=seal)  # as written: it checks out
    flipped = bytes([header.mac[0] ^ 1]) + header.mac[1:]
    sections = list(header.layers)
    sections[0] = msgspec.structs.replace(sections[0], checksum=sections[0].checksum ^ 1)
    for changes in ({"mac": flipped}, {"layers": sections}, {"mac": b""}):
        edited = _reheader(blob, **changes) if changes != {"mac": b""} else None
        if edited is None:  # an unsigned header is shorter: framed afresh
            edited = _forge(spec, "a" * 40, 0, 8, "native", "none", None, 0)
        with pytest.raises(UnauthenticatedChunkError):
            codec.check_object(edited, spec, "a" * 40, 0, 8, seal=seal)
    assert struct.calcsize("<4sII") == PREFIX_SIZE


def test_forged_blend_chunks_are_never_used(llama_backend):
    chunk = random_tokens(40, llama_backend.spec.vocab_size, seed=1)
    suffix = random_tokens(8, llama_backend.spec.vocab_size, seed=2)

    async def main():
        store = MemoryStore()
        forger = Restorer(llama_backend, store)
        await forger.save_chunk(chunk)  # unsigned, under the right content key
        guarded = Restorer(llama_backend, store, secret=SECRET)
        got = await guarded.restore_blend([chunk], suffix, Blend(recompute_ratio=0.15))
        assert got.stats.loaded_chunks == 0
        assert len(store) == 1
        stock = llama_backend.prefill_chunk(torch.cat([chunk, suffix]), None, 0).data
        torch.testing.assert_close(got.kv.data, stock, atol=ATOL, rtol=0)

    anyio.run(main)


def test_compute_only_never_reads_so_needs_no_secret(llama_backend):
    tokens = random_tokens(40, llama_backend.spec.vocab_size)
    r = Restorer(llama_backend, MemoryStore(), chunk_size=32, secret=SECRET)
    got = anyio.run(r.restore, tokens, ComputeOnly())
    torch.testing.assert_close(got.kv.data, full_prefill(llama_backend, tokens), atol=ATOL, rtol=0)
