"""Chunking and chained prefix hashing.

A prompt of n tokens is cut into chunks of `chunk_size` tokens; the last one may be shorter. The key of
chunk i is blake2b(key of chunk i-1, fingerprint, token count, token ids of chunk i), so a key names a
chunk *and everything before it*: the KV of a chunk depends on its whole prefix, and two prompts share
the key of chunk i only when they share every token up to the end of chunk i.

The fingerprint given is the *key space*: the model's fingerprint, with its KV encoding where that is not
native (`key_space`) and a namespace where there is one (`namespaced`: a tenant, a LoRA
adapter). A key space a namespace names never shares a key with another, nor with the space without a
namespace; no namespace gives the keys every earlier release gave. Inputs that change the KV at a
position without changing its token id (an image behind its placeholder tokens) are `extras`: each one's
bytes are folded into the chunk its position falls in, so that chunk and every later one differ.

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
from kvrestore.core.settings import check_text

DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a prompt: its index, token range [start, end) (the positions it was saved at) and
    store key; `at`, where a read places its tokens when that is not `start` (a buffer that begins at
    another token, a CacheBlend chunk moved to another position). The one chunk descriptor: what a
    lookup finds, a restore or a vLLM step loads, a save writes."""

    index: int
    start: int
    end: int
    key: str
    at: int | None = None

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    @property
    def offset(self) -> int:
        """Where a read places the chunk's first token (`at`, else `start`)."""
        return self.start if self.at is None else self.at


def token_bytes(tokens: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids as little-endian int64 bytes (the hashed form)."""
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    return t.numpy().astype("<i8", copy=False).tobytes()


#: (position, bytes): an input that changes the KV from `position` on, beyond the token id there
Extra = tuple[int, bytes]


def check_namespace(namespace: object, what: str = "namespace") -> str | None:
    """`namespace` if it is None or a non-empty str UTF-8 can encode, else InvalidInputError."""
    return None if namespace is None else check_text(what, namespace)


def key_space(fingerprint: str, encoding: str) -> str:
    """What chunk keys are hashed under for a model's `fingerprint` and a KV encoding (`codec.quant`):
    the fingerprint itself for native chunks, else the fingerprint and the encoding, so one store holds
    the chunks of several encodings under different keys and a lookup finds only its own encoding's."""
    return fingerprint if encoding == "native" else f"{fingerprint}|kv-encoding:{encoding}"


#: what a namespace names -> the personalisation of its hash (no two kinds' spaces can be alike)
NAMESPACE_KINDS = {"namespace": b"kvr-namespace", "adapter": b"kvr-adapter"}


def namespaced(space: str, namespace: str | None, kind: str = "namespace") -> str:
    """The key space of `namespace` inside `space` (`space` itself for None). The namespace enters as
    its hash, personalised by `kind` ("namespace": a tenant's salt or a `Restorer`'s namespace;
    "adapter": a LoRA adapter's identity), so no choice of names makes two namespaces' spaces, or one
    and the bare space, alike."""
    namespace = check_namespace(namespace)
    if namespace is None:
        return space
    person = NAMESPACE_KINDS[kind]
    digest = hashlib.blake2b(namespace.encode(), digest_size=20, person=person).hexdigest()
    return f"{space}|{kind}:{digest}"


def chunk_keys(
    tokens: Sequence[int] | torch.Tensor,
    fingerprint: str,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    extras: Sequence[Extra] = (),
) -> list[ChunkRef]:
    """Split `tokens` into chunks and give each its chained prefix key (in the key space `fingerprint`),
    with each of `extras` folded into the chunk its position falls in."""
    if chunk_size <= 0:
        raise InvalidInputError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    data = token_bytes(tokens)
    n = len(data) // 8
    folded: dict[int, list[Extra]] = {}
    for pos, blob in sorted(extras):
        if not 0 <= pos < n:
            raise InvalidInputError(f"an input at position {pos} lies outside the {n}-token prompt")
        folded.setdefault(pos // chunk_size, []).append((pos, bytes(blob)))
    refs: list[ChunkRef] = []
    prev = hashlib.blake2b(f"kvrestore-keys-v1|{fingerprint}".encode(), digest_size=20).digest()
    for i, start in enumerate(range(0, n, chunk_size)):
        end = min(n, start + chunk_size)
        h = hashlib.blake2b(prev, digest_size=20)
        h.update((end - start).to_bytes(4, "little"))
        h.update(data[start * 8 : end * 8])
        for pos, blob in folded.get(i, ()):
            h.update(b"\x00extra")  # the ids' count is hashed first: nothing here reads as ids
            h.update(pos.to_bytes(8, "little"))
            h.update(len(blob).to_bytes(8, "little"))
            h.update(blob)
        prev = h.digest()
        refs.append(ChunkRef(i, start, end, prev.hex()))
    return refs


def content_key(tokens: Sequence[int] | torch.Tensor, fingerprint: str) -> str:
    """A key that depends on the chunk's tokens only, not on what precedes them (for CacheBlend)."""
    h = hashlib.blake2b(f"kvrestore-content-v1|{fingerprint}".encode(), digest_size=20)
    h.update(token_bytes(tokens))
    return h.hexdigest()
