"""Stage-parallel restore from boundary activations (CacheFlow §3.2), over torch.distributed.

A model split into S pipeline stages (processes; usually GPUs) restores a prompt's KV cache with every
stage working at once: each chunk is saved with the hidden state entering each stage's first layer (its
boundary activation, `save_with_boundaries`), so stage s computes its chunks from those instead of waiting
for stage s-1, and restores its layers with the two-pointer against its own compute and store link. The
ideal time is T*/S (CacheFlow eq. 2). The shards stay on their stages (`StageResult.shard`) or are
gathered into one `KVCache` (`gather_kv`).

    from kvrestore.distributed import StageLayout, StageRestorer, gather_kv, spawn
"""

from kvrestore.distributed.boundaries import (
    BoundaryReader,
    BoundarySaveStats,
    prefill_with_boundaries,
    save_with_boundaries,
    write_boundaries,
)
from kvrestore.distributed.group import free_port, init_stages, spawn
from kvrestore.distributed.job import StageJob, StageOutcome, run_job
from kvrestore.distributed.layout import StageLayout
from kvrestore.distributed.plan import StagePlan
from kvrestore.distributed.restore import StageRestorer, StageResult, StageStats, gather_kv
from kvrestore.distributed.stage_backend import StageBackend

__all__ = [
    "BoundaryReader",
    "BoundarySaveStats",
    "StageBackend",
    "StageJob",
    "StageLayout",
    "StageOutcome",
    "StagePlan",
    "StageRestorer",
    "StageResult",
    "StageStats",
    "free_port",
    "gather_kv",
    "init_stages",
    "prefill_with_boundaries",
    "run_job",
    "save_with_boundaries",
    "spawn",
    "write_boundaries",
]
