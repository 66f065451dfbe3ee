"""A ready-made stage process: restore one prompt on every rank and gather it (for `spawn` or torchrun)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from kvrestore.core.keys import DEFAULT_CHUNK_SIZE
from kvrestore.core.kv import KVCache
from kvrestore.distributed.layout import StageLayout
from kvrestore.distributed.restore import StageRestorer, StageStats, gather_kv
from kvrestore.policies import Policy
from kvrestore.stores import open_store


@dataclass(frozen=True)
class StageJob:
    """What every stage process restores. `backend` makes the model in the process (a picklable callable,
    e.g. `HFBackend.from_smollm2`); `store_url` opens each process's own link to the store."""

    backend: Callable[[], Any]
    store_url: str
    tokens: Sequence[int]
    chunk_size: int = DEFAULT_CHUNK_SIZE
    policy: Policy | None = None  # None: TokenTwoPointer
    gather: bool = True  # gather the shards into one KVCache on stage 0
    sequential: bool = False
    timeout_s: float = 60.0


@dataclass
class StageOutcome:
    stage: int
    layers: tuple[int, int]
    stats: StageStats
    kv: KVCache | None  # the whole KV cache on stage 0 when gathered, else None


def run_job(rank: int, world: int, job: StageJob) -> StageOutcome:
    """Restore `job` as stage `rank` of `world` (evenly split layers): `spawn(run_job, S, job)`."""
    backend = job.backend()
    layout = StageLayout.even(backend.spec.num_layers, world)
    stage = StageRestorer(backend, open_store(job.store_url), layout, job.chunk_size, timeout_s=job.timeout_s)
    result = anyio.run(partial(stage.restore, list(job.tokens), job.policy, sequential=job.sequential))
    kv = gather_kv(result, backend.spec, timeout_s=job.timeout_s) if job.gather else None
    return StageOutcome(rank, result.layers, result.stats, kv)
