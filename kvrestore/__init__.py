"""kvrestore: restore an LLM prompt's KV cache by computing and loading at the same time.

The names here are the ones a first program needs::

    from kvrestore import HFBackend, Restorer, open_store

    restorer = Restorer(HFBackend(model), open_store("file:///var/cache/kv"))
    result = await restorer.restore(token_ids)

Everything else is importable from its subpackage: store wrappers from `kvrestore.stores`, cost models
from `kvrestore.costs`, the engine and its lanes from `kvrestore.runtime`, batch schedulers from
`kvrestore.policies.batch`, chunk keys and the KV types from `kvrestore.core`.
"""

from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import (
    InvalidInputError,
    KVRestoreError,
    SaveError,
    StoreError,
    UnsupportedModelError,
    UnsupportedURLError,
    UsageError,
)
from kvrestore.core.kv import KVCache
from kvrestore.core.version import __version__ as __version__
from kvrestore.planning import Auto
from kvrestore.policies import Blend, ComputeOnly, LayerTwoPointer, LoadOnly, TokenTwoPointer
from kvrestore.restorer import Restorer, SyncRestorer
from kvrestore.runtime.batch_engine import BatchEngine
from kvrestore.stores import LocalStore, MemoryStore, TieredStore, open_store

__all__ = [
    # the facade and what it is made of
    "Restorer",
    "SyncRestorer",
    "HFBackend",
    "open_store",
    "MemoryStore",
    "LocalStore",
    "TieredStore",
    "KVCache",
    # how a restore runs
    "Auto",
    "ComputeOnly",
    "LoadOnly",
    "TokenTwoPointer",
    "LayerTwoPointer",
    "Blend",
    "BatchEngine",
    # what it raises
    "KVRestoreError",
    "InvalidInputError",
    "StoreError",
    "SaveError",
    "UnsupportedModelError",
    "UnsupportedURLError",
    "UsageError",
]
