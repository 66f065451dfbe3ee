"""kvrestore: restore an LLM prompt's KV cache by computing and loading at the same time.

from kvrestore import Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.policies import ComputeOnly, LoadOnly
"""

from .bandwidth import BandwidthTrace
from .batch import BatchEngine
from .engine import Engine
from .errors import (
    ChunkDecodeError,
    CorruptChunkError,
    ForeignChunkError,
    InvalidInputError,
    KVRestoreError,
    SaveError,
    StoreError,
    TruncatedChunkError,
    UnsupportedModelError,
    UnsupportedURLError,
)
from .keys import DEFAULT_CHUNK_SIZE, ChunkRef, chunk_keys
from .kv import KVCache, KVChunk
from .policies import Auto, Blend, ComputeOnly, LayerTwoPointer, LoadOnly, Policy, TokenTwoPointer
from .policies.batch import BatchAware, FifoLanes
from .profile import Profile
from .restorer import Restorer, RestoreResult, RestoreStats, SaveStats, SyncRestorer
from .spec import ModelSpec
from .stores import ChunkStore, ThrottledStore, TieredStore, open_store

__version__ = "0.1.0"

__all__ = [
    "Profile",
    "Auto",
    "DEFAULT_CHUNK_SIZE",
    "BandwidthTrace",
    "BatchAware",
    "BatchEngine",
    "Blend",
    "ChunkDecodeError",
    "ChunkRef",
    "ChunkStore",
    "ComputeOnly",
    "CorruptChunkError",
    "Engine",
    "FifoLanes",
    "ForeignChunkError",
    "InvalidInputError",
    "KVCache",
    "KVChunk",
    "KVRestoreError",
    "LoadOnly",
    "ModelSpec",
    "Policy",
    "RestoreResult",
    "RestoreStats",
    "Restorer",
    "SaveStats",
    "SaveError",
    "StoreError",
    "SyncRestorer",
    "ThrottledStore",
    "TieredStore",
    "LayerTwoPointer",
    "TokenTwoPointer",
    "TruncatedChunkError",
    "UnsupportedModelError",
    "UnsupportedURLError",
    "chunk_keys",
    "open_store",
]
