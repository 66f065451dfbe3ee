"""Boundary activations (stage-parallel restore, `kvrestore.distributed`): objects of their own.

One object per chunk and stage boundary, under `boundary_key(chunk key, layer)`: the chunk format's
framing (`codec.chunk`) with magic b"KVRB" and its own version (`BOUNDARY_VERSION`), a header naming the
chunk, layer, token range and hidden size, and one section, the hidden state entering that layer for the
chunk's tokens ([T, hidden], given the whole prefix before them). The KV chunk format is unchanged by
them: a chunk saved without boundary activations restores exactly as before, and a stage that finds none
falls back to the sequential pipeline. With a secret (`codec.seal`) the section carries a GMAC tag and
the header a MAC over everything, as a chunk's do: a stage computes from no activation a store's other
writers could have planted.
"""

from __future__ import annotations

import hashlib
import zlib

import msgspec
import torch

from kvrestore.codec.checksums import host_checksum
from kvrestore.codec.chunk import copy_bytes
from kvrestore.codec.header import (
    _ENCODER,
    _PREFIX,
    _VERSION_DECODER,
    MAX_HEADER,
    PREFIX_SIZE,
    Buffer,
    _require_little_endian,
    body_start_after,
    expect_fields,
    frame,
)
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import (
    CorruptChunkError,
    FormatVersionError,
    InvalidInputError,
    TruncatedChunkError,
    UnauthenticatedChunkError,
)
from kvrestore.core.spec import ModelSpec, dtype_name

BOUNDARY_MAGIC = b"KVRB"
BOUNDARY_VERSION = 1


class BoundaryHeader(msgspec.Struct, frozen=True):
    """The header of a boundary-activation object: whose hidden states, where, and their one section."""

    version: int
    fingerprint: str
    key: str  # the chunk's key (the object lives under `boundary_key(key, layer)`)
    layer: int  # the hidden state entering this decoder layer
    start: int
    n_tokens: int
    hidden_size: int
    dtype: str
    offset: int
    length: int
    checksum: int  # xxh3-64 of the section


class SignedBoundaryHeader(BoundaryHeader, frozen=True, kw_only=True):
    """`BoundaryHeader` with what a secret adds (`codec.seal`): the writer's MAC of the header (with `mac`
    empty), the salt of the section's key and the section's tag; all empty where unsigned."""

    mac: bytes = b""
    salt: bytes = b""
    tags: bytes = b""


_BOUNDARY_DECODER = msgspec.msgpack.Decoder(SignedBoundaryHeader)


def boundary_key(chunk_key: str, layer: int) -> str:
    """The store key of chunk `chunk_key`'s boundary activation at `layer` (hex, like chunk keys)."""
    h = hashlib.blake2b(f"kvrestore-boundary-v1|{chunk_key}|{layer}".encode(), digest_size=20)
    return h.hexdigest()


def encode_boundary(
    hidden: torch.Tensor, spec: ModelSpec, chunk_key: str, start: int, layer: int, seal: Seal | None = None
) -> bytes:
    """Serialise `hidden` ([T, hidden_size] in `spec.dtype`): the input of `layer` for the chunk's tokens;
    signed with `seal` where given."""
    _require_little_endian()
    if hidden.dim() != 2 or hidden.dtype != spec.dtype:
        raise InvalidInputError(
            f"boundary activation must be [T, hidden] {spec.dtype}, got {tuple(hidden.shape)} {hidden.dtype}"
        )
    payload = hidden.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy().data
    n_tokens, hidden_size = int(hidden.shape[0]), int(hidden.shape[1])
    salt, tags = seal.tag_sections([payload]) if seal is not None else (b"", b"")

    def header_for(offset: int) -> bytes:
        fields = (
            BOUNDARY_VERSION,
            spec.fingerprint,
            chunk_key,
            layer,
            start,
            n_tokens,
            hidden_size,
            dtype_name(spec.dtype),
            offset,
            payload.nbytes,
            host_checksum(payload),
        )
        if seal is None:
            return _ENCODER.encode(BoundaryHeader(*fields))
        return seal.sign(SignedBoundaryHeader(*fields, salt=salt, tags=tags), _ENCODER)

    return frame(BOUNDARY_MAGIC, header_for, [payload])


def decode_boundary(
    data: Buffer,
    spec: ModelSpec,
    chunk_key: str,
    start: int,
    n_tokens: int,
    layer: int,
    hidden_size: int,
    seal: Seal | None = None,
) -> torch.Tensor:
    """Verify a boundary-activation object and return its hidden states [n_tokens, hidden_size].

    Raises CorruptChunkError (magic, checksums, structure), TruncatedChunkError, ForeignChunkError (not
    this chunk's activation at this layer, of this model and dtype), FormatVersionError (another
    version), or with a `seal` UnauthenticatedChunkError (no valid MAC, or a section that fails its
    tag)."""
    if len(data) < PREFIX_SIZE:
        raise TruncatedChunkError(f"object is {len(data)} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, hlen, crc = _PREFIX.unpack_from(data, 0)
    if magic != BOUNDARY_MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r}, expected {BOUNDARY_MAGIC!r}")
    if hlen > MAX_HEADER or len(data) < PREFIX_SIZE + hlen:
        raise TruncatedChunkError(f"boundary header of {hlen} bytes does not fit a {len(data)}-byte object")
    raw = memoryview(data)[PREFIX_SIZE : PREFIX_SIZE + hlen]
    if zlib.crc32(raw) != crc:
        raise CorruptChunkError("boundary header checksum mismatch")
    try:
        version = _VERSION_DECODER.decode(raw).version
        if version != BOUNDARY_VERSION:
            raise FormatVersionError(
                f"boundary format version {version}, this reader handles {BOUNDARY_VERSION}"
            )
        header = _BOUNDARY_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptChunkError(f"unparseable boundary header: {e}") from e
    tags = None if seal is None else seal.check(header, _ENCODER, 1)
    want = {
        "fingerprint": spec.fingerprint,
        "key": chunk_key,
        "layer": layer,
        "start": start,
        "n_tokens": n_tokens,
        "hidden_size": hidden_size,
        "dtype": dtype_name(spec.dtype),
    }
    expect_fields("boundary", header, want)
    size = n_tokens * hidden_size * spec.dtype.itemsize
    if header.length != size or header.offset != body_start_after(PREFIX_SIZE + hlen):
        raise CorruptChunkError(
            f"boundary section {header.offset}+{header.length} is not {size} bytes after its header"
        )
    if len(data) != header.offset + size:
        err = TruncatedChunkError if len(data) < header.offset + size else CorruptChunkError
        raise err(f"boundary object is {len(data)} bytes, its header says {header.offset + size}")
    section = memoryview(data)[header.offset :]
    if tags is None or not tags.matches(0, section, header.tags):
        if host_checksum(section) != header.checksum:
            raise CorruptChunkError("boundary section checksum mismatch")
        if tags is not None:
            raise UnauthenticatedChunkError("boundary section tag does not match this reader's secret")
    hidden = torch.empty((n_tokens, hidden_size), dtype=spec.dtype)
    copy_bytes(hidden, section)  # a tensor of its own: `data` may be a store's buffer, reused later
    return hidden


__all__ = [
    "BOUNDARY_MAGIC",
    "BOUNDARY_VERSION",
    "BoundaryHeader",
    "boundary_key",
    "decode_boundary",
    "encode_boundary",
]
