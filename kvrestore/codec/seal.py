"""A keyed MAC on every chunk: what keeps a store's other writers from planting KV.

The keys and the wire format are public, so anyone who can write a store can put well-formed chunks,
checksums and all, under any prompt's key. With a secret (`Restorer(secret=...)`, the vLLM connector's
`secret` or `KVRESTORE_SECRET`), the writer signs each chunk's header and the reader checks the
signature before it uses a byte of the chunk. The header already holds everything the reader relies on:
the key (so the prompt and its namespace), the model's fingerprint, the position, the shapes, the
encoding, and each section's two checksums. Signing it binds the sections through their checksums, so
the MAC costs one keyed BLAKE2b over a few hundred bytes, never a second pass over the KV.

What it does not do: the section checksums (xxh3-64 and the device sum) detect damage, not an
adversary, so someone who holds a validly signed chunk and can craft other bytes with the same two
checksums could swap its sections; that takes a second preimage of both, which the MAC leaves to them.
A chunk that fails the check is `UnauthenticatedChunkError`: a miss, never deleted (a writer under
another secret may share the store; neither side must empty it for the other).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec

from kvrestore.core.errors import InvalidInputError, UnauthenticatedChunkError

#: the environment variable the vLLM connector reads a secret from (never a file in the store)
SECRET_ENV = "KVRESTORE_SECRET"
MAC_SIZE = 32
MIN_SECRET_BYTES = 16
_DOMAIN = b"kvrestore-chunk-mac-v1\x00"


class Seal:
    """Signs and checks chunk headers under one secret (bytes, or a str taken as UTF-8, >= 16 bytes)."""

    def __init__(self, secret: bytes | str) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, (bytes, bytearray)):
            raise InvalidInputError(f"secret must be bytes or str, got {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise InvalidInputError(
                f"secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
                "(e.g. secrets.token_bytes(32))"
            )
        # BLAKE2b takes a key of at most 64 bytes: a longer secret is hashed down to one
        self._key = bytes(secret) if len(secret) <= 64 else hashlib.blake2b(secret).digest()

    def mac(self, unsigned_header: bytes) -> bytes:
        """The MAC of a header's msgpack bytes encoded with an empty `mac` field."""
        h = hashlib.blake2b(key=self._key, digest_size=MAC_SIZE)
        h.update(_DOMAIN)
        h.update(unsigned_header)
        return h.digest()

    def sign(self, header: msgspec.Struct, encoder: msgspec.msgpack.Encoder) -> bytes:
        """The msgpack bytes of `header` (whose `mac` is empty) with its MAC set."""
        return encoder.encode(msgspec.structs.replace(header, mac=self.mac(encoder.encode(header))))

    def check(self, header: msgspec.Struct, encoder: msgspec.msgpack.Encoder) -> None:
        """Raise UnauthenticatedChunkError unless `header.mac` is this secret's MAC of the header."""
        got = bytes(getattr(header, "mac", b""))
        if not got:
            raise UnauthenticatedChunkError("chunk is unsigned, and this reader requires a signature")
        want = self.mac(encoder.encode(msgspec.structs.replace(header, mac=b"")))
        if not hmac.compare_digest(got, want):
            raise UnauthenticatedChunkError("chunk signature does not match this reader's secret")

    def __repr__(self) -> str:  # never the secret
        return "Seal(<secret>)"


def seal_of(secret: bytes | str | Seal | None) -> Seal | None:
    """A `Seal` for `secret` (None: chunks are neither signed nor checked)."""
    if secret is None or isinstance(secret, Seal):
        return secret
    return Seal(secret)


def secret_from_env() -> str | None:
    """The secret in `KVRESTORE_SECRET`, if set and not empty."""
    return os.environ.get(SECRET_ENV) or None


__all__ = ["MAC_SIZE", "SECRET_ENV", "Seal", "seal_of", "secret_from_env"]
