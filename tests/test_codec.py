"""Chunk wire format: round trips, and every fault detected as a ChunkDecodeError."""

from __future__ import annotations

import struct
import zlib

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrestore import codec
from kvrestore.core.errors import (
    ChunkDecodeError,
    CorruptChunkError,
    ForeignChunkError,
    FormatVersionError,
    TruncatedChunkError,
    proves_damage,
)
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec

FP = "ab" * 16
KEY = "0123456789abcdef" * 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_spec(dtype=torch.float32, layers=3, heads=2, dim=8, fingerprint=FP) -> ModelSpec:
    return ModelSpec("tiny", layers, heads, dim, 100, dtype, fingerprint)


def make_chunk(spec: ModelSpec, n_tokens=5, start=0, seed=0) -> KVChunk:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim)
    return KVChunk(start, torch.randn(shape, generator=g).to(spec.dtype))


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(dtype, compression):
    spec = make_spec(dtype)
    chunk = make_chunk(spec, n_tokens=7, start=256)
    blob = codec.encode_chunk(chunk, spec, KEY, compression=compression)
    assert blob[:4] == codec.MAGIC
    out = codec.decode_chunk(blob, spec, KEY, 256, 7)
    assert out.start == 256 and out.data.dtype == dtype
    assert torch.equal(out.data, chunk.data)

    header, end = codec.read_header(blob[: codec.HEADER_PROBE])
    # native and uncompressed, the heads are checked one by one too (format 6); compressed, format 4
    version = codec.FORMAT_VERSION if compression == "none" else codec.PLAIN_VERSION
    assert (header.version, header.fingerprint, header.key) == (version, FP, KEY)
    assert (header.start, header.n_tokens, header.compression) == (256, 7, compression)
    table = codec.head_table_span(header)  # format 6: the head table, then the sections
    assert header.layers[0].offset == codec.body_start_after(end) + table[1] - table[0]
    assert header.end == len(blob)
    assert header.layers[0].offset % codec.BODY_ALIGN == 0


def test_zstd_compresses_redundant_data():
    spec = make_spec()
    chunk = KVChunk(0, torch.zeros(3, 2, 2, 64, 8))
    plain = codec.encode_chunk(chunk, spec, KEY)
    packed = codec.encode_chunk(chunk, spec, KEY, compression="zstd", level=3)
    assert len(packed) < len(plain) // 4
    assert torch.equal(codec.decode_chunk(packed, spec, KEY, 0, 64).data, chunk.data)


def test_non_contiguous_input():
    spec = make_spec()
    full = make_chunk(spec, n_tokens=10)
    view = KVChunk(3, full.data[:, :, :, 3:8])  # a token slice of a bigger cache is not contiguous
    blob = codec.encode_chunk(view, spec, KEY)
    assert torch.equal(codec.decode_chunk(blob, spec, KEY, 3, 5).data, view.data)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    tokens=st.integers(1, 9),
    dim=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    compression=st.sampled_from(["none", "zstd"]),
    start=st.integers(0, 2**40),
)
def test_round_trip_property(layers, heads, tokens, dim, dtype, compression, start):
    spec = make_spec(dtype, layers, heads, dim)
    chunk = make_chunk(spec, tokens, start)
    blob = codec.encode_chunk(chunk, spec, KEY, compression=compression)
    assert torch.equal(codec.decode_chunk(blob, spec, KEY, start, tokens).data, chunk.data)


# -- corruption and truncation ----------------------------------------------------------------------

SPEC = make_spec(torch.bfloat16)
CHUNK = make_chunk(SPEC, n_tokens=6, start=12)
BLOBS = {c: codec.encode_chunk(CHUNK, SPEC, KEY, compression=c) for c in ("none", "zstd")}


def decode(blob: bytes) -> KVChunk:
    return codec.decode_chunk(blob, SPEC, KEY, 12, 6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), compression=st.sampled_from(["none", "zstd"]))
def test_any_flipped_byte_is_detected(data, compression):
    blob = bytearray(BLOBS[compression])
    pos = data.draw(st.integers(0, len(blob) - 1), label="pos")
    blob[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(ChunkDecodeError):
        decode(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), compression=st.sampled_from(["none", "zstd"]))
def test_any_truncation_is_detected(data, compression):
    blob = BLOBS[compression]
    n = data.draw(st.integers(0, len(blob) - 1), label="length")
    with pytest.raises(TruncatedChunkError):
        decode(blob[:n])


def test_every_truncation_is_detected():
    blob = BLOBS["none"]
    for n in range(len(blob)):
        with pytest.raises(TruncatedChunkError):
            decode(blob[:n])


def test_trailing_bytes_are_corrupt():
    with pytest.raises(CorruptChunkError):
        decode(BLOBS["none"] + b"\0")


def test_specific_faults():
    blob = bytearray(BLOBS["none"])
    header, end = codec.read_header(blob)
    bad_magic = b"XXXX" + blob[4:]
    with pytest.raises(CorruptChunkError, match="magic"):
        decode(bytes(bad_magic))
    bad_header = bytearray(blob)
    bad_header[end - 1] ^= 1
    with pytest.raises(CorruptChunkError, match="header checksum"):
        decode(bytes(bad_header))
    bad_body = bytearray(blob)
    bad_body[header.layers[1].offset + 3] ^= 0x40
    with pytest.raises(CorruptChunkError, match="layer 1"):
        decode(bytes(bad_body))
    huge = bytearray(blob)
    huge[4:8] = struct.pack("<I", 1 << 30)
    with pytest.raises(CorruptChunkError, match="header length"):
        decode(bytes(huge))


def _with_header(raw_header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<4sII", codec.MAGIC, len(raw_header), zlib.crc32(raw_header)) + raw_header + body


def test_unparseable_header_with_valid_checksum_is_corrupt():
    with pytest.raises(CorruptChunkError):
        decode(_with_header(b"\xc1"))  # never-used msgpack byte
    with pytest.raises(CorruptChunkError):
        decode(_with_header(msgspec.msgpack.encode({"version": codec.FORMAT_VERSION, "fingerprint": 3})))
    header, _ = codec.read_header(BLOBS["none"])
    wrong = msgspec.structs.replace(header, compression="lz4")
    with pytest.raises(CorruptChunkError):
        decode(_with_header(msgspec.msgpack.encode(wrong)))


def test_an_older_format_version_is_not_read_nor_damage():
    header, _ = codec.read_header(BLOBS["none"])
    older = msgspec.msgpack.encode({**msgspec.structs.asdict(header), "version": codec.PLAIN_VERSION - 1})
    with pytest.raises(FormatVersionError, match="version") as got:
        decode(_with_header(older))
    assert not proves_damage(got.value)


def test_a_newer_format_version_is_not_read_nor_damage():
    header, _ = codec.read_header(BLOBS["none"])
    newer = msgspec.msgpack.encode(
        {**msgspec.structs.asdict(header), "version": codec.FORMAT_VERSION + 1, "extra": [1, 2]}
    )
    with pytest.raises(FormatVersionError, match="version") as got:
        decode(_with_header(newer))
    assert not proves_damage(got.value)


# -- foreign chunks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, key, start, n_tokens, field",
    [
        (make_spec(torch.bfloat16, fingerprint="cd" * 16), KEY, 12, 6, "fingerprint"),
        (SPEC, "f" * 32, 12, 6, "key"),
        (SPEC, KEY, 0, 6, "start"),
        (SPEC, KEY, 12, 5, "n_tokens"),
        (make_spec(torch.float16), KEY, 12, 6, "dtype"),
        (make_spec(torch.bfloat16, layers=4), KEY, 12, 6, "num_layers"),
        (make_spec(torch.bfloat16, heads=1), KEY, 12, 6, "num_kv_heads"),
        (make_spec(torch.bfloat16, dim=4), KEY, 12, 6, "head_dim"),
    ],
)
def test_foreign_chunk(spec, key, start, n_tokens, field):
    with pytest.raises(ForeignChunkError, match=field):
        codec.decode_chunk(BLOBS["zstd"], spec, key, start, n_tokens)
    header, _ = codec.read_header(BLOBS["zstd"])
    with pytest.raises(ForeignChunkError):
        codec.check_header(header, spec, key, start, n_tokens)


# -- header probe and per-layer reads ------------------------------------------------------------


def test_short_probe_asks_for_more():
    blob = BLOBS["none"]
    header, end = codec.read_header(blob)
    with pytest.raises(TruncatedChunkError):
        codec.header_length(blob[:5])
    assert codec.header_length(blob[:12]) == end
    with pytest.raises(TruncatedChunkError):
        codec.read_header(blob[: end - 1])
    assert codec.read_header(blob[:end]) == (header, end)


def test_big_model_header_fits_the_probe():
    spec = make_spec(torch.float16, layers=80, heads=8, dim=128)
    blob = codec.encode_chunk(make_chunk(spec, n_tokens=256), spec, KEY, compression="zstd")
    assert codec.header_length(blob) <= codec.HEADER_PROBE


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_layer_range_reads_equal_full_decode(compression):
    blob = BLOBS[compression]
    full = decode(blob).data
    header, _ = codec.read_header(blob[: codec.HEADER_PROBE])
    codec.check_header(header, SPEC, KEY, 12, 6)
    wanted = [2, 0]
    sections = {i: blob[a:b] for i, (a, b) in zip(wanted, codec.layer_ranges(header, wanted), strict=True)}
    assert torch.equal(codec.decode_layers(header, sections, SPEC, wanted), full[[2, 0]])
    assert torch.equal(codec.decode_layers(header, sections, SPEC), full[[0, 2]])  # default: sorted
    one = codec.decode_layers(header, {1: blob.__getitem__(slice(*codec.layer_ranges(header, [1])[0]))}, SPEC)
    assert torch.equal(one[0], full[1])

    a, b = codec.layer_ranges(header, [1])[0]
    with pytest.raises(TruncatedChunkError):
        codec.decode_layers(header, {1: blob[a : b - 1]}, SPEC)
    damaged = bytearray(blob[a:b])
    damaged[0] ^= 1
    with pytest.raises(CorruptChunkError):
        codec.decode_layers(header, {1: bytes(damaged)}, SPEC)
    with pytest.raises(ValueError):
        codec.decode_layers(header, sections, SPEC, [1])


def test_encode_rejects_mismatched_chunks():
    spec = make_spec()
    with pytest.raises(ValueError, match="shape"):
        codec.encode_chunk(make_chunk(make_spec(layers=2)), spec, KEY)
    with pytest.raises(ValueError, match="dtype"):
        codec.encode_chunk(make_chunk(make_spec(torch.float16)), spec, KEY)
    with pytest.raises(ValueError, match="compression"):
        codec.encode_chunk(make_chunk(spec), spec, KEY, compression="lz4")
