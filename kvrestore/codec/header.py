"""The framing of a stored chunk: its constants, its msgpack header, and reading and checking that header.

An object starts with `MAGIC`, the header's length and the header's crc32 (`PREFIX_SIZE` bytes), then the
header (`ChunkHeader`: whose chunk, its shapes and dtype, and each layer's `LayerSection`), then from
`body_start_after(header end)` a format-6 chunk's head table (`head_table_span`), then the sections. `codec.chunk` encodes and decodes whole chunks with it;
`codec.boundary` frames boundary activations the same way.
"""

from __future__ import annotations

import struct
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from kvrestore.codec import quant
from kvrestore.codec.seal import TAG_SIZE, Seal, SectionTags
from kvrestore.core.errors import (
    CorruptChunkError,
    ForeignChunkError,
    FormatVersionError,
    TruncatedChunkError,
    UnauthenticatedChunkError,
    UnknownLayoutError,
)
from kvrestore.core.spec import ModelSpec, dtype_name

MAGIC = b"KVRC"
#: 6: per-head checks (`HeadsHeader`: a reader of some heads reads only theirs); 5: the writer's key
#: layout (`TiledHeader.key_tile`); 4: KV encodings; 3: a device checksum per section; 2: xxh3-64
#: section checksums
FORMAT_VERSION = 6
#: the version of a chunk written with its keys in tiles and no per-head checks: format 5 as it was
TILED_VERSION = 5
#: the version of a chunk written with neither: format 4 as it was, byte for byte, so every reader of
#: format 4 still reads it (and a format-4 reader takes a tiled chunk for foreign)
PLAIN_VERSION = 4
READ_VERSIONS = (PLAIN_VERSION, TILED_VERSION, FORMAT_VERSION)
HEADER_PROBE = 4096
#: bytes of one (layer, head)'s xxh3-64 in a format-6 chunk's head table (`head_table_span`)
HEAD_SUM = 8
COMPRESSIONS = ("none", "zstd")

_PREFIX = struct.Struct("<4sII")  # magic, header length, header crc32
PREFIX_SIZE = _PREFIX.size
# A sane header is a few KiB even for 128 layers; a larger length field is damage, not a big header.
MAX_HEADER = 1 << 20
#: sections start at a multiple of this offset, so a section read into an aligned buffer can be viewed as
#: a tensor of any dtype (and DMA copies start on a cache line)
BODY_ALIGN = 64

Buffer = bytes | bytearray | memoryview


class LayerSection(msgspec.Struct, frozen=True, array_like=True):
    """Where one layer's K+V lives in the object. `offset` is absolute from the object start."""

    offset: int
    length: int  # stored (possibly compressed) bytes
    raw_length: int  # bytes of the encoded section (native: of the [2, H, T, D] tensor), before compression
    checksum: int  # xxh3-64 of the stored bytes
    device_sum: int  # `checksums.device_checksums` of the raw bytes (0 where rows are not whole words)


class ChunkHeader(msgspec.Struct, frozen=True):
    version: int
    fingerprint: str
    key: str
    start: int
    n_tokens: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    compression: Literal["none", "zstd"]
    layers: list[LayerSection]
    #: the KV encoding of the sections (`quant.Encoding.tag`): name, scales' dtype, group size
    encoding: tuple[str, str, int] = ("native", "", 0)
    #: the writer's keyed MAC of this header with `mac` empty (`codec.seal`); empty where unsigned
    mac: bytes = b""

    @property
    def end(self) -> int:
        """Offset one past the last section: the object's exact size."""
        return max((s.offset + s.length for s in self.layers), default=0)


class TiledHeader(ChunkHeader, frozen=True, kw_only=True):
    """The header of a format-5 chunk: a native one whose keys the writer stored in tiles of `key_tile`
    tokens, each column-major (per head ``[T / key_tile, D, key_tile]``: vLLM's CPU pages keep a page's
    keys so), its values as in every chunk (`codec.layout`). A reader in that layout reads the keys
    straight into its pages; any other converts them on read."""

    key_tile: int


class SignedHeader(ChunkHeader, frozen=True, kw_only=True):
    """The header of a signed chunk (`codec.seal`): a plain one (format 4) with the random `salt` its
    section key is derived from and each section's GMAC tag (`tags`, 16 bytes each, in layer order),
    all under its `mac`. A reader that predates them decodes the header without them (msgpack fields
    it does not know are skipped): unsigned, it reads the chunk as before; signed, its MAC fails."""

    salt: bytes = b""
    tags: bytes = b""


class SignedTiledHeader(ChunkHeader, frozen=True, kw_only=True):
    """`SignedHeader` for a format-5 chunk: `TiledHeader`'s fields, then the salt and the tags."""

    key_tile: int
    salt: bytes = b""
    tags: bytes = b""


class HeadsHeader(ChunkHeader, frozen=True, kw_only=True):
    """The header of a format-6 chunk: a native, uncompressed one of more than one head whose writer
    checked each head of each section on its own (`codec.heads`). The checks are a *head table* between
    the header's padding and the first section (`head_table_span`), so that the header stays as small
    as a format-4 one (within `HEADER_PROBE`) for the readers that never use them; the header holds the
    table's xxh3-64 (`head_sum`). `key_tile` as in `TiledHeader`, 0 where the keys are row-major."""

    key_tile: int = 0
    head_sum: int = 0


class SignedHeadsHeader(ChunkHeader, frozen=True, kw_only=True):
    """`HeadsHeader` signed (`codec.seal`): its fields, the salt and section tags of `SignedHeader`, and
    the head table's GMAC tag (`head_tag`; the table then holds each head's tag as well)."""

    key_tile: int = 0
    head_sum: int = 0
    salt: bytes = b""
    tags: bytes = b""
    head_tag: bytes = b""


def head_table_span(header: ChunkHeader) -> tuple[int, int]:
    """Where a format-6 chunk's head table lies, [start, end): right before its first section, each
    (layer, head)'s xxh3-64 (`HEAD_SUM` bytes) and, signed, its GMAC tag (`TAG_SIZE`), zero-padded to
    `BODY_ALIGN`; (0, 0) in any other chunk."""
    if header.version != FORMAT_VERSION or not header.layers:
        return 0, 0
    per_head = HEAD_SUM + (TAG_SIZE if header.mac else 0)
    size = -(-per_head * header.num_layers * header.num_kv_heads // BODY_ALIGN) * BODY_ALIGN
    end = header.layers[0].offset
    return end - size, end


def key_tile(header: ChunkHeader) -> int:
    """The tokens of the writer's key tiles (`TiledHeader`, `HeadsHeader`), or 0: keys row-major, as in
    every format-4 chunk."""
    return int(getattr(header, "key_tile", 0))


class _Versioned(msgspec.Struct):
    """Just the version field, read first so a newer format is reported as foreign, not corrupt."""

    version: int


_ENCODER = msgspec.msgpack.Encoder()
#: per version: the decoder of an unsigned header, and of a signed one
_DECODERS: dict[int, tuple[msgspec.msgpack.Decoder, msgspec.msgpack.Decoder]] = {
    PLAIN_VERSION: (msgspec.msgpack.Decoder(ChunkHeader), msgspec.msgpack.Decoder(SignedHeader)),
    TILED_VERSION: (msgspec.msgpack.Decoder(TiledHeader), msgspec.msgpack.Decoder(SignedTiledHeader)),
    FORMAT_VERSION: (msgspec.msgpack.Decoder(HeadsHeader), msgspec.msgpack.Decoder(SignedHeadsHeader)),
}
_VERSION_DECODER = msgspec.msgpack.Decoder(_Versioned)


def _require_little_endian() -> None:
    # Sections are the tensor's in-memory bytes; on a big-endian host they would need byte swapping.
    if sys.byteorder != "little":
        raise NotImplementedError(
            "the kvrestore chunk format is little-endian; big-endian hosts are unsupported"
        )


def spec_encoding(spec: ModelSpec, name: object = "native") -> quant.Encoding:
    """The encoding `name` for `spec`'s KV (InvalidInputError where there is none such)."""
    return quant.encoding(name, spec.dtype, spec.num_kv_heads, spec.head_dim)


def header_encoding(header: ChunkHeader, spec: ModelSpec) -> quant.Encoding:
    """The encoding the header names, for `spec`'s KV; UnknownLayoutError where this reader lacks it."""
    return quant.from_tag(header.encoding, spec.dtype, spec.num_kv_heads, spec.head_dim)


# -- header ---------------------------------------------------------------------------------------


def header_length(prefix: Buffer) -> int:
    """Total bytes (from the object start) needed to parse the header; needs the first 12 bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise TruncatedChunkError(
            f"object is {len(prefix)} bytes, shorter than the {PREFIX_SIZE}-byte prefix"
        )
    magic, hlen, _ = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if hlen > MAX_HEADER:
        raise CorruptChunkError(f"header length {hlen} exceeds the {MAX_HEADER}-byte limit")
    return PREFIX_SIZE + hlen


def read_header(prefix: Buffer) -> tuple[ChunkHeader, int]:
    """Parse and verify the header at the start of `prefix`; returns (header, header_end).

    Raises TruncatedChunkError when `prefix` stops before the header does (fetch `header_length(prefix)`
    bytes and call again), CorruptChunkError on a bad magic, checksum or structure, FormatVersionError
    on a format version this reader does not read (a newer release's: kept in the store).
    """
    need = header_length(prefix)
    if len(prefix) < need:
        raise TruncatedChunkError(f"header needs {need} bytes, only {len(prefix)} available")
    _, _, crc = _PREFIX.unpack_from(prefix, 0)
    raw = memoryview(prefix)[PREFIX_SIZE:need]
    if zlib.crc32(raw) != crc:
        raise CorruptChunkError("header checksum mismatch")
    try:
        version = _VERSION_DECODER.decode(raw).version
        if version not in READ_VERSIONS:
            raise FormatVersionError(f"chunk format version {version}, this reader handles {READ_VERSIONS}")
        # a header is re-encoded as it was decoded (its MAC is over that): each version and each of
        # signed and unsigned its own struct
        plain, signed = _DECODERS[version]
        header = plain.decode(raw)
        if header.mac:
            header = signed.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptChunkError(f"unparseable chunk header: {e}") from e
    _check_sections(header, need)
    return header, need


def body_start_after(header_end: int) -> int:
    """Where the first section starts: the header's end rounded up to `BODY_ALIGN` (zero padding)."""
    return -(-header_end // BODY_ALIGN) * BODY_ALIGN


def frame(magic: bytes, header_for: Callable[[int], bytes], payloads: Sequence[Buffer]) -> bytes:
    """The object: prefix, the header `header_for(body_start)` encodes, zero padding, then `payloads`.

    Offsets are absolute, so the header's size depends on the offsets it holds. msgpack ints only grow
    with their value, so growing body_start until it stops changing reaches the exact fixed point."""
    body_start, hdr = PREFIX_SIZE, header_for(PREFIX_SIZE)
    while (after := body_start_after(PREFIX_SIZE + len(hdr))) != body_start:
        body_start, hdr = after, header_for(after)
    prefix = _PREFIX.pack(magic, len(hdr), zlib.crc32(hdr))
    return b"".join([prefix, hdr, bytes(body_start - PREFIX_SIZE - len(hdr)), *payloads])


def expect_fields(what: str, header: object, want: Mapping[str, object]) -> None:
    """ForeignChunkError naming the first field of `header` that is not what `want` says."""
    for field, value in want.items():
        got = getattr(header, field)
        if got != value:
            raise ForeignChunkError(f"{what} {field} is {got!r}, expected {value!r}")


def _check_sections(header: ChunkHeader, header_end: int) -> None:
    """Sections must follow the header's padding back to back in layer order: no gaps, overlaps or odd
    sizes."""
    if len(header.layers) != header.num_layers:
        raise CorruptChunkError(f"header lists {len(header.layers)} sections for {header.num_layers} layers")
    table = head_table_span(header)
    off = body_start_after(header_end) + table[1] - table[0]
    for i, s in enumerate(header.layers):
        if s.offset != off or s.length < 0 or s.raw_length < 0:
            raise CorruptChunkError(f"section {i} at {s.offset}+{s.length} does not follow byte {off}")
        if header.compression == "none" and s.length != s.raw_length:
            raise CorruptChunkError(f"uncompressed section {i} has length {s.length} != raw {s.raw_length}")
        off += s.length
    tile = key_tile(header)
    least = 1 if header.version == TILED_VERSION else 0
    if tile < least or (tile and header.n_tokens % tile):
        raise CorruptChunkError(f"key tiles of {tile} tokens in a chunk of {header.n_tokens}")
    if header.version == FORMAT_VERSION and header.compression != "none":
        raise CorruptChunkError(f"head checks of {header.compression} sections")


def _check_spec(header: ChunkHeader, spec: ModelSpec) -> quant.Encoding:
    expect = {
        "fingerprint": spec.fingerprint,
        "dtype": dtype_name(spec.dtype),
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
    }
    expect_fields("chunk", header, expect)
    enc = header_encoding(header, spec)
    if (key_tile(header) or header.version == FORMAT_VERSION) and not enc.native:
        raise UnknownLayoutError(f"key tiles or head checks in a chunk of the {enc.name} encoding")
    raw = enc.section_bytes(header.n_tokens)
    for i, s in enumerate(header.layers):
        if s.raw_length != raw:
            raise ForeignChunkError(f"section {i} holds {s.raw_length} raw bytes, expected {raw}")
    return enc


def check_header(
    header: ChunkHeader,
    spec: ModelSpec,
    key: str,
    start: int,
    n_tokens: int,
    encoding: str = "native",
    seal: Seal | None = None,
) -> SectionTags | None:
    """Raise ForeignChunkError unless the chunk is exactly the one asked for, for this model and dtype,
    in the reader's `encoding` (a reader reads its own encoding only: see `docs/tutorial-stores.md`);
    with a `seal`, UnauthenticatedChunkError first unless the header carries its valid MAC and a tag
    for each section. Returns those sections' tags (`codec.seal`; None without a seal)."""
    tags = None if seal is None else seal.check(header, _ENCODER, len(header.layers))
    if tags is not None and header.version == FORMAT_VERSION and len(getattr(header, "head_tag", b"")) != TAG_SIZE:
        raise UnauthenticatedChunkError("chunk has head checks without their tag")
    expect_fields("chunk", header, {"key": key, "start": start, "n_tokens": n_tokens})
    enc = _check_spec(header, spec)
    if enc.name != encoding:
        raise ForeignChunkError(f"chunk encoding is {enc.name!r}, this reader reads {encoding!r}")
    return tags


def probe_header(
    head: Buffer,
    spec: ModelSpec,
    key: str,
    start: int,
    n_tokens: int,
    encoding: str = "native",
    seal: Seal | None = None,
) -> ChunkHeader:
    """The checked header (`check_header`) at the start of `head`, the first bytes of a stored object
    (`HEADER_PROBE` or more: where the header is longer, `read_header` raises TruncatedChunkError and
    `header_length(head)` says how many bytes to read instead), and the padding after it zero as far
    as `head` holds it. What every reader that reads a chunk's sections by range checks first."""
    header, header_end = read_header(head)
    check_header(header, spec, key, start, n_tokens, encoding, seal)
    body = body_start_after(header_end) if header.layers else header_end  # a head table's start
    if any(memoryview(head)[header_end : min(body, len(head))]):
        raise CorruptChunkError("nonzero padding between header and sections")
    return header


def layer_ranges(header: ChunkHeader, layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the given layers' sections (all layers by default), for get_ranges."""
    idx = range(header.num_layers) if layers is None else layers
    return [(header.layers[i].offset, header.layers[i].offset + header.layers[i].length) for i in idx]


def layer_span(header: ChunkHeader, layers: range) -> tuple[int, int]:
    """The bytes [start, end) that hold the sections of consecutive `layers`: one range read for all."""
    first, last = header.layers[layers[0]], header.layers[layers[-1]]
    return first.offset, last.offset + last.length


def span_sections(header: ChunkHeader, layers: range, span: Buffer) -> dict[int, memoryview]:
    """Each layer's section within `span`, the bytes `layer_span(header, layers)` read."""
    sections, mv = header.layers, memoryview(span)
    a = sections[layers[0]].offset
    return {i: mv[sections[i].offset - a : sections[i].offset - a + sections[i].length] for i in layers}


def back_to_back(header: ChunkHeader, layers: range) -> bool:
    """Whether the sections of `layers` follow one another with nothing between (as `encode_chunk`
    writes them): their span is then the layers' rows, one after another."""
    s = header.layers
    return all(s[i].offset + s[i].length == s[i + 1].offset for i in layers[:-1])
