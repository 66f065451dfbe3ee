"""Chunking and chained prefix hashing.

A prompt of n tokens is cut into chunks of `chunk_size` tokens; the last one may be shorter. The key of
chunk i is blake2b(key of chunk i-1, fingerprint, token count, token ids of chunk i), so a key names a
chunk *and everything before it*: the KV of a chunk depends on its whole prefix, and two prompts share
the key of chunk i only when they share every token up to the end of chunk i.

The partial last chunk gets its own key (its token count is hashed), so it is found again only by a
prompt that repeats exactly those tokens; a longer prompt that extends it has a full chunk there
instead, with another key, and recomputes those tokens. Keys are hex strings, stable across processes
and machines (never Python's salted `hash()`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrestore.core.errors import InvalidInputError

DEFAULT_CHUNK_SIZE = 256
KEY_HEX_LEN = 40  # blake2b digest_size=20


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a prompt: its index, token range [start, end) and store key."""

    index: int
    start: int
    end: int
    key: str

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


def token_bytes(tokens: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids as little-endian int64 bytes (the hashed form)."""
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    return t.numpy().astype("<i8", copy=False).tobytes()


def chunk_keys(
    tokens: Sequence[int] | torch.Tensor, fingerprint: str, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[ChunkRef]:
    """Split `tokens` into chunks and give each its chained prefix key."""
    if chunk_size <= 0:
        raise InvalidInputError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    data = token_bytes(tokens)
    n = len(data) // 8
    refs: list[ChunkRef] = []
    prev = hashlib.blake2b(f"kvrestore-keys-v1|{fingerprint}".encode(), digest_size=20).digest()
    for i, start in enumerate(range(0, n, chunk_size)):
        end = min(n, start + chunk_size)
        h = hashlib.blake2b(prev, digest_size=20)
        h.update((end - start).to_bytes(4, "little"))
        h.update(data[start * 8 : end * 8])
        prev = h.digest()
        refs.append(ChunkRef(i, start, end, prev.hex()))
    return refs


def content_key(tokens: Sequence[int] | torch.Tensor, fingerprint: str) -> str:
    """A key that depends on the chunk's tokens only, not on what precedes them (for CacheBlend)."""
    h = hashlib.blake2b(f"kvrestore-content-v1|{fingerprint}".encode(), digest_size=20)
    h.update(token_bytes(tokens))
    return h.hexdigest()
