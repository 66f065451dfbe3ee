"""Typed errors. Store and codec faults are caught by the restorer and turned into recomputation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class KVRestoreError(Exception):
    """Base class of every error kvrestore raises on purpose."""


class InvalidInputError(KVRestoreError, ValueError):
    """The caller passed something kvrestore cannot work with (empty tokens, bad ids, bad sizes)."""


class UsageError(KVRestoreError, RuntimeError):
    """The API was used where it cannot work: a closed `SyncRestorer`, a blocking call from inside a
    callback on the restorer's own event loop, a `BatchEngine` not entered. The message says what to do."""


class StoreError(KVRestoreError):
    """A store could not be opened, read or written."""


class SaveError(StoreError):
    """`Restorer.save` could not write some chunks. The others were written and stay stored.

    `written`: the keys this save stored; `failed`: each key it could not store, with the store's error
    (the message says how many failed and the first error, which is also the `__cause__`).
    """

    def __init__(self, message: str, written: Sequence[str], failed: Mapping[str, Exception]) -> None:
        super().__init__(message)
        self.written = tuple(written)
        self.failed = dict(failed)


class StoreTimeoutError(StoreError, TimeoutError):
    """A store call did not finish within its deadline (or the store timed out recently and is left
    alone until its back-off ends): the store counts as down for that call."""


class UnsupportedURLError(StoreError, ValueError):
    """`open_store` was given a URL whose scheme no store handles (a `ValueError`, as an
    `InvalidInputError` is)."""


class ChunkDecodeError(KVRestoreError):
    """A stored chunk is unusable. The restorer treats it as a miss and recomputes."""


class CorruptChunkError(ChunkDecodeError):
    """Bytes do not match their checksum, or the header cannot be parsed."""


class TruncatedChunkError(ChunkDecodeError):
    """The object is shorter than its header says."""


class ForeignChunkError(ChunkDecodeError):
    """The object under a chunk's key is another chunk: another model, dtype, shape, KV encoding, key or
    position than the key names. Every field it names is one the key is derived from, so no reader of
    any release reads it under this key: it is deleted like damage."""


class FormatVersionError(ChunkDecodeError):
    """The chunk's format version is one this reader does not read (a newer release's, or unknown): a
    miss, never deleted, so that in a fleet upgraded one server at a time the old servers keep what the
    new ones save."""


class UnknownLayoutError(ChunkDecodeError):
    """The chunk is laid out in a way this reader does not know (a KV encoding it lacks or decodes
    otherwise, key tiles in an encoding it reads without them): a newer release's chunk, a miss, never
    deleted."""


class UnauthenticatedChunkError(ChunkDecodeError):
    """The chunk lacks a valid MAC, or a section its valid tag, under this reader's secret
    (`Restorer(secret=...)`): a miss, never KV, and never deleted, since a writer under another secret
    may share the store and own the chunk."""


class UnsupportedModelError(KVRestoreError):
    """The backend cannot drive this model architecture."""


class MissingChunkError(ChunkDecodeError):
    """A chunk listed by `contains` was gone when it was read (evicted or deleted meanwhile)."""


class StageFailedError(KVRestoreError):
    """A stage-parallel restore (`kvrestore.distributed`) failed on some rank: a rank died or timed out, a
    stage could not get its input (a boundary activation unreadable after planning), or a bug. Every rank
    of the restore raises it, within the group's timeout; `failures` maps each failed rank to its reason."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


#: faults of a chunk load that turn the chunk into a miss (recomputed) instead of failing the restore
LOAD_FAULTS = (ChunkDecodeError, StoreError, OSError, TimeoutError)
#: faults found by checking a chunk's bytes as read (header, sizes, checksums) that prove the object bad:
#: the only ones for which it is deleted (`proves_damage`)
DAMAGE_FAULTS = (CorruptChunkError, TruncatedChunkError, ForeignChunkError)
#: faults of one store call that fail that call only (a tier's miss, one boundary write, one page save)
STORE_FAULTS = (StoreError, OSError, TimeoutError)
#: faults of one chunk write that fail that chunk only (`SaveError` once every write has ended)
WRITE_FAULTS = (StoreError, OSError)


def proves_damage(exc: BaseException) -> bool:
    """Whether a chunk whose read raised `exc` is deleted from the store: the one rule every reader
    follows. Only bytes proven damaged are (`DAMAGE_FAULTS`: they fail their checks, or are not the
    chunk their key names); the next save writes a good copy. A chunk that is merely not for this
    reader stays: another format version (`FormatVersionError`), a layout it does not know
    (`UnknownLayoutError`), no valid signature under its secret (`UnauthenticatedChunkError`); and so
    does one that is missing, or whose good bytes could not be placed (the caller's buffer, a device, a
    cancelled copy)."""
    return isinstance(exc, DAMAGE_FAULTS)
