"""kvrestore: restore an LLM prompt's KV cache by computing and loading at the same time.

from kvrestore import Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.policies import ComputeOnly, LoadOnly
"""

from kvrestore.chunkio.save import SaveStats
from kvrestore.core.bandwidth import BandwidthTrace
from kvrestore.core.errors import (
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
from kvrestore.core.keys import DEFAULT_CHUNK_SIZE, ChunkRef, chunk_keys
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.costs.profile import Profile
from kvrestore.planning import Auto
from kvrestore.policies import Blend, ComputeOnly, LayerTwoPointer, LoadOnly, Policy, TokenTwoPointer
from kvrestore.policies.batch import BatchAware, FifoLanes
from kvrestore.restore.results import RestoreResult, RestoreStats
from kvrestore.restorer import Restorer, SyncRestorer
from kvrestore.runtime.batch_engine import BatchEngine
from kvrestore.runtime.engine import Engine
from kvrestore.stores import ChunkStore, ThrottledStore, TieredStore, open_store

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
