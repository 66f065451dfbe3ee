"""Forgeries of signed chunks as an attacker who can write the store builds them: the genuine header, its
MAC valid, kept byte for byte; the sections rewritten so that every non-keyed checksum still holds.

* The device sum is linear modulo 2**64 with odd weights (`codec.checksums`), so a real second preimage
  is two words: add d to word a, and subtract d * w[a] / w[b] (w[b] is odd: invertible) from word b.
* xxh3-64 second preimages take the issue's attacker about a millisecond a section; here an attacker
  with perfect ones is simulated (`SecondPreimages`): the reader's xxh3 of a forged section (or of a
  forged head's keys and values, format 6) returns the genuine one's. A reader without a secret then takes every uncompressed forgery for the genuine
  chunk (`tests/test_forgery.py` shows it), so the section tag is the only thing standing.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import numpy as np
import pytest

from kvrestore import codec
from kvrestore.codec import checksums

MASK = (1 << 64) - 1


def _digest(parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


class SecondPreimages:
    """xxh3-64 as an attacker with perfect second preimages makes readers see it: a forged section
    hashes to the genuine one's checksum. Patched into every reader's one xxh3 call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.table: dict[bytes, int] = {}
        real_parts = checksums.host_checksum_parts
        real = checksums.host_checksum

        def parts_sum(parts):  # noqa: ANN001, ANN202
            got = self.table.get(_digest(parts))
            return real_parts(parts) if got is None else got

        def one_sum(data):  # noqa: ANN001, ANN202
            got = self.table.get(_digest([data]))
            return real(data) if got is None else got

        monkeypatch.setattr(codec.chunk, "host_checksum_parts", parts_sum)
        monkeypatch.setattr(codec.heads, "host_checksum_parts", parts_sum)  # a head's (format 6)
        monkeypatch.setattr(codec.boundary, "host_checksum", one_sum)

    def keep(self, forged: bytes | memoryview, checksum: int) -> None:
        self.table[_digest([forged])] = checksum


def keep_device_sum(words: np.ndarray, rng: random.Random) -> None:
    """Change two int64 words of a section (`words`, uint64, in place) keeping its device sum."""
    n = len(words)
    a, b = rng.sample(range(n), 2)
    w = checksums.weights(n).numpy().view(np.uint64)
    wa, wb = int(w[a]), int(w[b])
    d = rng.randrange(1, 1 << 64)
    with np.errstate(over="ignore"):
        words[a] = np.uint64((int(words[a]) + d) & MASK)
        words[b] = np.uint64((int(words[b]) - d * wa * pow(wb, -1, 1 << 64)) & MASK)


def forge(blob: bytes, seed: int, preimages: SecondPreimages, layers: Sequence[int] | None = None) -> bytes:
    """`blob` (a signed chunk) with every section of `layers` (all by default) rewritten, its header and
    MAC kept: uncompressed, two words each so that its device sum is the same; compressed, bytes
    flipped (the sum covers the raw bytes, which no reader sees before the tag). `preimages` makes
    each forged section's xxh3-64 the genuine one's."""
    rng = random.Random(seed)
    header, _ = codec.read_header(blob)
    out = bytearray(blob)
    for i in range(header.num_layers) if layers is None else layers:
        s = header.layers[i]
        section = memoryview(out)[s.offset : s.offset + s.length]
        if header.compression == "none" and s.length >= 16:
            words = np.frombuffer(section, dtype=np.uint64)
            keep_device_sum(words, rng)
            got = checksums.as_signed(int(checksums.device_checksums(_tensor(section)).item()))
            assert not s.device_sum or got == s.device_sum, "the forgery must keep the device sum"
        else:
            for _ in range(2):
                section[rng.randrange(s.length)] ^= rng.randrange(1, 256)
        assert bytes(section) != blob[s.offset : s.offset + s.length]
        preimages.keep(section, s.checksum)
    return bytes(out)


def _tensor(section: memoryview):  # noqa: ANN202
    import torch

    return torch.frombuffer(bytearray(section), dtype=torch.uint8).view(1, -1)


def future_version(blob: bytes, version: int | None = None) -> bytes:
    """`blob` as a newer release might write it: a format version this reader does not read (the next
    one by default), a header field it does not know, the same sections (framed as `codec.frame` does)."""
    import msgspec

    from kvrestore.codec.header import FORMAT_VERSION, MAGIC, frame

    header, _ = codec.read_header(blob)
    payloads = [blob[s.offset : s.offset + s.length] for s in header.layers]

    def header_for(body_start: int) -> bytes:
        fields = msgspec.structs.asdict(header)
        fields["version"] = FORMAT_VERSION + 1 if version is None else version
        fields["a_field_from_the_future"] = [1, 2, 3]
        layers, off = [], body_start
        for s in header.layers:
            layers.append([off, s.length, s.raw_length, s.checksum, s.device_sum])
            off += s.length
        fields["layers"] = layers
        return msgspec.msgpack.encode(fields)

    return frame(MAGIC, header_for, payloads)
