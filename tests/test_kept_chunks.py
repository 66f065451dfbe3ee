"""Only proven damage deletes (`core.errors.proves_damage`): a chunk of a format version this reader does
not read (a newer release's, in a fleet upgraded one server at a time), or of a layout it does not know,
is a miss and stays stored, in the library and in the connector; a damaged one is deleted."""

from __future__ import annotations

import zlib

import anyio
import msgspec
import pytest
import torch

from kvrestore import LayerTwoPointer, LoadOnly, Restorer, TokenTwoPointer, codec
from kvrestore.codec.header import _ENCODER, _PREFIX, MAGIC
from kvrestore.core.errors import (
    CorruptChunkError,
    ForeignChunkError,
    FormatVersionError,
    TruncatedChunkError,
    UnauthenticatedChunkError,
    UnknownLayoutError,
    proves_damage,
)
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens
from .forgery import future_version


def test_the_rule_names_one_class_per_reason():
    deleted = [CorruptChunkError, TruncatedChunkError, ForeignChunkError]
    kept = [FormatVersionError, UnknownLayoutError, UnauthenticatedChunkError]
    assert all(proves_damage(c("x")) for c in deleted)
    assert not any(proves_damage(c("x")) for c in kept)
    assert not proves_damage(OSError("a store fault"))


def _regrouped(blob: bytes) -> bytes:
    """`blob` with its header naming another group size of its encoding (a newer release's variant)."""
    header, end = codec.read_header(blob)
    name, scales, group = header.encoding
    raw = _ENCODER.encode(msgspec.structs.replace(header, encoding=(name, scales, group + 1)))
    assert len(raw) == end - codec.PREFIX_SIZE
    return _PREFIX.pack(MAGIC, len(raw), zlib.crc32(raw)) + raw + blob[end:]


@pytest.mark.parametrize("policy", [LoadOnly(), TokenTwoPointer(), LayerTwoPointer()], ids=repr)
@pytest.mark.parametrize("kind", ["newer version", "unknown version", "other int8 groups", "damaged"])
def test_a_newer_releases_chunks_are_misses_and_stay(llama_backend, policy, kind):
    tokens = random_tokens(96, llama_backend.spec.vocab_size)
    ref = llama_backend.prefill_chunk(tokens, None, 0).data
    encoding = "int8" if kind == "other int8 groups" else "native"

    async def main():
        store = MemoryStore()
        writer = Restorer(llama_backend, store, chunk_size=32, kv_encoding=encoding)
        await writer.save(tokens)
        _, refs = writer.chunks(tokens)
        for r in refs:
            blob = await store.get(r.key)
            if kind == "newer version":
                blob = future_version(blob)
            elif kind == "unknown version":
                blob = future_version(blob, version=1 << 20)
            elif kind == "other int8 groups":
                blob = _regrouped(blob)
            else:
                blob = blob[:-1] + bytes([blob[-1] ^ 1])
            await store.put(r.key, blob)
        reader = Restorer(llama_backend, store, chunk_size=32, kv_encoding=encoding)
        got = await reader.restore(tokens, policy)
        if kind != "damaged":  # (damage in the last layer: a layer-wise restore loads the others)
            assert got.stats.loaded_chunks == 0 and got.stats.loaded_layers == 0
        torch.testing.assert_close(got.kv.data, ref, atol=0.05 if encoding == "int8" else 1e-5, rtol=0)
        present = await store.contains([r.key for r in refs])
        assert present == [kind != "damaged"] * len(refs)

    anyio.run(main)
