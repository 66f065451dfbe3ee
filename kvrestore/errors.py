"""Typed errors. Store and codec faults are caught by the restorer and turned into recomputation."""

from __future__ import annotations


class KVRestoreError(Exception):
    """Base class of every error kvrestore raises on purpose."""


class InvalidInputError(KVRestoreError, ValueError):
    """The caller passed something kvrestore cannot work with (empty tokens, bad ids, bad sizes)."""


class StoreError(KVRestoreError):
    """A store could not be opened, read or written."""


class UnsupportedURLError(StoreError, ValueError):
    """`open_store` was given a URL whose scheme no store handles."""


class ChunkDecodeError(KVRestoreError):
    """A stored chunk is unusable. The restorer treats it as a miss and recomputes."""


class CorruptChunkError(ChunkDecodeError):
    """Bytes do not match their checksum, or the header cannot be parsed."""


class TruncatedChunkError(ChunkDecodeError):
    """The object is shorter than its header says."""


class ForeignChunkError(ChunkDecodeError):
    """The chunk belongs to another model, dtype, format version, key or position."""


class UnsupportedModelError(KVRestoreError):
    """The backend cannot drive this model architecture."""


class MissingChunkError(ChunkDecodeError):
    """A chunk listed by `contains` was gone when it was read (evicted or deleted meanwhile)."""
