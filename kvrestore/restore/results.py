"""What a restore returns, and what both restore axes take: the job and the parts that run it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvrestore.backends.base import ComputeBackend
from kvrestore.chunkio import ChunkLoader
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.planning.auto import Plan
from kvrestore.planning.planner import Planner
from kvrestore.policies import Policy, Progress
from kvrestore.runtime.engine import Engine
from kvrestore.runtime.request import ComputeFn, LoadFn, RunRequest
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.deadline import Deadlines, DeadlineStore


@dataclass
class RestoreStats:
    policy: str  # the policy asked for: the caller's, or the one `Auto` chose
    n_tokens: int
    n_chunks: int
    hit_chunks: int  # chunks the store listed before the restore began
    computed_chunks: int
    loaded_chunks: int
    failed_loads: int  # listed but unusable: missing, corrupt, truncated, foreign, store error
    bytes_loaded: int
    seconds: float
    errors: list[str] = field(default_factory=list)
    axis: str = "tokens"  # "layers": the stored prefix was restored layer by layer (LayerTwoPointer)
    computed_layers: int = 0  # on the layer axis: layers computed / loaded over the stored prefix
    loaded_layers: int = 0
    #: why the restore ran otherwise than `policy` reads (empty: as it reads): a `LayerTwoPointer`
    #: predicted to load every layer before computing one loads whole chunks along tokens instead
    #: (`restore.layer_wise.WHOLE_CHUNKS`), so `axis` is "tokens"
    handoff: str = ""


@dataclass
class RestoreResult:
    kv: KVCache
    stats: RestoreStats
    trace: Trace
    plan: Plan | None = None  # with `Auto` (the default): what it predicted, and why it chose


class Job(NamedTuple):
    """One restore's tokens, chunks and lookup, as both axes take them. With `members`, each of `refs`
    is a unit of several stored chunks, `members[i]` (`Units`): loaded one after another, computed as one."""

    tokens: torch.Tensor
    refs: list[ChunkRef]
    stored: list[bool]
    errors: list[str]
    on_event: Callable[[TraceEvent], None] | None
    out: KVCache | None
    members: list[list[ChunkRef]] | None = None


#: chunks shorter than this do not pay for a unit of their own: each unit costs the driver, the
#: policy, a lane's round trip and the compute call a fixed share (about a millisecond of Python on a
#: CPU, several on a busy one; measured with 1-token chunks), so they are grouped into units (`Units`)
SHORT_CHUNK_TOKENS = 16
#: the tokens of a unit of short chunks (the last may have fewer): 2,048 1-token chunks in 32 units
UNIT_TOKENS = 64


@dataclass(frozen=True)
class Units:
    """A prompt's chunks grouped into the units a token-wise restore plans and runs. Where a chunk
    (but the last) is shorter than `SHORT_CHUNK_TOKENS`, consecutive chunks of `UNIT_TOKENS` together
    (the last unit may be shorter), each unit stored if all of its chunks are; else each chunk is its
    own unit (`members` is then None)."""

    refs: list[ChunkRef]  # one per unit: its token range, its first chunk's key
    stored: list[bool]
    members: list[list[ChunkRef]] | None

    @classmethod
    def of(
        cls,
        refs: list[ChunkRef],
        stored: list[bool],
        short: int = SHORT_CHUNK_TOKENS,
        unit: int = UNIT_TOKENS,
    ) -> Units:
        if all(r.n_tokens >= short for r in refs[:-1]):
            return cls(refs, stored, None)
        groups: list[list[int]] = [[]]
        tokens = 0  # in the last group
        for i, r in enumerate(refs):
            if tokens >= unit:
                groups.append([])
                tokens = 0
            groups[-1].append(i)
            tokens += r.n_tokens
        units = [ChunkRef(u, refs[g[0]].start, refs[g[-1]].end, refs[g[0]].key) for u, g in enumerate(groups)]
        return cls(units, [all(stored[i] for i in g) for g in groups], [[refs[i] for i in g] for g in groups])


@dataclass
class Parts:
    """What runs a restore: the model, the store and its chunk loader, the engine's lanes, the planner
    that learns from each run, and the restorer's deadlines (read at each restore, never copied): a load's
    deadline is enforced by the store (`DeadlineStore`) or, for blocking reads, by the engine, never both."""

    backend: ComputeBackend
    store: ChunkStore
    engine: Engine
    loader: ChunkLoader
    planner: Planner
    deadlines: Deadlines

    def buffer(self, out: KVCache | None, n_tokens: int) -> KVCache:
        """A new KV buffer, or the head of `out` (checked by `Restorer.restore`), that the lanes' CUDA
        streams write only after what the caller's stream has queued (`Engine.lanes_after_current`)."""
        if out is None:
            kv = KVCache.empty(self.backend.spec, n_tokens, device=self.backend.device)
        else:
            kv = out.head(n_tokens)
        self.engine.lanes_after_current(kv.data.device)
        return kv

    def request(
        self, progress: Progress, policy: Policy, compute: ComputeFn, load: LoadFn, **kwargs: Any
    ) -> RunRequest:
        """A restore as the engine runs it, under these parts' load deadline (`kwargs`: the rest of
        `RunRequest`: `on_event`, `fast_paths`, `delivered`, `priors`)."""
        return RunRequest(
            progress,
            policy,
            compute,
            load,
            load_timeout_s=self.engine_load_timeout_s(),
            timed_out=self.timed_out(),
            **kwargs,
        )

    def engine_load_timeout_s(self) -> float | None:
        """What the engine bounds each load by: `Deadlines.load_s` (read now) where the store's reads
        block (`reads_sync`: the engine abandons a read past it), else None, as the store bounds each of
        its reads by the same deadline (`DeadlineStore`): every load is timed once."""
        return self.deadlines.load_s if self.store.reads_sync else None

    def timed_out(self) -> Callable[[float], None] | None:
        """What a restore tells when one of its loads ran past `load_timeout_s`: the store under its
        deadlines (`DeadlineStore.timed_out`), which then counts as down for a back-off."""
        return self.store.timed_out if isinstance(self.store, DeadlineStore) else None
