"""Quantized chunk encodings (`codec.quant`): their bytes, their error bounds, their headers and
checksums, and every restore path that reads them, checked against a plain full prefill."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvrestore import (
    InvalidInputError,
    KVCache,
    LoadOnly,
    Restorer,
    TokenTwoPointer,
    codec,
    open_store,
)
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader
from kvrestore.codec import quant
from kvrestore.codec.checksums import as_signed, device_checksums
from kvrestore.core.errors import CorruptChunkError, ForeignChunkError, UnknownLayoutError
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.policies import Decision, Policy, Progress
from kvrestore.policies.base import Estimates, next_compute_run
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens

ATOL = 1e-5
QUANTIZED = ("int8", "fp8", "int4")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _spec(dtype=torch.float32, layers=2, heads=3, head_dim=64) -> ModelSpec:
    return ModelSpec("shape", layers, heads, head_dim, 100, dtype, "f" * 32)


def _roundtrip(enc: quant.Encoding, kv: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(kv)
    enc.decode(enc.encode(kv), out)
    return out


# -- the encodings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,heads,head_dim,name,most",
    [
        (torch.float32, 3, 64, "int8", 0.27),  # SmolLM2's shape on the CPU
        (torch.float32, 3, 64, "fp8", 0.27),
        (torch.bfloat16, 3, 64, "int8", 0.53),
        (torch.bfloat16, 3, 64, "fp8", 0.53),
        (torch.bfloat16, 3, 64, "int4", 0.32),
        (torch.bfloat16, 8, 128, "int8", 0.53),  # Llama-3.1-8B's shape
        (torch.bfloat16, 8, 128, "fp8", 0.53),
        (torch.bfloat16, 8, 128, "int4", 0.32),
    ],
)
def test_stored_bytes_per_token_meet_the_targets(dtype, heads, head_dim, name, most):
    """A whole chunk as stored (header, scales and padding included) against the native chunk."""
    spec = _spec(dtype, layers=4, heads=heads, head_dim=head_dim)
    kv = torch.randn(4, 2, heads, 256, head_dim).to(dtype)
    native = codec.encode_chunk(KVChunk(0, kv), spec, "k")
    encoded = codec.encode_chunk(KVChunk(0, kv), spec, "k", encoding=name)
    assert len(encoded) / len(native) <= most
    enc = codec.spec_encoding(spec, name)
    assert enc.bytes_per_token(256, 4) / spec.kv_bytes_per_token <= most


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_tokens", [1, 31, 70])
def test_quantization_error_is_within_half_a_step(dtype, n_tokens):
    """Each value decodes to within half a quantization step of its group (plus the KV dtype's own
    rounding): int8 and fp8 per token and head, int4 per key channel over tokens and per value group."""
    torch.manual_seed(n_tokens)
    kv = (torch.randn(2, 2, 3, n_tokens, 64) * torch.rand(2, 2, 3, n_tokens, 1) * 4).to(dtype)
    x = kv.float()
    eps = torch.finfo(dtype).eps
    absmax = x.abs().amax(-1, keepdim=True)
    int8 = _roundtrip(quant.encoding("int8", dtype, 3, 64), kv).float()
    assert ((int8 - x).abs() <= absmax / 127 * 0.51 + x.abs() * eps).all()
    fp8 = _roundtrip(quant.encoding("fp8", dtype, 3, 64), kv).float()
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, or of 2**-6 * scale when subnormal
    assert ((fp8 - x).abs() <= x.abs() / 16 + absmax / 448 * 2**-9 + x.abs() * 2 * eps + 1e-30).all()
    enc = quant.encoding("int4", dtype, 3, 64)
    got = _roundtrip(enc, kv).float()
    g = enc.group
    v = x[:, 1].reshape(2, 3, n_tokens, 64 // g, g)
    v_step = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / 15
    v_err = (got[:, 1] - x[:, 1]).reshape(v.shape).abs()
    assert (v_err <= v_step * 0.51 + v.abs() * 2e-3 + 1e-6).all()
    for a in range(0, n_tokens, g):
        k = x[:, 0, :, a : a + g]
        k_step = (k.amax(2, keepdim=True) - k.amin(2, keepdim=True)) / 15
        k_err = (got[:, 0, :, a : a + g] - k).abs()
        assert (k_err <= k_step * 0.51 + k.abs() * 2e-3 + 1e-6).all()


def test_a_zero_row_decodes_to_zero():
    kv = torch.zeros(1, 2, 3, 5, 64)
    for name in QUANTIZED:
        assert (_roundtrip(quant.encoding(name, torch.float32, 3, 64), kv) == 0).all()


def test_unknown_encodings_are_refused_by_name():
    with pytest.raises(InvalidInputError, match="unknown kv_encoding 'int3'"):
        quant.encoding("int3", torch.float32, 3, 64)
    with pytest.raises(InvalidInputError, match="even head_dim"):
        quant.encoding("int4", torch.float32, 3, 63)
    with pytest.raises(InvalidInputError, match="unknown kv_encoding"):
        codec.encode_chunk(KVChunk(0, torch.zeros(2, 2, 3, 4, 64)), _spec(), "k", encoding="INT8")


def test_int4_groups_fit_the_head_dim():
    assert quant.encoding("int4", torch.float32, 3, 64).group == 32
    assert quant.encoding("int4", torch.float32, 3, 16).group == 16
    assert quant.encoding("int4", torch.float32, 3, 80).group == 16


# -- headers and checksums ----------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_header_names_the_encoding_and_the_checksums_cover_the_stored_bytes(name):
    spec = _spec()
    kv = torch.randn(2, 2, 3, 40, 64)
    blob = codec.encode_chunk(KVChunk(0, kv), spec, "k", encoding=name)
    header, _ = codec.read_header(blob)
    enc = codec.spec_encoding(spec, name)
    assert header.encoding == enc.tag and header.version == codec.PLAIN_VERSION
    sections = codec.body_sections(header, blob)
    assert sections.shape[1] == enc.section_bytes(40) and sections.shape[1] % 8 == 0
    assert [s.device_sum for s in header.layers] == [as_signed(int(x)) for x in device_checksums(sections)]
    got = codec.decode_chunk(blob, spec, "k", 0, 40, encoding=name).data
    torch.testing.assert_close(got, _roundtrip(enc, kv), atol=0, rtol=0)
    # a scale byte (the end of layer 1's section, before its padding) is covered by both checksums
    damaged = bytearray(blob)
    s = header.layers[1]
    at = s.offset + s.length - 16
    damaged[at] ^= 0x40
    with pytest.raises(CorruptChunkError, match="layer 1"):
        codec.decode_chunk(bytes(damaged), spec, "k", 0, 40, encoding=name)
    bad = codec.body_sections(header, bytes(damaged))
    assert device_checksums(bad)[1] != header.layers[1].device_sum


@pytest.mark.parametrize(
    "stored,reader", [("int8", "native"), ("native", "int8"), ("int8", "fp8"), ("int4", "int8")]
)
def test_a_reader_refuses_another_encoding(stored, reader):
    spec = _spec()
    blob = codec.encode_chunk(KVChunk(0, torch.randn(2, 2, 3, 8, 64)), spec, "k", encoding=stored)
    with pytest.raises(
        ForeignChunkError, match=f"chunk encoding is '{stored}', this reader reads '{reader}'"
    ):
        codec.decode_chunk(blob, spec, "k", 0, 8, encoding=reader)


def _retagged(blob: bytes, tag: tuple[str, str, int]) -> bytes:
    """`blob` with its header's encoding replaced (a valid header: crc and layout redone)."""
    import msgspec

    header, end = codec.read_header(blob)
    fields = {f: getattr(header, f) for f in header.__struct_fields__}
    body = blob[header.layers[0].offset :]
    fields["encoding"] = tag
    hdr = msgspec.msgpack.encode(codec.ChunkHeader(**fields))
    import zlib

    from kvrestore.codec.header import _PREFIX, MAGIC

    start = codec.body_start_after(codec.PREFIX_SIZE + len(hdr))
    assert start == header.layers[0].offset  # same length of header (the same fields, one value changed)
    return (
        _PREFIX.pack(MAGIC, len(hdr), zlib.crc32(hdr))
        + hdr
        + bytes(start - codec.PREFIX_SIZE - len(hdr))
        + body
    )


@pytest.mark.parametrize(
    "tag, error",
    [
        (("int8", "float16", 0), UnknownLayoutError),  # a newer release's int8: kept in the store
        (("int9", "bfloat16", 0), UnknownLayoutError),
        (("fp8", "bfloat16", 0), ForeignChunkError),  # an encoding the chunk's key does not name
    ],
)
def test_a_header_naming_other_scales_or_an_unknown_encoding_is_not_read(tag, error):
    spec = _spec()
    blob = codec.encode_chunk(KVChunk(0, torch.randn(2, 2, 3, 8, 64)), spec, "k", encoding="int8")
    with pytest.raises(error):
        codec.decode_chunk(_retagged(blob, tag), spec, "k", 0, 8, encoding="int8")


def test_zstd_over_an_encoding_decodes_the_same():
    spec = _spec()
    kv = torch.randn(2, 2, 3, 24, 64)
    plain = codec.encode_chunk(KVChunk(0, kv), spec, "k", encoding="int8")
    packed = codec.encode_chunk(KVChunk(0, kv), spec, "k", encoding="int8", compression="zstd")
    a = codec.decode_chunk(plain, spec, "k", 0, 24, encoding="int8").data
    b = codec.decode_chunk(packed, spec, "k", 0, 24, encoding="int8").data
    assert torch.equal(a, b)


# -- restores -----------------------------------------------------------------------------------


def _full(backend, tokens) -> torch.Tensor:
    return backend.prefill_chunk(tokens, None, 0).data


def _loaded_chunks(result) -> set[int]:
    """Chunks whose loaded KV was applied: loads, and fetches aside that overtook a compute unit."""
    return set(result.trace.loaded())


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    return MemoryStore() if request.param == "memory" else open_store(f"file://{tmp_path}/kv")


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("policy", [LoadOnly, TokenTwoPointer], ids=["load-only", "token-two-pointer"])
def test_token_wise_restores_load_exactly_the_decoded_chunks(llama_backend, store, name, policy):
    """Loaded chunks hold exactly the decoded KV of a full prefill; computed ones equal the full
    prefill, or where a loaded chunk precedes them (the race may put one there) a prefill over the
    decoded past; the bytes loaded are the encoded objects'."""
    b, size = llama_backend, 16
    tokens = random_tokens(100, b.spec.vocab_size, seed=3)
    full = _full(b, tokens)
    enc = codec.spec_encoding(b.spec, name)
    want = _roundtrip(enc, full)

    async def main():
        r = Restorer(b, store, chunk_size=size, kv_encoding=name, learn=False)
        saved = await r.save(tokens, KVCache(b.spec, full.clone()))
        assert saved.written_chunks == 7
        return saved, await r.restore(tokens, policy())

    saved, result = anyio.run(main)
    loaded = _loaded_chunks(result)
    assert loaded and not result.stats.errors
    assert result.stats.bytes_loaded == sum(
        len(
            codec.encode_chunk(
                KVChunk(i * size, full[:, :, :, i * size : (i + 1) * size]), b.spec, "k" * 40, encoding=name
            )
        )
        for i in loaded
    )
    kv = result.kv.data
    for i in range(7):
        a, z = i * size, min(100, (i + 1) * size)
        if i in loaded:
            torch.testing.assert_close(kv[:, :, :, a:z], want[:, :, :, a:z], atol=0, rtol=0)
        elif any(j < i for j in loaded):  # computed over a decoded past: what a prefill over it computes
            over = b.prefill_chunk(tokens[a:z], kv[:, :, :, :a].clone(), a).data
            torch.testing.assert_close(kv[:, :, :, a:z], over, atol=ATOL, rtol=0)
        else:
            torch.testing.assert_close(kv[:, :, :, a:z], full[:, :, :, a:z], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", QUANTIZED)
def test_chunks_computed_after_loaded_ones_attend_over_the_decoded_kv(llama_backend, name):
    """A stored prefix loaded, the rest computed over it: equal to decoding the prefix of a full prefill
    and prefilling the rest on top of it."""
    b = llama_backend
    tokens = random_tokens(90, b.spec.vocab_size, seed=4)
    full = _full(b, tokens)
    enc = codec.spec_encoding(b.spec, name)
    prefix = _roundtrip(enc, full[:, :, :, :64])
    rest = b.prefill_chunk(tokens[64:], prefix, 64).data
    store = MemoryStore()

    async def main():
        r = Restorer(b, store, chunk_size=32, kv_encoding=name, learn=False)
        await r.save(tokens[:64], KVCache(b.spec, full[:, :, :, :64].clone()))
        return await r.restore(tokens, LoadOnly())

    result = anyio.run(main)
    assert result.stats.loaded_chunks == 2 and result.stats.computed_chunks == 1
    torch.testing.assert_close(result.kv.data[:, :, :, :64], prefix, atol=0, rtol=0)
    torch.testing.assert_close(result.kv.data[:, :, :, 64:], rest, atol=ATOL, rtol=0)


class ComputeFirstLayer(Policy):
    """Along layers, whatever the timings: layer 0 computed, every other layer loaded (the tiny model
    computes a layer faster than a fetch lands, so the two-pointer would compute them all)."""

    name = "first-layer"
    axis = "layers"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        loads = tuple(i for i in progress.pending() if i > 0)[: progress.free_load_lanes]
        run = next_compute_run(progress, max_chunks=1)
        return Decision(compute=run if run == (0, 1) else None, loads=loads)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("defer", [False, True], ids=["host-checked", "device-path"])
def test_layer_wise_restores_load_exactly_the_decoded_layers(llama_backend, name, defer, monkeypatch):
    """Along layers, on the host path and on the device path (deferred device checks, run here on a CPU
    cache): loaded layers hold the decoded KV, computed layers the full prefill's."""
    if defer:
        monkeypatch.setattr(LayerReader, "defers", lambda self, kv: True)
    b = llama_backend
    tokens = random_tokens(64, b.spec.vocab_size, seed=5)
    full = _full(b, tokens)
    want = _roundtrip(codec.spec_encoding(b.spec, name), full)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=32, kv_encoding=name, learn=False)
        await r.save(tokens, KVCache(b.spec, full.clone()))
        return await r.restore(tokens, ComputeFirstLayer())

    result = anyio.run(main)
    assert result.stats.computed_layers == 1 and not result.stats.errors
    assert result.stats.loaded_layers == b.spec.num_layers - 1
    loaded = {e.first_chunk for e in result.trace.of_kind("load")}
    for layer in range(b.spec.num_layers):
        expect, atol = (want, 0.0) if layer in loaded else (full, ATOL)
        torch.testing.assert_close(result.kv.data[layer], expect[layer], atol=atol, rtol=0)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_damaged_scale_on_the_device_path_fails_its_chunk(llama_backend, name):
    """Deferred device checks (run on a CPU cache) cover the scales: a flipped scale byte fails the
    chunk, and the object is deleted."""
    b = llama_backend
    spec, tokens = b.spec, random_tokens(64, b.spec.vocab_size, seed=6)
    full = _full(b, tokens)
    refs = chunk_keys(tokens, quant.key_space(spec.fingerprint, name), 32)
    store = MemoryStore()

    async def main():
        for r in refs:
            blob = codec.encode_chunk(
                KVChunk(r.start, full[:, :, :, r.start : r.end]), spec, r.key, encoding=name
            )
            if r.index == 1:
                header, _ = codec.read_header(blob)
                s = header.layers[2]
                damaged = bytearray(blob)
                damaged[s.offset + s.length - 16] ^= 0x40  # in the scales
                blob = bytes(damaged)
            await store.put(r.key, blob)
        chunks = list(refs)
        reader = LayerReader(spec, store, chunks, defer_checks=True, encoding=name)
        assert await reader.open() == [True, True]
        kv = KVCache(spec, torch.zeros_like(full))
        for layers in reader.read_plan(0, spec.num_layers, kv):
            await reader.read_layers(layers, kv)
        with pytest.raises(ChunkLoadFailed) as failed:
            await reader.verify()
        return failed.value.indices, kv, await store.contains([r.key for r in refs])

    indices, kv, present = anyio.run(main)
    assert indices == [1] and present == [True, False]
    want = _roundtrip(codec.spec_encoding(spec, name), full)
    torch.testing.assert_close(kv.data[:, :, :, :32], want[:, :, :, :32], atol=0, rtol=0)


def test_one_store_holds_several_encodings_each_reader_its_own(llama_backend):
    """A native and an int8 restorer share a store: their chunks lie under different keys, each finds
    and loads only its own (native exactly the full prefill, int8 exactly its decode)."""
    b, store = llama_backend, MemoryStore()
    tokens = random_tokens(64, b.spec.vocab_size, seed=7)
    full = _full(b, tokens)

    async def main():
        native = Restorer(b, store, chunk_size=32, learn=False)
        int8 = Restorer(b, store, chunk_size=32, kv_encoding="int8", learn=False)
        await native.save(tokens, KVCache(b.spec, full.clone()))
        assert await int8.lookup(tokens) == 0  # the native chunks are not int8's
        await int8.save(tokens, KVCache(b.spec, full.clone()))
        assert len(store) == 4
        keys = {r.key for r in native.chunks(tokens)[1]} | {r.key for r in int8.chunks(tokens)[1]}
        assert len(keys) == 4
        return await native.restore(tokens, LoadOnly()), await int8.restore(tokens, LoadOnly())

    n, q = anyio.run(main)
    assert n.stats.loaded_chunks == q.stats.loaded_chunks == 2
    assert torch.equal(n.kv.data, full)
    assert torch.equal(q.kv.data, _roundtrip(codec.spec_encoding(b.spec, "int8"), full))
    assert q.stats.bytes_loaded < n.stats.bytes_loaded / 3


@pytest.mark.parametrize("written,reader", [("int8", "native"), ("native", "int8"), ("fp8", "int8")])
def test_a_chunk_of_another_encoding_under_a_readers_key_is_a_miss(llama_backend, written, reader):
    """An object written in another encoding under this reader's key (a foreign writer) is never
    decoded: the chunk is recomputed (the result equals a full prefill) and the object deleted."""
    b, store = llama_backend, MemoryStore()
    tokens = random_tokens(64, b.spec.vocab_size, seed=8)
    full = _full(b, tokens)

    async def main():
        r = Restorer(b, store, chunk_size=32, kv_encoding=reader, learn=False)
        for ref in r.chunks(tokens)[1]:
            chunk = KVChunk(ref.start, full[:, :, :, ref.start : ref.end])
            await store.put(ref.key, codec.encode_chunk(chunk, b.spec, ref.key, encoding=written))
        result = await r.restore(tokens, LoadOnly())
        return result, await store.contains([ref.key for ref in r.chunks(tokens)[1]])

    result, present = anyio.run(main)
    assert result.stats.failed_loads == 2 and "ForeignChunkError" in result.stats.errors[-1]
    torch.testing.assert_close(result.kv.data, full, atol=ATOL, rtol=0)
    assert present == [False, False]


def test_restorer_refuses_an_unknown_encoding(llama_backend):
    with pytest.raises(InvalidInputError, match="unknown kv_encoding 'int2'"):
        Restorer(llama_backend, MemoryStore(), kv_encoding="int2")


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_planner_plans_with_the_stored_bytes(llama_backend, name):
    """The planner's loads move what a chunk of this encoding takes in the store, so at one link a
    load-only restore is predicted faster in proportion."""
    from kvrestore.costs.links import LinkCost
    from kvrestore.planning.auto import predict

    b = llama_backend
    native = Restorer(b, MemoryStore(), chunk_size=32, learn=False, profile=False)
    coded = Restorer(b, MemoryStore(), chunk_size=32, kv_encoding=name, learn=False, profile=False)
    refs = native.chunks(random_tokens(256, b.spec.vocab_size))[1]
    per_token = coded.kv_encoding.bytes_per_token(32, b.spec.num_layers)
    work = coded.planner.workload(refs, [True] * len(refs))
    assert (
        work.kv_bytes_per_token
        == round(per_token)
        < native.planner.workload(refs, [True] * 8).kv_bytes_per_token
    )
    link = LinkCost(bytes_per_s=1e6, latency_s=0.0)
    slow = predict(LoadOnly(), None, link, native.planner.workload(refs, [True] * 8))  # loads only: no costs
    fast = predict(LoadOnly(), None, link, work)
    assert fast == pytest.approx(slow * round(per_token) / b.spec.kv_bytes_per_token, rel=1e-6)


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_whole_chunk_upload_checks_the_stored_bytes_then_decodes(name):
    """`upload_checked`, the token-wise path into a CUDA cache, run on a CPU tensor (a transfer to a
    CPU tensor records no event): the encoded body goes to a device buffer, its device checksums are
    compared, and it is decoded into the cache rows; a flipped scale byte raises naming its layer."""
    from kvrestore.chunkio.load import upload_checked
    from kvrestore.chunkio.pool import StagingPool
    from kvrestore.chunkio.transfer import Transfer

    spec = _spec()
    kv = torch.randn(2, 2, 3, 40, 64)
    blob = codec.encode_chunk(KVChunk(0, kv), spec, "k", encoding=name)
    header, _ = codec.read_header(blob)
    enc = codec.spec_encoding(spec, name)
    pool = StagingPool(pinned=False)
    expected = [s.device_sum for s in header.layers]
    body = torch.frombuffer(bytearray(blob), dtype=torch.uint8)[header.layers[0].offset : header.end]
    cache = torch.zeros(2, 2, 3, 50, 64)
    upload_checked(body, cache[:, :, :, 5:45], expected, Transfer(pool), enc)
    assert torch.equal(cache[:, :, :, 5:45], _roundtrip(enc, kv)) and not cache[:, :, :, :5].any()
    damaged = body.clone()
    damaged[header.layers[1].offset - header.layers[0].offset + header.layers[1].length - 16] ^= 0x40
    with pytest.raises(CorruptChunkError, match="layer 1: device checksum mismatch"):
        upload_checked(damaged, cache[:, :, :, 5:45], expected, Transfer(pool), enc)
