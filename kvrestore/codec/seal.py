"""Keyed authentication of every byte of a chunk: what keeps a store's other writers from planting KV.

The keys and the wire format are public, so anyone who can write a store can put well-formed chunks,
checksums and all, under any prompt's key; and the section checksums (xxh3-64, the device sum) are not
cryptographic, so a forger who keeps a signed header can rewrite its sections with the same two sums
(a second preimage of xxh3's long loop takes about a millisecond; the device sum is linear). With a
secret (`Restorer(secret=...)`, the vLLM connector's `secret` or `KVRESTORE_SECRET`), the writer
authenticates the header and every section with standard keyed constructions, and a reader checks
both before a byte of a section reaches a KV buffer or a page:

* **each section**: AES-256-GCM with an empty plaintext, i.e. GMAC (NIST SP 800-38D), a 16-byte tag over
  the section's stored bytes (compressed ones before they are decompressed). Its key is derived for
  each chunk written, ``K_chunk = BLAKE2b(key=secret, "kvrestore-section-key-v1" || salt)`` with a
  random 16-byte salt stored in the header, and the nonce is the section's index: a (key, nonce) pair is
  never used twice, even when the same chunk is saved again (GMAC's one requirement).
* **each head of a section** (format 6, `codec.heads`): a GMAC tag over that head's keys then values as
  stored, under the same chunk key, with a nonce of its own (1, the layer, the head: `_head_nonce`;
  a section's nonces start with 0). A head's bytes checked by its tag are bound to the secret, the
  chunk (its salt), the layer and the head: another chunk's, layer's or head's bytes fail it. The
  head tags lie in the chunk's head table, which has a GMAC tag of its own (nonce 2, 0, ...) in the
  header.
* **the header**: keyed BLAKE2b over its msgpack bytes with an empty `mac` field. The header holds the
  key (so the prompt and its namespace), the model's fingerprint, the position, the shapes, the
  encoding, the salt and every section's tag, so the MAC binds every section to its place.

Why GMAC, by measurement on this CPU (AMD EPYC with VAES and VPCLMULQDQ, one core, 64 MiB;
`benchmarks/seal_cost.py --primitives`): GMAC through `cryptography` (OpenSSL) 22 GB/s and it
releases the GIL; keyed BLAKE3 (`blake3`) 4.6 GB/s, GIL released; Poly1305 (`cryptography`) 12.6
GB/s but it holds the GIL (a compute lane that launches kernels would stall behind it); keyed BLAKE2b
0.9 GB/s; against xxh3's 21 GB/s. A CPU without AES instructions runs OpenSSL's constant-time
fallback, slower but as sound.

A chunk whose header or a section fails is `UnauthenticatedChunkError`: a miss, never deleted (a writer
under another secret may share the store; neither side must empty it for the other). A section that
fails its tag is also checked against its xxh3-64: bytes that fail both are damage
(`CorruptChunkError`, deleted like any damaged chunk), bytes that keep xxh3 and fail the tag are a
forgery. A chunk signed by a release before section tags (a header MAC only) is unauthenticated here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

import msgspec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvrestore.core.errors import InvalidInputError, UnauthenticatedChunkError
from kvrestore.core.settings import check_text

#: the environment variable the vLLM connector reads a secret from (never a file in the store)
SECRET_ENV = "KVRESTORE_SECRET"
MAC_SIZE = 32
#: bytes of a section's GMAC tag, and of the random salt each chunk's section key is derived from
TAG_SIZE = 16
SALT_SIZE = 16
MIN_SECRET_BYTES = 16
_DOMAIN = b"kvrestore-chunk-mac-v2\x00"
_SECTION_KEY = b"kvrestore-section-key-v1\x00"

Buffer = bytes | bytearray | memoryview


def _nonce(index: int) -> bytes:
    """The GCM nonce of section `index` (12 bytes): unique under its chunk's key, its first byte 0."""
    return index.to_bytes(12, "big")


def _head_nonce(layer: int, head: int) -> bytes:
    """The GCM nonce of head `head` of section `layer` (12 bytes: 1, the layer in 7, the head in 4):
    unique under its chunk's key, and never a section's (whose first byte is 0)."""
    if not (0 <= layer < 1 << 56 and 0 <= head < 1 << 32):
        raise InvalidInputError(f"no head tag for head {head} of layer {layer}")
    return b"\x01" + layer.to_bytes(7, "big") + head.to_bytes(4, "big")


#: the GCM nonce of a chunk's head table (format 6): never a section's or a head's
_TABLE_NONCE = b"\x02" + bytes(11)


class SectionTags:
    """The GMAC tags of one chunk's sections under the key derived from its salt (`Seal.sections`)."""

    __slots__ = ("_aead", "_key")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._aead = AESGCM(key)

    def tag(self, index: int, data: Buffer | Sequence[Buffer]) -> bytes:
        """The tag of section `index` holding `data` (its bytes, or parts of them in order). The GIL is
        released while it hashes."""
        return self._gmac(_nonce(index), data)

    def head_tag(self, layer: int, head: int, data: Sequence[Buffer]) -> bytes:
        """The tag of head `head` of section `layer` holding `data` (its keys' bytes, then its values')."""
        return self._gmac(_head_nonce(layer, head), data)

    def table_tag(self, table: Buffer) -> bytes:
        """The tag of the chunk's head table (format 6: each head's checksum and tag)."""
        return self._gmac(_TABLE_NONCE, table)

    def matches(self, index: int, data: Buffer | Sequence[Buffer], want: bytes) -> bool:
        """Whether section `index`'s bytes have the tag `want` (compared in constant time)."""
        return hmac.compare_digest(self.tag(index, data), want)

    def matches_table(self, table: Buffer, want: bytes) -> bool:
        """Whether a chunk's head table has the tag `want` (constant time)."""
        return hmac.compare_digest(self.table_tag(table), want)

    def head_matches(self, layer: int, head: int, data: Sequence[Buffer], want: bytes) -> bool:
        """Whether head `head` of section `layer` holds bytes with the tag `want` (constant time)."""
        return hmac.compare_digest(self.head_tag(layer, head, data), want)

    def _gmac(self, nonce: bytes, data: Buffer | Sequence[Buffer]) -> bytes:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return self._aead.encrypt(nonce, b"", data)
        if len(data) == 1:
            return self._aead.encrypt(nonce, b"", data[0])
        mac = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
        for part in data:
            mac.authenticate_additional_data(part)
        mac.finalize()
        return mac.tag


class Seal:
    """Signs and checks chunks under one secret (bytes, or a str taken as UTF-8, >= 16 bytes)."""

    def __init__(self, secret: bytes | str) -> None:
        if isinstance(secret, str):
            secret = check_text("secret", secret, secret=True).encode()
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

    def sections(self, salt: bytes) -> SectionTags:
        """The section tags of the chunk whose header holds `salt`."""
        key = hashlib.blake2b(_SECTION_KEY + bytes(salt), key=self._key, digest_size=32).digest()
        return SectionTags(key)

    def tag_sections(self, payloads: Sequence[Buffer]) -> tuple[bytes, bytes]:
        """A fresh random salt and the tags of `payloads` (a chunk's stored sections) under it, one
        after another: the `salt` and `tags` of a signed header."""
        salt, tags, _ = self.tag_chunk(payloads)
        return salt, tags

    def tag_chunk(
        self, payloads: Sequence[Buffer], heads: Sequence[Sequence[Sequence[Buffer]]] = ()
    ) -> tuple[bytes, bytes, bytes]:
        """`tag_sections`, and under the same salt the tags of each section's heads (`heads[layer][h]`:
        that head's keys and values as stored), one after another: what a signed format-6 chunk's head
        table holds after the heads' checksums (b"" without heads)."""
        salt = os.urandom(SALT_SIZE)
        tags = self.sections(salt)
        section_tags = b"".join(tags.tag(i, p) for i, p in enumerate(payloads))
        head_tags = b"".join(tags.head_tag(i, h, kv) for i, layer in enumerate(heads) for h, kv in enumerate(layer))
        return salt, section_tags, head_tags

    def sign(self, header: msgspec.Struct, encoder: msgspec.msgpack.Encoder) -> bytes:
        """The msgpack bytes of `header` (whose `mac` is empty) with its MAC set."""
        return encoder.encode(msgspec.structs.replace(header, mac=self.mac(encoder.encode(header))))

    def check(self, header: msgspec.Struct, encoder: msgspec.msgpack.Encoder, n_sections: int) -> SectionTags:
        """The tags of the header's `n_sections` sections, once `header.mac` is this secret's MAC of the
        header and the header carries a salt and a tag for each section; UnauthenticatedChunkError
        otherwise."""
        got = bytes(getattr(header, "mac", b""))
        if not got:
            raise UnauthenticatedChunkError("chunk is unsigned, and this reader requires a signature")
        salt, tags = bytes(getattr(header, "salt", b"")), bytes(getattr(header, "tags", b""))
        if len(salt) != SALT_SIZE or len(tags) != TAG_SIZE * n_sections:
            raise UnauthenticatedChunkError(
                "chunk has no tag for each section (signed by an earlier release, or forged): its "
                "sections are not authenticated"
            )
        want = self.mac(encoder.encode(msgspec.structs.replace(header, mac=b"")))
        if not hmac.compare_digest(got, want):
            raise UnauthenticatedChunkError("chunk signature does not match this reader's secret")
        return self.sections(salt)

    def __repr__(self) -> str:  # never the secret
        return "Seal(<secret>)"


def section_tag(header: msgspec.Struct, index: int) -> bytes:
    """Section `index`'s tag in a signed header (`tags`), or b"" in an unsigned one."""
    tags = getattr(header, "tags", b"")
    return bytes(tags[index * TAG_SIZE : (index + 1) * TAG_SIZE])


def seal_of(secret: bytes | str | Seal | None) -> Seal | None:
    """A `Seal` for `secret` (None: chunks are neither signed nor checked)."""
    if secret is None or isinstance(secret, Seal):
        return secret
    return Seal(secret)


def secret_from_env() -> str | None:
    """The secret in `KVRESTORE_SECRET`, if set and not empty."""
    return os.environ.get(SECRET_ENV) or None


__all__ = [
    "MAC_SIZE",
    "SALT_SIZE",
    "SECRET_ENV",
    "TAG_SIZE",
    "Seal",
    "SectionTags",
    "seal_of",
    "secret_from_env",
    "section_tag",
]
