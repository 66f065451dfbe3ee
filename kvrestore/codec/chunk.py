"""Chunk wire format: one self-checking object per chunk.

Layout::

    b"KVRC" | u32 LE header length | u32 LE crc32(header) | header (msgpack ChunkHeader)
        | head table (format 6 only) | sections

There is one section per layer holding that layer's K then V: in the native encoding the raw
little-endian bytes of the [2, H, T, D] tensor (C order), in a quantized one (`quant`: int8, fp8,
int4) its values and their scales, padded to whole int64 words; optionally zstd-compressed per section. The header lists each section's absolute
offset, stored length, raw length and xxh3-64 checksum, so

* one layer of one chunk is exactly one range read (`layer_ranges` + `decode_layers`), and
* every byte of the object is covered by a check: magic, header crc32, two checksums per section
  (`checksums`: xxh3-64 of the stored bytes for a host reader, a weighted int64 sum of the raw bytes
  for a reader that uploads the section to a GPU first and verifies it there), the head table (format 6)
  by its xxh3-64 in the header, and the object must end exactly where the last section ends. A damaged
  chunk is always reported, never decoded wrongly.
* with a secret (`seal`), the header also holds a salt and every section's GMAC tag under its keyed
  MAC (`SignedHeader`), and a reader with the secret checks a section's tag (`check_section`) where a
  reader without one checks its xxh3-64: checksums catch damage, the tags forgery.

Format 6 added per-head checks (`HeadsHeader`, `codec.heads`): a head table between the header's
padding and the first section (the header holds its xxh3-64 and, signed, its tag) with, for each
(layer, head), the xxh3-64 of that head's keys then values as stored, and with a secret their GMAC tag,
so a reader of some heads (a tensor-parallel rank reading a chunk of more heads) reads the table and
range-reads only their bytes, two ranges a layer, and verifies each head on its own; a whole-object read
checks the table, every other reader skips it. It is written where a reader can use it: native,
uncompressed sections of more than one head (keys in tiles or not). Format 5 added the writer's key layout
(`TiledHeader.key_tile`, `codec.layout`: keys stored as vLLM's CPU pages keep them, converted on read by
every other reader). A chunk with neither is still written as format 4, byte for byte, with tiles only
as format 5, and every reader reads all three. Format 4 added the encodings (the header names one,
`ChunkHeader.encoding`; both checksums cover the encoded bytes as stored), format 3 the device
checksum. A chunk of a format this reader does not read, older or newer, is a clean miss
(`FormatVersionError`), recomputed, and left in the store for the releases that read it.

The framing (prefix, header, reading and checking it: `probe_header`) is `codec.header`; boundary
activations (`codec.boundary`) use the same framing under their own magic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import torch
import zstandard

from kvrestore.codec.checksums import (
    as_signed,
    device_checkable,
    device_checksums,
    host_checksum,
    host_checksum_parts,
)
from kvrestore.codec.header import (
    _ENCODER,
    _PREFIX,  # noqa: F401 - tests frame headers through codec.chunk
    BODY_ALIGN,
    COMPRESSIONS,
    FORMAT_VERSION,
    HEADER_PROBE,
    MAGIC,
    PLAIN_VERSION,
    PREFIX_SIZE,
    READ_VERSIONS,
    TILED_VERSION,
    Buffer,
    ChunkHeader,
    HeadsHeader,
    LayerSection,
    SignedHeader,
    SignedHeadsHeader,
    SignedTiledHeader,
    TiledHeader,
    _check_spec,
    _require_little_endian,
    back_to_back,
    body_start_after,
    check_header,
    frame,
    head_table_span,
    header_encoding,
    header_length,
    key_tile,
    layer_ranges,
    layer_span,
    probe_header,
    read_header,
    span_sections,
    spec_encoding,
)
from kvrestore.codec.heads import (
    head_checked,
    head_parts,
    head_sums,
    head_table,
    read_head_checks,
    wants_head_checks,
)
from kvrestore.codec.layout import byte_tensor, copy_bytes, cpu_out, place_rows, tile_keys
from kvrestore.codec.quant import Encoding
from kvrestore.codec.seal import Seal, section_tag
from kvrestore.core.errors import (
    CorruptChunkError,
    InvalidInputError,
    TruncatedChunkError,
    UnauthenticatedChunkError,
)
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec, dtype_name

# -- encode --------------------------------------------------------------------------------------


def encode_chunk(
    chunk: KVChunk,
    spec: ModelSpec,
    key: str,
    *,
    compression: str = "none",
    level: int = 1,
    encoding: str = "native",
    seal: Seal | None = None,
    key_tile: int = 0,
    head_checks: bool = True,
) -> bytes:
    """Serialise `chunk` (data [L, 2, H, T, D] in `spec.dtype`) for storage under `key`, its sections
    in `encoding` (`quant.ENCODINGS`; encoded where the KV lies, e.g. on its GPU), its header signed
    with `seal` where given (`codec.seal`). With `key_tile` (native only, dividing T) the keys are
    stored in tiles of that many tokens, column-major in each (`codec.layout`). Native, uncompressed
    and of more than one head, the chunk carries per-head checks (`codec.heads`: format 6) unless
    `head_checks` is False; without either it is format 4 as every reader reads it, with tiles only
    format 5.

    Native and uncompressed, the tensor bytes are copied exactly once (into the returned object).
    """
    _require_little_endian()
    if compression not in COMPRESSIONS:
        raise InvalidInputError(f"unknown compression {compression!r}; use one of {COMPRESSIONS}")
    enc = spec_encoding(spec, encoding)
    data = chunk.data
    L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    if data.dim() != 5 or (data.shape[0], data.shape[1], data.shape[2], data.shape[4]) != (L, 2, H, D):
        raise InvalidInputError(
            f"chunk shape {tuple(data.shape)} does not match spec [L={L}, 2, H={H}, T, D={D}]"
        )
    if data.dtype != spec.dtype:
        raise InvalidInputError(f"chunk dtype {data.dtype} does not match spec dtype {spec.dtype}")
    if key_tile and (not enc.native or key_tile < 0 or data.shape[3] % key_tile):
        raise InvalidInputError(f"key tiles of {key_tile} tokens need native chunks of whole tiles")
    # native: the KV's own bytes; else its encoded sections [L, section bytes], whole int64 words
    dense = data.detach().contiguous() if enc.native else enc.encode(data.detach())
    if key_tile:
        dense = tile_keys(dense, key_tile)
    n_tokens = int(data.shape[3])
    heads = head_checks and wants_head_checks(H, enc.native, compression)
    return _frame(dense, chunk.start, n_tokens, spec, key, enc, compression, level, seal, key_tile, heads)


def encode_sections(
    sections: torch.Tensor,
    start: int,
    n_tokens: int,
    spec: ModelSpec,
    key: str,
    *,
    encoding: str,
    compression: str = "none",
    level: int = 1,
    seal: Seal | None = None,
) -> bytes:
    """`encode_chunk` for KV that is already in `encoding`: `sections` (uint8 [L, section bytes], laid
    out as `Encoding.views` reads them) are stored as they are, values and scales, with no decode and
    re-encode between (a KV cache that holds fp8 values with their scales, as vLLM's fp8 cache does)."""
    _require_little_endian()
    if compression not in COMPRESSIONS:
        raise InvalidInputError(f"unknown compression {compression!r}; use one of {COMPRESSIONS}")
    enc = spec_encoding(spec, encoding)
    want = (spec.num_layers, enc.section_bytes(n_tokens))
    if sections.dtype != torch.uint8 or tuple(sections.shape) != want:
        raise InvalidInputError(
            f"{encoding} sections of {n_tokens} tokens are uint8 {list(want)}, got {sections.dtype} "
            f"{list(sections.shape)}"
        )
    return _frame(sections.contiguous(), start, n_tokens, spec, key, enc, compression, level, seal)


def _frame(
    dense: torch.Tensor,
    start: int,
    n_tokens: int,
    spec: ModelSpec,
    key: str,
    enc: Encoding,
    compression: str,
    level: int,
    seal: Seal | None,
    tile: int = 0,
    heads: bool = False,
) -> bytes:
    """The stored object for `dense`, the chunk's sections ([L, ...] contiguous, any device), its keys in
    tiles of `tile` tokens where not 0 (`TiledHeader`), with per-head checks where `heads`
    (`HeadsHeader`: native, uncompressed)."""
    L, D = spec.num_layers, spec.head_dim
    if not enc.native or device_checkable(D * dense.element_size()):
        dsums = [as_signed(int(x)) for x in device_checksums(dense).tolist()]  # where the KV is
    else:
        dsums = [0] * L
    # uint8 view of the contiguous CPU tensor: works for bfloat16, which numpy has no dtype for.
    host = dense.to("cpu")
    rows = host.view(torch.uint8).reshape(L, -1).numpy()
    raw_len = rows.shape[1]
    if compression == "zstd":
        cctx = zstandard.ZstdCompressor(level=level)  # per call: compressors are not thread-safe
        payloads: list[Buffer] = [cctx.compress(rows[i].data) for i in range(L)]
    else:
        payloads = [rows[i].data for i in range(L)]
    lengths = [memoryview(p).nbytes for p in payloads]
    sums = [host_checksum(p) for p in payloads]
    per_head = head_parts(rows, spec.num_kv_heads) if heads else []
    salt, tags, head_tags = seal.tag_chunk(payloads, per_head) if seal is not None else (b"", b"", b"")
    table = head_table(head_sums(per_head), head_tags) if heads else b""  # before the sections
    table_sum = host_checksum(table) if heads else 0
    table_tag = seal.sections(salt).table_tag(table) if heads and seal is not None else b""

    def header_for(body_start: int) -> bytes:
        sections, off = [], body_start + len(table)
        for n, c, d in zip(lengths, sums, dsums, strict=True):
            sections.append(LayerSection(off, n, raw_len, c, d))
            off += n
        header = ChunkHeader(
            version=PLAIN_VERSION,
            fingerprint=spec.fingerprint,
            key=key,
            start=start,
            n_tokens=n_tokens,
            dtype=dtype_name(spec.dtype),
            num_layers=L,
            num_kv_heads=spec.num_kv_heads,
            head_dim=D,
            compression=compression,  # type: ignore[arg-type]  # checked against COMPRESSIONS above
            layers=sections,
            encoding=enc.tag,
        )
        fields = msgspec.structs.asdict(header)
        if seal is None:  # formats 4 and 5: byte for byte the header of a release without signatures
            if heads:
                header = HeadsHeader(**{**fields, "version": FORMAT_VERSION}, key_tile=tile, head_sum=table_sum)
            elif tile:
                header = TiledHeader(**{**fields, "version": TILED_VERSION}, key_tile=tile)
            return _ENCODER.encode(header)
        if heads:
            header = SignedHeadsHeader(
                **{**fields, "version": FORMAT_VERSION},
                key_tile=tile,
                head_sum=table_sum,
                salt=salt,
                tags=tags,
                head_tag=table_tag,
            )
        elif tile:
            header = SignedTiledHeader(**{**fields, "version": TILED_VERSION}, key_tile=tile, salt=salt, tags=tags)
        else:
            header = SignedHeader(**fields, salt=salt, tags=tags)
        # the MAC has a fixed size: the header's length is the same whatever the MAC
        return seal.sign(header, _ENCODER)

    return frame(MAGIC, header_for, [table, *payloads] if heads else payloads)


# -- decode ---------------------------------------------------------------------------------------


def bounded_zstd(stored: Buffer, limit: int, what: str) -> bytes:
    """Decompress a zstd frame of at most `limit` bytes, or raise CorruptChunkError. The frame's own
    content size is checked first: python-zstandard allocates whatever a frame header claims, whatever
    `max_output_size` says, so a forged claim of 10^12 bytes would end in a MemoryError."""
    try:
        claimed = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"{what}: zstd: {e}") from e
    if claimed > limit:
        raise CorruptChunkError(f"{what}: zstd frame claims {claimed} bytes, more than its {limit}")
    try:
        return zstandard.ZstdDecompressor().decompress(stored, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"{what}: zstd: {e}") from e


def _fill(
    dst: torch.Tensor, stored: Buffer, header: ChunkHeader, layer: int, enc: Encoding, seal: Seal | None
) -> None:
    """Verify one stored section (`check_section`) and decode it into `dst` ([2, H, T, D], may be a
    strided view of a cache)."""
    section = header.layers[layer]
    if len(stored) < section.length:
        raise TruncatedChunkError(f"layer {layer}: {len(stored)} of {section.length} section bytes")
    if len(stored) > section.length:
        raise CorruptChunkError(f"layer {layer}: {len(stored)} bytes for a {section.length}-byte section")
    check_section(header, layer, stored, seal)
    if header.compression == "zstd":
        raw: Buffer = bounded_zstd(stored, section.raw_length, f"layer {layer}")
        if len(raw) != section.raw_length:
            raise CorruptChunkError(
                f"layer {layer}: decompressed to {len(raw)} bytes, expected {section.raw_length}"
            )
        stored = raw
    if enc.native:
        copy_bytes(dst, stored, key_tile(header))
    else:
        enc.decode(byte_tensor(stored).view(1, -1), dst.unsqueeze(0))


def check_section(
    header: ChunkHeader, layer: int, stored: Buffer | Sequence[Buffer], seal: Seal | None = None
) -> None:
    """Verify the stored bytes of section `layer` (`stored`: its bytes, or its parts in order, where
    they were read straight into place) before any of them is used: without a `seal` against its
    xxh3-64, with one against its GMAC tag (`codec.seal`; the header must have passed `check_header`
    under the same seal). Raises CorruptChunkError where the bytes fail their xxh3-64 (damage),
    UnauthenticatedChunkError where they keep it but fail the tag (a forgery). The GIL is released
    while either hashes."""
    section = header.layers[layer]
    if seal is not None:
        tags = seal.sections(bytes(getattr(header, "salt", b"")))
        if tags.matches(layer, stored, section_tag(header, layer)):
            return
    parts = [stored] if isinstance(stored, (bytes, bytearray, memoryview)) else stored
    if host_checksum_parts(parts) != section.checksum:
        raise CorruptChunkError(f"layer {layer}: section checksum mismatch")
    if seal is not None:
        raise UnauthenticatedChunkError(f"layer {layer}: section tag does not match this reader's secret")


def decode_layers(
    header: ChunkHeader,
    sections: Mapping[int, Buffer],
    spec: ModelSpec,
    layers: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
    seal: Seal | None = None,
) -> torch.Tensor:
    """Decode range-read sections (layer index -> stored bytes) into a tensor [n, 2, H, T, D], each
    verified first (`check_section`: with a `seal`, its tag).

    `layers` gives the output order (default: sorted section indices). The caller is expected to have
    run `check_header` on `header` (with the same `seal`); the shape/dtype part is re-checked here
    because it sizes the output.
    `out` (a CPU tensor of that shape and dtype, e.g. a token slice of a KVCache) receives the KV with a
    single copy from the stored bytes; on a fault it may hold part of the chunk.
    """
    _require_little_endian()
    enc = _check_spec(header, spec)
    order = sorted(sections) if layers is None else list(layers)
    for i in order:
        if not 0 <= i < header.num_layers:
            raise InvalidInputError(f"layer {i} out of range for a {header.num_layers}-layer chunk")
        if i not in sections:
            raise InvalidInputError(f"no section given for layer {i}")
    shape = (len(order), 2, spec.num_kv_heads, header.n_tokens, spec.head_dim)
    out = cpu_out(out, shape, spec.dtype)
    for j, i in enumerate(order):
        _fill(out[j], sections[i], header, i, enc, seal)
    return out if torch.device(device).type == "cpu" else out.to(device)


def check_object(
    data: Buffer,
    spec: ModelSpec,
    key: str,
    start: int,
    n_tokens: int,
    encoding: str = "native",
    seal: Seal | None = None,
) -> ChunkHeader:
    """The checked header of a whole stored object: the chunk asked for, of this model and `encoding`,
    signed under `seal` where given, complete, its padding zero, its head table (format 6) verified.
    The sections are not verified yet (`verify_sections`, or a device checksum)."""
    header = probe_header(data, spec, key, start, n_tokens, encoding, seal)
    end = header.end if header.layers else header_length(data)
    if len(data) < end:
        raise TruncatedChunkError(f"object is {len(data)} bytes, header says {end}")
    if len(data) > end:
        raise CorruptChunkError(f"object is {len(data)} bytes, {len(data) - end} past the last section")
    if head_checked(header):  # unused by a whole read, but every byte of the object is checked
        lo, hi = head_table_span(header)
        read_head_checks(header, memoryview(data)[lo:hi], seal)
    return header


def verify_sections(
    header: ChunkHeader, data: Buffer, seal: Seal | None = None, layers: Sequence[int] | None = None
) -> None:
    """`check_section` of every stored section of a whole object (or of `layers`): against its xxh3-64,
    or with a `seal` its tag; raises naming the first layer that fails."""
    mv = memoryview(data)
    for i in range(header.num_layers) if layers is None else layers:
        s = header.layers[i]
        check_section(header, i, mv[s.offset : s.offset + s.length], seal)


def body(header: ChunkHeader, data: Buffer) -> memoryview:
    """The sections of a whole uncompressed object: the [L, 2, H, T, D] tensor's bytes (native), or its
    L encoded sections back to back."""
    return memoryview(data)[header.layers[0].offset : header.end]


def body_sections(header: ChunkHeader, data: Buffer) -> torch.Tensor:
    """The sections of a whole uncompressed object as a uint8 tensor [L, section bytes] over its bytes
    (no copy where they are writable), for `quant.Encoding.decode`."""
    return byte_tensor(body(header, data)).view(header.num_layers, -1)


def decode_chunk(
    data: Buffer,
    spec: ModelSpec,
    key: str,
    start: int,
    n_tokens: int,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
    encoding: str = "native",
    seal: Seal | None = None,
) -> KVChunk:
    """Verify and decode a whole chunk object into a KVChunk with data [L, 2, H, T, D] in spec.dtype.

    With `out` (see `decode_layers`) the KV is written there, e.g. straight into a KVCache's token range.

    Raises a ChunkDecodeError subclass on any fault: CorruptChunkError (magic, checksums, header,
    sizes), TruncatedChunkError (object ends early), ForeignChunkError (not this chunk of this model).
    """
    header = check_object(data, spec, key, start, n_tokens, encoding, seal)
    mv = memoryview(data)
    sections = {i: mv[s.offset : s.offset + s.length] for i, s in enumerate(header.layers)}
    layers = range(header.num_layers)
    return KVChunk(start, decode_layers(header, sections, spec, layers, device, out, seal))


__all__ = [
    "BODY_ALIGN",
    "COMPRESSIONS",
    "ChunkHeader",
    "FORMAT_VERSION",
    "HEADER_PROBE",
    "HeadsHeader",
    "SignedHeadsHeader",
    "TILED_VERSION",
    "LayerSection",
    "MAGIC",
    "PLAIN_VERSION",
    "SignedHeader",
    "SignedTiledHeader",
    "PREFIX_SIZE",
    "READ_VERSIONS",
    "TiledHeader",
    "key_tile",
    "place_rows",
    "probe_header",
    "body",
    "copy_bytes",
    "body_sections",
    "body_start_after",
    "check_header",
    "check_object",
    "check_section",
    "decode_chunk",
    "decode_layers",
    "encode_chunk",
    "encode_sections",
    "header_encoding",
    "header_length",
    "back_to_back",
    "layer_ranges",
    "layer_span",
    "span_sections",
    "spec_encoding",
    "read_header",
    "verify_sections",
]
