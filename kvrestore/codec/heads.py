"""Per-head checks (format 6): what lets a reader of some of a chunk's KV heads read only their bytes, each
verified before use.

A native section is the ``[2, H, T, D]`` tensor's bytes: head h's keys are bytes [h n, (h + 1) n) of it
and its values [(H + h) n, (H + h + 1) n), n = T D itemsize (keys stored in tiles too: `codec.layout`
keeps a head's tiles together). So heads [a, b) of a layer are two byte ranges (`head_ranges`). A
section's checks (xxh3-64, the device sum, the GMAC tag) cover all of its heads. A format-6 chunk
(`HeadsHeader`) also has a *head table* (`head_table_span`: between the header's padding and the first
section): for each (layer, head), the xxh3-64 of that head's keys then values as stored, and signed,
their GMAC tag (`codec.seal`: a nonce of its own, so a head's bytes are bound to the secret, the chunk,
the layer and the head). The header holds the table's xxh3-64 and, signed, its tag, under the MAC.

A reader of heads [a, b) reads the table (`read_head_checks`, which verifies it), then of each layer it
needs the heads' two ranges; joined (`join_heads`) they are exactly the native sections of a chunk of
b - a heads (`head_sections`), each head checked against its own sum or, with a seal, its tag
(`check_heads`) before a byte is used. Why a table and not the header: the checks are 8 bytes a (layer,
head), 24 signed (19 KB for 80 layers of 8 heads); in the header they would push it past the probe every
layer reader reads first (`HEADER_PROBE`), costing each of them a second read, the readers of whole
sections included, which never use them. Only a reader by head reads the table.

A writer adds them where a reader can use them: native, uncompressed sections of more than one head
(`wants_head_checks`). Quantized and compressed sections keep their whole-section checks: their bytes
are not per head. A chunk without them (formats 4 and 5) is read whole per section, as ever.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvrestore.codec.checksums import host_checksum_parts
from kvrestore.codec.header import (
    BODY_ALIGN,
    FORMAT_VERSION,
    HEAD_SUM,
    Buffer,
    ChunkHeader,
    _check_spec,
    head_table_span,
    key_tile,
)
from kvrestore.codec.layout import copy_bytes, cpu_out
from kvrestore.codec.seal import TAG_SIZE, Seal, SectionTags
from kvrestore.core.errors import (
    CorruptChunkError,
    InvalidInputError,
    TruncatedChunkError,
    UnauthenticatedChunkError,
)
from kvrestore.core.spec import ModelSpec

Span = tuple[int, int]


def wants_head_checks(num_kv_heads: int, native: bool, compression: str) -> bool:
    """Whether a chunk is written with per-head checks (format 6): native, uncompressed, of more than one
    head (a reader of fewer heads than the chunk could use them)."""
    return native and compression == "none" and num_kv_heads > 1


def head_checked(header: ChunkHeader) -> bool:
    """Whether the chunk carries per-head checks (format 6): a reader of some heads may read only theirs."""
    return header.version == FORMAT_VERSION and bool(header.layers)


class HeadChecks:
    """A format-6 chunk's per-head checks, from its verified head table (`read_head_checks`): what
    `check_heads` verifies a head's bytes against (with `tags`, the chunk's under the reader's seal)."""

    def __init__(self, header: ChunkHeader, sums: np.ndarray, tags: bytes, keyed: SectionTags | None) -> None:
        self.header, self.sums, self.tags, self.keyed = header, sums, tags, keyed

    def tag(self, layer: int, head: int) -> bytes:
        at = (layer * self.header.num_kv_heads + head) * TAG_SIZE
        return self.tags[at : at + TAG_SIZE]


def head_table(sums: bytes, tags: bytes) -> bytes:
    """A writer's head table: the heads' sums (`head_sums`), their tags (b"" unsigned), zero-padded to
    `BODY_ALIGN`."""
    table = sums + tags
    return table + bytes(-len(table) % BODY_ALIGN)


def read_head_checks(header: ChunkHeader, table: Buffer, seal: Seal | None = None) -> HeadChecks:
    """The checks in `table`, the bytes at `head_table_span(header)` of a chunk whose header passed
    `check_header` (under `seal`, where given), verified as a section is: against the header's xxh3-64
    (CorruptChunkError: damage), with a `seal` against its tag (UnauthenticatedChunkError where it
    keeps the checksum but fails the tag); its padding zero."""
    if not head_checked(header):
        raise InvalidInputError("the chunk has no per-head checks: read its sections whole")
    lo, hi = head_table_span(header)
    mv = memoryview(table)
    if len(mv) != hi - lo:
        raise TruncatedChunkError(f"head table: read {len(mv)} of {hi - lo} bytes")
    keyed = None if seal is None else seal.sections(bytes(getattr(header, "salt", b"")))
    want = bytes(getattr(header, "head_tag", b""))
    if keyed is None or not keyed.matches_table(mv, want):
        if host_checksum_parts([mv]) != getattr(header, "head_sum", 0):
            raise CorruptChunkError("head table checksum mismatch")
        if seal is not None:
            raise UnauthenticatedChunkError("head table tag does not match this reader's secret")
    n = header.num_layers * header.num_kv_heads
    used = n * (HEAD_SUM + (TAG_SIZE if header.mac else 0))
    if any(mv[used:]):
        raise CorruptChunkError("nonzero padding after the head table")
    sums = np.frombuffer(mv[: n * HEAD_SUM], dtype="<u8")
    return HeadChecks(header, sums, bytes(mv[n * HEAD_SUM : used]), keyed)


def head_bytes(header: ChunkHeader) -> int:
    """The bytes of one head's keys (or values) in one section."""
    return header.layers[0].raw_length // (2 * header.num_kv_heads) if header.layers else 0


def _check_heads_span(header: ChunkHeader, heads: Span) -> Span:
    a, b = heads
    if not 0 <= a < b <= header.num_kv_heads:
        raise InvalidInputError(f"heads [{a}, {b}) of a chunk of {header.num_kv_heads}")
    return a, b


def head_ranges(header: ChunkHeader, layers: Sequence[int], heads: Span) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of heads [a, b) of `layers`: per layer the keys', then the values'."""
    a, b = _check_heads_span(header, heads)
    n, H = head_bytes(header), header.num_kv_heads
    out = []
    for i in layers:
        off = header.layers[i].offset
        out += [(off + a * n, off + b * n), (off + (H + a) * n, off + (H + b) * n)]
    return out


def join_heads(header: ChunkHeader, layers: Sequence[int], heads: Span, parts: Sequence[Buffer]) -> bytes:
    """The bytes `head_ranges` read (`parts`, in its order) as one span: the native sections of heads
    [a, b) of `layers`, back to back. TruncatedChunkError where a range came back short."""
    for (lo, hi), got in zip(head_ranges(header, layers, heads), parts, strict=True):
        if len(got) != hi - lo:
            raise TruncatedChunkError(f"head range at byte {lo}: read {len(got)} of {hi - lo} bytes")
    return b"".join(parts)


def head_sections(
    header: ChunkHeader, layers: Sequence[int], heads: Span, span: Buffer
) -> dict[int, memoryview]:
    """Each layer's section of heads [a, b) within `span` (`join_heads`): keys, then values."""
    a, b = _check_heads_span(header, heads)
    size = 2 * (b - a) * head_bytes(header)
    mv = memoryview(span)
    if len(mv) != size * len(layers):
        raise TruncatedChunkError(f"read {len(mv)} bytes of heads [{a}, {b}), expected {size * len(layers)}")
    return {i: mv[j * size : (j + 1) * size] for j, i in enumerate(layers)}


def check_heads(checks: HeadChecks, layer: int, heads: Span, stored: Buffer) -> None:
    """Verify heads [a, b) of section `layer` (`stored`: their keys then their values, as
    `head_sections` gives them) before any byte is used: each head against its xxh3-64, or where the
    checks were read under a seal (`read_head_checks`) its GMAC tag. As `check_section`:
    CorruptChunkError where a head fails its xxh3-64 (damage), UnauthenticatedChunkError where it keeps
    it but fails its tag (a forgery)."""
    header = checks.header
    a, b = _check_heads_span(header, heads)
    n, H = head_bytes(header), header.num_kv_heads
    mv = memoryview(stored)
    if len(mv) != 2 * (b - a) * n:
        raise CorruptChunkError(f"layer {layer}: {len(mv)} bytes for heads [{a}, {b}) of {2 * (b - a) * n}")
    keyed, half = checks.keyed, (b - a) * n
    for h in range(a, b):
        parts = [mv[(h - a) * n : (h - a + 1) * n], mv[half + (h - a) * n : half + (h - a + 1) * n]]
        if keyed is not None and keyed.head_matches(layer, h, parts, checks.tag(layer, h)):
            continue
        if host_checksum_parts(parts) != int(checks.sums[layer * H + h]):
            raise CorruptChunkError(f"layer {layer} head {h}: checksum mismatch")
        if keyed is not None:
            raise UnauthenticatedChunkError(
                f"layer {layer} head {h}: tag does not match this reader's secret"
            )


def decode_heads(
    checks: HeadChecks,
    sections: Mapping[int, Buffer],
    spec: ModelSpec,
    heads: Span,
    layers: Sequence[int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_layers` for heads [a, b) of the chunk of `spec` (`sections`: `head_sections`): each layer
    verified (`check_heads`), then copied (keys out of their tiles) into a CPU tensor
    ``[len(layers), 2, b - a, T, D]`` (`out` where given)."""
    header = checks.header
    _check_spec(header, spec)
    a, b = _check_heads_span(header, heads)
    shape = (len(layers), 2, b - a, header.n_tokens, spec.head_dim)
    out = cpu_out(out, shape, spec.dtype)
    for j, i in enumerate(layers):
        check_heads(checks, i, heads, sections[i])
        copy_bytes(out[j], sections[i], key_tile(header))
    return out


def head_parts(rows: np.ndarray, num_kv_heads: int) -> list[list[list[memoryview]]]:
    """For a writer: each section's heads as stored (`rows`: uint8 [L, section bytes], native), each as
    its keys' bytes and its values' (what `head_sums` and the head tags cover)."""
    n = rows.shape[1] // (2 * num_kv_heads)
    H = num_kv_heads
    return [
        [[row[h * n : (h + 1) * n].data, row[(H + h) * n : (H + h + 1) * n].data] for h in range(H)]
        for row in rows
    ]


def head_sums(parts: Sequence[Sequence[Sequence[Buffer]]]) -> bytes:
    """The sums of a format-6 chunk's head table: each head's xxh3-64, little-endian u64s, layer-major."""
    sums = [host_checksum_parts(kv) for layer in parts for kv in layer]
    out = np.array(sums, dtype="<u8").tobytes()
    assert len(out) == HEAD_SUM * len(sums)
    return out


__all__ = [
    "HeadChecks",
    "check_heads",
    "head_table",
    "head_table_span",
    "read_head_checks",
    "decode_heads",
    "head_bytes",
    "head_checked",
    "head_parts",
    "head_ranges",
    "head_sections",
    "head_sums",
    "join_heads",
    "wants_head_checks",
]
