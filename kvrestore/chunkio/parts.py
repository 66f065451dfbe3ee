"""Chunks written by many workers: a chunk as *parts*, each the KV of some heads and some layers.

A tensor-parallel worker holds only its KV heads of every layer, a pipeline stage only its layers. Each
writes its share of a chunk as one *part*: an ordinary chunk object (format 4/5, `codec.chunk`) of the
*part spec* (the model's spec with `num_kv_heads` and `num_layers` of the part), stored under the *part
key*, a digest of the chunk's key and the part's head and layer ranges (`part_key`). Nothing in the
wire format changes: the header holds the part key, so a part read under another part's key, or as a
whole chunk, is foreign (and with a seal, a forgery), and its sections keep their checksums and tags.

A whole chunk is the part that covers every head and every layer, stored under the chunk key itself.
A *layout* is a list of parts that covers every (head, layer) exactly once: what one engine writes
(`engine_layout`: heads split as vLLM splits them over `tp` ranks, layers as it splits them over `pp`
stages). A chunk is stored for a reader when the parts of one layout are all stored (`find_layouts`),
never from some parts of one layout and some of another, so a reader never takes half a chunk for a
hit. Readers look for the whole chunk first, then the layouts of every tensor-parallel size that splits
the heads evenly (`reader_layouts`), then any layouts the caller names (a pipeline split).

A reader that needs heads [a, b) and layers [l0, l1) (`read_slice`) reads, of each part that overlaps
them, the header and then the sections of the layers it needs in one range read; each section is
verified before use. A part holding exactly the reader's heads is read with no byte to spare. A part
holding more heads (tp 2 reading tp 1's whole chunks) is read by head where it carries per-head checks
(format 6, `codec.heads`): of each layer, the reader's heads' keys and values, two ranges, each head
verified on its own (with a seal, against its tag). A part without them (formats 4 and 5, quantized or
compressed sections) is read whole per layer, since a section's checks cover all its heads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvrestore import codec
from kvrestore.chunkio.stored import get_all
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import (
    ChunkDecodeError,
    InvalidInputError,
    MissingChunkError,
    TruncatedChunkError,
    proves_damage,
)
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.stores.base import ChunkStore

Span = tuple[int, int]


@dataclass(frozen=True)
class Part:
    """KV heads [heads[0], heads[1]) of layers [layers[0], layers[1]) of a chunk."""

    heads: Span
    layers: Span

    def covers(self, spec: ModelSpec) -> bool:
        """Whether this part is the whole chunk of `spec`."""
        return self.heads == (0, spec.num_kv_heads) and self.layers == (0, spec.num_layers)

    def check(self, spec: ModelSpec) -> Part:
        (a, b), (l0, l1) = self.heads, self.layers
        if not (0 <= a < b <= spec.num_kv_heads and 0 <= l0 < l1 <= spec.num_layers):
            raise InvalidInputError(
                f"part heads [{a}, {b}) layers [{l0}, {l1}) is not within {spec.num_kv_heads} heads "
                f"and {spec.num_layers} layers"
            )
        return self


Layout = tuple[Part, ...]


def whole(spec: ModelSpec) -> Part:
    return Part((0, spec.num_kv_heads), (0, spec.num_layers))


def part_spec(spec: ModelSpec, part: Part) -> ModelSpec:
    """The spec a part is encoded and checked under: the model's, with the part's heads and layers."""
    (a, b), (l0, l1) = part.check(spec).heads, part.layers
    return dataclasses.replace(spec, num_kv_heads=b - a, num_layers=l1 - l0)


def part_key(key: str, part: Part, spec: ModelSpec) -> str:
    """The store key of `part` of the chunk stored under `key` (the key itself for the whole chunk): a
    digest of the key and the part's ranges out of the model's, as long as the key."""
    if part.check(spec).covers(spec):
        return key
    (a, b), (l0, l1) = part.heads, part.layers
    name = f"kvrestore-part-v1|{key}|h{a}-{b}/{spec.num_kv_heads}|l{l0}-{l1}/{spec.num_layers}"
    return hashlib.blake2b(name.encode(), digest_size=max(8, len(key) // 2)).hexdigest()


def part_ref(ref: ChunkRef, part: Part, spec: ModelSpec) -> ChunkRef:
    """`ref` with the key of its `part` (`part_key`): the chunk as the part's reader and writer see it."""
    return dataclasses.replace(ref, key=part_key(ref.key, part, spec))


def tp_heads(num_kv_heads: int, tp: int, rank: int) -> tuple[Span, bool]:
    """The KV heads tensor-parallel rank `rank` of `tp` holds, as vLLM splits them (`tp` divides the
    heads, or the heads divide `tp` and each is replicated on tp / heads consecutive ranks), and whether
    this rank writes them (only the first rank holding a replicated head does)."""
    if tp < 1 or not 0 <= rank < tp:
        raise InvalidInputError(f"tensor-parallel rank {rank} of {tp}")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise InvalidInputError(f"{num_kv_heads} KV heads do not split over tensor-parallel size {tp}")
        n = num_kv_heads // tp
        return (rank * n, (rank + 1) * n), True
    if tp % num_kv_heads:
        raise InvalidInputError(f"tensor-parallel size {tp} is not a multiple of {num_kv_heads} KV heads")
    replicas = tp // num_kv_heads
    head = rank // replicas
    return (head, head + 1), rank % replicas == 0


def pp_layers(num_layers: int, pp: int, stage: int) -> Span:
    """The layers pipeline stage `stage` of `pp` holds, as vLLM's `get_pp_indices` splits them without
    `VLLM_PP_LAYER_PARTITION`: evenly, the remainder one each to the stages before the last."""
    if pp < 1 or not 0 <= stage < pp or pp > num_layers:
        raise InvalidInputError(f"pipeline stage {stage} of {pp} for {num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    first = sum(sizes[:stage])
    return first, first + sizes[stage]


def tp_sizes(num_kv_heads: int) -> list[int]:
    """The tensor-parallel sizes whose layouts differ: those that split the heads evenly (a larger one
    replicates heads and writes what tp = heads writes)."""
    return [tp for tp in range(1, num_kv_heads + 1) if num_kv_heads % tp == 0]


def engine_layout(spec: ModelSpec, tp: int = 1, pp: int = 1) -> Layout:
    """The parts an engine of `tp` ranks and `pp` stages writes: one per (written head range, stage)."""
    heads = sorted({h for h, writes in (tp_heads(spec.num_kv_heads, tp, r) for r in range(tp)) if writes})
    stages = [pp_layers(spec.num_layers, pp, s) for s in range(pp)]
    return tuple(Part(h, s) for s in stages for h in heads)


def rank_part(spec: ModelSpec, tp: int = 1, rank: int = 0, pp: int = 1, stage: int = 0) -> tuple[Part, bool]:
    """The part tensor-parallel rank `rank` of pipeline stage `stage` holds, and whether it writes it (a
    replicated head is written by its first rank only)."""
    heads, writes = tp_heads(spec.num_kv_heads, tp, rank)
    return Part(heads, pp_layers(spec.num_layers, pp, stage)), writes


def leading(found: Sequence[Layout | None]) -> tuple[Layout | None, int]:
    """The layout of a prompt's first stored chunk and how many leading chunks are stored in it: what
    one load reads (a prompt's hit never mixes layouts)."""
    first = found[0] if found else None
    n = 0
    while n < len(found) and first is not None and found[n] == first:
        n += 1
    return first, n


def reader_layouts(spec: ModelSpec, extra: Sequence[Layout] = ()) -> list[Layout]:
    """The layouts a reader looks for, in order: the whole chunk, each tensor-parallel split of the heads
    (2, 3, ... up to one head a part), then `extra` (e.g. the reader's own pipeline split)."""
    out = [engine_layout(spec, tp) for tp in tp_sizes(spec.num_kv_heads)]
    for layout in extra:
        if layout not in out:
            out.append(tuple(p.check(spec) for p in layout))
    return out


async def find_layouts(
    store: ChunkStore, spec: ModelSpec, keys: Sequence[str], layouts: Sequence[Layout] | None = None
) -> list[Layout | None]:
    """For each chunk key, the first of `layouts` (default `reader_layouts`) whose parts are all stored,
    or None: one `contains` call for every candidate part of every key."""
    layouts = reader_layouts(spec) if layouts is None else list(layouts)
    asked = candidate_keys(spec, keys, layouts)
    return stored_layouts(spec, keys, layouts, dict(zip(asked, await store.contains(asked), strict=True)))


def candidate_keys(spec: ModelSpec, keys: Sequence[str], layouts: Sequence[Layout]) -> list[str]:
    """The store keys of every part of every layout of every chunk key: what one lookup asks about."""
    return [part_key(k, p, spec) for k in keys for layout in layouts for p in layout]


def stored_layouts(
    spec: ModelSpec, keys: Sequence[str], layouts: Sequence[Layout], there: Mapping[str, bool]
) -> list[Layout | None]:
    """For each chunk key, the first of `layouts` whose parts are all stored (`there`: the answers for
    `candidate_keys`), or None."""
    return [next((lo for lo in layouts if all(there[part_key(k, p, spec)] for p in lo)), None) for k in keys]


def encode_part(
    data: torch.Tensor,
    spec: ModelSpec,
    key: str,
    start: int,
    part: Part,
    *,
    compression: str = "none",
    encoding: str = "native",
    seal: Seal | None = None,
) -> tuple[str, bytes]:
    """`part` of the chunk `key` whose KV for the part's heads and layers is `data` ([l, 2, h, T, D]),
    encoded as a chunk of the part spec: (its store key, its bytes)."""
    sub = part_spec(spec, part)
    want = (sub.num_layers, 2, sub.num_kv_heads, data.shape[3], spec.head_dim)
    if data.dim() != 5 or tuple(data.shape) != want:
        raise InvalidInputError(f"part data is {list(data.shape)}, expected [{', '.join(map(str, want))}]")
    pkey = part_key(key, part, spec)
    chunk = KVChunk(start, data.contiguous())
    return pkey, codec.encode_chunk(chunk, sub, pkey, compression=compression, encoding=encoding, seal=seal)


def slice_part(kv: torch.Tensor, part: Part, spec: ModelSpec) -> torch.Tensor:
    """The [l, 2, h, T, D] slice of a whole chunk's KV ([L, 2, H, T, D]) that `part` holds."""
    (a, b), (l0, l1) = part.check(spec).heads, part.layers
    return kv[l0:l1, :, a:b]


async def write_part(
    store: ChunkStore,
    data: torch.Tensor,
    spec: ModelSpec,
    key: str,
    start: int,
    part: Part,
    *,
    compression: str = "none",
    encoding: str = "native",
    seal: Seal | None = None,
) -> int:
    """Encode and store `part` (`encode_part`); returns the bytes written."""
    pkey, blob = encode_part(
        data, spec, key, start, part, compression=compression, encoding=encoding, seal=seal
    )
    await store.put(pkey, blob)
    return len(blob)


@dataclass
class SliceRead:
    """What `read_slice` read: the KV and the stored bytes it fetched (headers included)."""

    kv: torch.Tensor
    bytes_read: int


async def read_slice(
    store: ChunkStore,
    spec: ModelSpec,
    key: str,
    start: int,
    n_tokens: int,
    layout: Layout,
    heads: Span,
    layers: Span,
    *,
    encoding: str = "native",
    seal: Seal | None = None,
    out: torch.Tensor | None = None,
    damaged: list[str] | None = None,
) -> SliceRead:
    """KV heads [heads) of layers [layers) of the chunk `key` stored as `layout`, as a tensor
    [l, 2, h, T, D] (`out` where given): of each part that overlaps them, the header, then the sections
    of the layers needed in one range read, each verified (`codec.check_section`, with `seal` its tag)
    before its bytes are used. Raises a `ChunkDecodeError` (`MissingChunkError` for a part that is
    gone): a caller treats the chunk as a miss; `out` may then hold some of it. The key of a part whose
    bytes proved damaged (`proves_damage`) is appended to `damaged` first, for the caller to delete."""
    want = Part(heads, layers).check(spec)
    (a, b), (l0, l1) = want.heads, want.layers
    shape = (l1 - l0, 2, b - a, n_tokens, spec.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=spec.dtype)
    elif tuple(out.shape) != shape or out.dtype != spec.dtype:
        raise InvalidInputError(f"out is {list(out.shape)} {out.dtype}, need {list(shape)} {spec.dtype}")
    covered = torch.zeros(l1 - l0, b - a, dtype=torch.bool)
    reads = []
    for part in layout:
        (pa, pb), (pl0, pl1) = part.check(spec).heads, part.layers
        ha, hb, la, lb = max(a, pa), min(b, pb), max(l0, pl0), min(l1, pl1)
        if ha < hb and la < lb:
            reads.append((part, ha, hb, la, lb))
            covered[la - l0 : lb - l0, ha - a : hb - a] = True
    if not bool(covered.all()):
        raise InvalidInputError(f"layout {layout} does not cover heads [{a}, {b}) of layers [{l0}, {l1})")
    nbytes = 0
    for part, ha, hb, la, lb in reads:
        pkey, pa = part_key(key, part, spec), part.heads[0]
        try:
            kv, n = await _read_part(
                store, spec, pkey, part, start, n_tokens, (la, lb), (ha - pa, hb - pa), encoding, seal
            )
        except ChunkDecodeError as exc:
            if damaged is not None and proves_damage(exc):
                damaged.append(pkey)
            raise
        nbytes += n
        out[la - l0 : lb - l0, :, ha - a : hb - a] = kv
    return SliceRead(out, nbytes)


async def _read_part(
    store: ChunkStore,
    spec: ModelSpec,
    pkey: str,
    part: Part,
    start: int,
    n_tokens: int,
    layers: Span,
    heads: Span,
    encoding: str,
    seal: Seal | None,
) -> tuple[torch.Tensor, int]:
    """Heads [heads) (of the part's) of layers [layers) of the stored `part` (under `pkey`), verified,
    and the bytes read for them: by head where the part holds more heads and has per-head checks."""
    sub, pl0 = part_spec(spec, part), part.layers[0]
    head = await _get(store, pkey, 0, codec.HEADER_PROBE)
    if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
        head = await _get(store, pkey, 0, codec.header_length(head))
    header = codec.probe_header(head, sub, pkey, start, n_tokens, encoding, seal)
    local = range(layers[0] - pl0, layers[1] - pl0)
    if heads != (0, sub.num_kv_heads) and codec.head_checked(header):
        lo, hi = codec.head_table_span(header)
        probed = hi <= len(head)  # the table, where the header probe holds it, is not read again
        ranges = codec.head_ranges(header, local, heads)
        parts = await get_all(store, pkey, ranges if probed else [(lo, hi), *ranges])
        nbytes = len(head) + sum(len(p) for p in parts)
        table = head[lo:hi] if probed else parts.pop(0)
        checks = codec.read_head_checks(header, table, seal)
        sections = codec.head_sections(header, local, heads, codec.join_heads(header, local, heads, parts))
        return codec.decode_heads(checks, sections, sub, heads, list(local)), nbytes
    lo, hi = codec.layer_span(header, local)
    span, nbytes = head[lo:hi], len(head)  # what the header probe already holds is not read again
    if lo + len(span) < hi:
        rest = await _get(store, pkey, lo + len(span), hi)
        nbytes += len(rest)
        span += rest
    if len(span) != hi - lo:
        raise TruncatedChunkError(f"part {pkey[:12]}: read {len(span)} of {hi - lo} bytes")
    sections = codec.span_sections(header, local, span)
    kv = codec.decode_layers(header, sections, sub, list(local), seal=seal)
    return kv[:, :, heads[0] : heads[1]], nbytes


async def _get(store: ChunkStore, key: str, start: int, end: int) -> bytes:
    data = await store.get_range(key, start, end)
    if data is None:
        raise MissingChunkError(f"part {key[:12]} is not in the store")
    return data
