"""Restorer: the object a serving process imports. save / lookup / restore, async and sync."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import anyio
import anyio.from_thread
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.backends.base import ComputeBackend
from kvrestore.chunkio import ChunkLoader
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader, StoredChunk
from kvrestore.core.errors import (
    ChunkDecodeError,
    InvalidInputError,
    SaveError,
    StoreError,
    check_int,
    check_seconds,
)
from kvrestore.core.keys import DEFAULT_CHUNK_SIZE, ChunkRef, chunk_keys
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec, dtype_name
from kvrestore.core.trace import Trace, TraceEvent
from kvrestore.costs.learned import CostLearner, check_learn, learned_path, store_name
from kvrestore.costs.profile import Calibration, LinkEstimate, Profile
from kvrestore.planning.auto import PLANNED, Auto, Plan, Workload, predict
from kvrestore.policies import Blend, ComputeOnly, LoadOnly, Policy, Progress, TokenTwoPointer
from kvrestore.runtime.engine import LOAD_FAULTS, Engine, on_stream
from kvrestore.stores.base import ChunkStore

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("kvrestore.restorer")

if TYPE_CHECKING:
    from kvrestore.blend import BlendResult, StoreCandidate, StorePlacement

TokenIds = Sequence[int] | torch.Tensor

#: On a GPU a compute unit smaller than this is launch-bound: measured on an H100 with Llama-3.1-8B's
#: shape, a 256-token unit costs about 1.1 ms of kernel launches per layer for 0.28 ms of work, while from
#: about 1,024-2,048 tokens the work hides the launches (`benchmarks/gpu_restore.py --compute-chunks`).
#: On a CPU the work always dominates, so units stay as small as the policy likes.
CUDA_MIN_UNIT_TOKENS = 2048

#: with learned costs, how much faster a strategy never run must be predicted than one that was run,
#: to be chosen over it (`Auto.plan`): learned from one strategy's restores, the others' predictions
#: are extrapolations
UNTRIED_MARGIN = 1.15

#: a compute unit's fixed cost (launches, per-call work) may be at most this share of its time
LAUNCH_SHARE = 0.25
#: the largest unit the cost model may ask for on its own
MAX_MIN_UNIT_TOKENS = 4096

#: faults of one chunk's write that fail that chunk only (`SaveError`); any other error is a bug and propagates
WRITE_FAULTS = (StoreError, OSError)


@dataclass
class RestoreStats:
    policy: str
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


@dataclass
class RestoreResult:
    kv: KVCache
    stats: RestoreStats
    trace: Trace
    plan: Plan | None = None  # with `Auto` (the default): what it predicted, and why it chose


@dataclass
class SaveStats:
    n_chunks: int
    written_chunks: int
    skipped_chunks: int  # already stored
    bytes_written: int
    seconds: float


def as_token_tensor(token_ids: TokenIds) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor; a clear error for anything else."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidInputError("token_ids must be integer token ids, not text: tokenize first")
    try:
        t = torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidInputError(f"token_ids must be a sequence of integers: {exc}") from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InvalidInputError(f"token_ids must be 1-D (or [1, n]), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise InvalidInputError("token_ids is empty: nothing to restore")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise InvalidInputError(f"token_ids must be integers, got {t.dtype}")
    return t.to(device="cpu", dtype=torch.int64)


class Restorer:
    """Saves a prompt's KV cache chunk by chunk and restores it with a policy.

    `chunk_size` tokens per stored chunk (default 256); `load_lanes` concurrent fetches;
    `compression` "none" or "zstd" for written chunks. Restorers may share an `Engine` (its lanes).
    `profile` is the cost model the `Auto` planner predicts with: a `Profile`, a path to one, or None
    for the one `kvrestore profile` saved for this machine and model (if any), or False for none even
    if one is saved. Without one, the
    restorer learns the cost model from its own saves and restores (`costs`, see `kvrestore.costs.learned`);
    `learn` keeps what it learned for the next restorer of this machine, model and store: True under
    the cache directory, a path, or False (in memory only). A profile's store link is only a starting
    point: `link` follows the loads of every restore.
    """

    def __init__(
        self,
        backend: ComputeBackend,
        store: ChunkStore,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        load_lanes: int = 4,
        compression: str = "none",
        engine: Engine | None = None,
        load_timeout_s: float | None = 30.0,
        profile: Profile | str | os.PathLike | Literal[False] | None = None,
        learn: bool | str | os.PathLike = True,
    ) -> None:
        if not isinstance(getattr(backend, "spec", None), ModelSpec):  # (wrappers forward attributes)
            raise InvalidInputError(
                f"backend must be a ComputeBackend with a ModelSpec (e.g. HFBackend(model)), got {backend!r}"
            )
        if not isinstance(store, ChunkStore):
            raise InvalidInputError(f"store must be a ChunkStore (e.g. open_store(url)), got {store!r}")
        if engine is not None and not isinstance(engine, Engine):
            raise InvalidInputError(f"engine must be an Engine or None, got {engine!r}")
        if compression not in ("none", "zstd"):
            raise InvalidInputError(f"compression must be 'none' or 'zstd', got {compression!r}")
        self.backend = backend
        self.store = store
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.compression = compression
        self.engine = engine or Engine(load_lanes)
        check_int("load_lanes", load_lanes)  # also where a given engine makes it unused
        self.loader = ChunkLoader(self.spec, store, lambda device: self.engine.cuda_stream("load", device))
        self.load_timeout_s = check_seconds("load_timeout_s", load_timeout_s)
        self.profile = self._profile(profile)
        self.costs = CostLearner(self.spec, self.backend.device, store_name(store))
        learn = check_learn(learn)
        self._learned_at = (
            learned_path(self.spec, self.backend.device, self.costs.state.store)
            if learn is True
            else learn or None
        )
        if self._learned_at is not None:
            self.costs.load(self._learned_at)
        start = self.profile.link if self.profile is not None else None
        self.link = LinkEstimate(start or self.costs.state.link)
        self.link.measured_latency = start is not None  # else it goes on estimating it from the loads
        self.calibration = Calibration()  # how this restorer's restores compare with predictions
        self.calibration.resume(self.costs.state.calibration, self.costs.state.calibrated)

    @property
    def cost_model(self) -> Profile | None:
        """What `Auto` predicts with: the measured profile, else the learned costs (None before any
        compute unit was seen)."""
        return self.profile if self.profile is not None else self.costs.profile()

    def _costs_line(self) -> str:
        if self.profile is not None:
            return f"from the profile of this machine ({self.profile.created or 'kvrestore profile'})"
        return self.costs.describe()

    def _profile(self, profile: Profile | str | os.PathLike | Literal[False] | None) -> Profile | None:
        if profile is False:  # none, even if one is saved: the costs are learned
            return None
        if profile is None:
            return Profile.find(self.spec, self.backend.device)
        if not isinstance(profile, Profile):
            profile = Profile.load(profile)
        if not profile.matches(self.spec, self.backend.device):
            raise InvalidInputError(
                f"the profile is of {profile.model} ({profile.dtype}, {profile.device}), not of "
                f"{self.spec.name} ({dtype_name(self.spec.dtype)}, {torch.device(self.backend.device).type})"
            )
        return profile

    def plan(self, token_ids: TokenIds, stored: Sequence[bool], policy: Auto | None = None) -> Plan:
        """What `Auto` would choose for `token_ids` given which chunks are `stored` (see `Plan.explain`)."""
        _, refs = self.chunks(token_ids)
        if len(stored) != len(refs):
            raise InvalidInputError(f"stored has {len(stored)} flags for {len(refs)} chunks")
        return self._plan(refs, stored, policy)

    def _plan(self, refs: list[ChunkRef], stored: Sequence[bool], policy: Auto | None) -> Plan:
        work = self._workload(refs, stored)
        return (policy or Auto()).plan(
            self.cost_model,
            self.link.current,
            work,
            self.calibration,
            costs=self._costs_line(),
            untried_margin=1.0 if self.profile is not None else UNTRIED_MARGIN,
        )

    def _workload(self, refs: list[ChunkRef], stored: Sequence[bool]) -> Workload:
        return Workload(
            tuple(r.n_tokens for r in refs),
            tuple(bool(s) for s in stored),
            self.spec.num_layers,
            self.spec.kv_bytes_per_token,
            self.engine.load_lanes,
            self._min_unit_chunks(),
        )

    def _min_unit_chunks(self) -> int:
        """`Progress.min_unit_chunks` of this restorer's token-wise restores (see `_min_unit_tokens`)."""
        if not self.engine.times_restores_alone:  # a batch scheduler sizes units from its own token budget
            return 1
        return max(1, -(-self._min_unit_tokens() // self.chunk_size))

    def _predicted(
        self, policy: Policy, plan: Plan | None, refs: list[ChunkRef], stored: Sequence[bool]
    ) -> float | None:
        """The cost model's own (uncalibrated) prediction for running `policy`, where there is one to
        learn from: a cost model, a link estimate, a strategy the planner knows, and an engine whose
        restore times are their own (`Engine.times_restores_alone`; not a `BatchEngine`)."""
        model = self.cost_model
        if model is None or self.link.current is None or not self.engine.times_restores_alone:
            return None
        if plan is not None and policy.name in plan.predicted_s:
            return plan.predicted_s[policy.name] / plan.calibration.get(policy.name, 1.0)
        if policy.name not in PLANNED or not any(stored):
            return None
        return predict(policy, model, self.link.current, self._workload(refs, stored))

    @property
    def spec(self) -> ModelSpec:
        return self.backend.spec

    def chunks(self, token_ids: TokenIds) -> tuple[torch.Tensor, list[ChunkRef]]:
        """Validated tokens and their chunks (with store keys)."""
        tokens = as_token_tensor(token_ids)
        self._check_length(len(tokens))
        self.backend.validate_tokens(tokens)
        return tokens, chunk_keys(tokens, self.spec.fingerprint, self.chunk_size)

    def _check_length(self, n_tokens: int, what: str = "the prompt") -> None:
        """Refuse more tokens than the model's context (the backend's `context_length`, if it has one)."""
        limit = getattr(self.backend, "context_length", None)
        if limit is not None and n_tokens > limit:
            raise InvalidInputError(
                f"{what} has {n_tokens} tokens, more than {self.spec.name} takes: its context is {limit} "
                "tokens (max_position_embeddings)"
            )

    def _check_kv(self, name: str, kv: object, n_tokens: int) -> KVCache:
        """`kv` if it is a KVCache of this model with room for `n_tokens`, else InvalidInputError."""
        if not isinstance(kv, KVCache):
            raise InvalidInputError(
                f"{name} must be a KVCache (e.g. KVCache.empty(restorer.spec, n_tokens)), got "
                f"{type(kv).__name__}"
            )
        if not kv.fits(self.spec, n_tokens):
            raise InvalidInputError(
                f"{name} ({kv.n_tokens} tokens of {kv.spec.name}, {kv.data.dtype}) cannot hold {n_tokens} "
                f"tokens of {self.spec.name} ({self.spec.dtype})"
            )
        return kv

    async def lookup(self, token_ids: TokenIds) -> int:
        """Number of leading tokens covered by stored chunks (the longest stored prefix)."""
        _, refs = self.chunks(token_ids)
        present = await self.store.contains([r.key for r in refs])
        covered = 0
        for ref, ok in zip(refs, present, strict=False):
            if not ok:
                break
            covered = ref.end
        return covered

    async def save(self, token_ids: TokenIds, kv: KVCache | None = None) -> SaveStats:
        """Write every chunk of the prompt the store lacks.

        Without `kv`, the KV comes from a restore: chunks already stored are loaded, not recomputed, so
        saving a conversation that grew by one turn computes only the new tokens (a stored chunk that
        turns out unusable is recomputed and written again).

        Store faults on writing fail only their chunks: once every write has ended, they raise one
        `SaveError` (a `StoreError`) whose `written` are the keys stored (they stay stored) and `failed` the
        keys that were not, with their errors. Any other error propagates as itself.
        """
        t0 = time.perf_counter()
        tokens, refs = self.chunks(token_ids)
        if kv is not None:
            self._check_kv("kv", kv, len(tokens))
        present = await self.store.contains([r.key for r in refs])
        todo = [r for r, ok in zip(refs, present, strict=True) if not ok]
        written = 0
        if todo:
            if kv is None:
                policy = LoadOnly() if any(present) else ComputeOnly()
                result = await self._restore(_Job(tokens, refs, present, [], None, None), policy)
                kv = result.kv
                failed = {e.first_chunk for e in result.trace.of_kind("load-failed")}
                todo = [r for r, ok in zip(refs, present, strict=True) if not ok or r.index in failed]
            written = await self._write_chunks(kv, todo)
        return SaveStats(len(refs), len(todo), len(refs) - len(todo), written, time.perf_counter() - t0)

    async def restore(
        self,
        token_ids: TokenIds,
        policy: Policy | None = None,
        on_event: Callable[[TraceEvent], None] | None = None,
        out: KVCache | None = None,
    ) -> RestoreResult:
        """The KV cache of `token_ids`, assembled by `policy` from compute and loads.

        The default policy depends on the engine (`Engine.plans_by_default`): on a plain `Engine` the `Auto`
        planner, which predicts every strategy with the restorer's profile and picks the fastest
        (`result.plan` says what it predicted and why); on a `BatchEngine` the token-wise two-pointer,
        whose lanes the batch scheduler shares out. `out` is a buffer to restore into (a serving process
        reuses its KV memory instead of allocating and first-touching a new buffer per request); the
        result's `kv` then shares it.
        """
        tokens, refs = self.chunks(token_ids)
        if policy is not None and not isinstance(policy, Policy):
            hint = " (a Blend goes to restore_blend)" if isinstance(policy, Blend) else ""
            raise InvalidInputError(
                f"policy must be a Policy such as TokenTwoPointer(), got {policy!r}{hint}"
            )
        if out is not None:
            self._check_kv("out", out, len(tokens))
            if out.data.device != torch.device(self.backend.device):
                raise InvalidInputError(
                    f"out is on {out.data.device}; the model runs on {self.backend.device}"
                )
        errors: list[str] = []
        try:
            stored = await self.store.contains([r.key for r in refs])
        except LOAD_FAULTS as exc:  # the store is down: a restore still finishes, by computing
            stored = [False] * len(refs)
            errors.append(f"lookup: {type(exc).__name__}: {exc}")
            log.warning(
                "store lookup failed (%s: %s): computing all %d tokens", type(exc).__name__, exc, len(tokens)
            )
        policy = policy or (Auto() if self.engine.plans_by_default else TokenTwoPointer())
        plan = None
        if isinstance(policy, Auto):
            plan = self._plan(refs, stored, policy)
            policy = plan.choice
            if log.isEnabledFor(logging.DEBUG):  # explain() works out L_delta: dozens of simulations
                log.debug("restore of %d tokens: %s", len(tokens), plan.explain())
        predicted = self._predicted(policy, plan, refs, stored)
        job = _Job(tokens, refs, stored, errors, on_event, out)
        if policy.axis == "layers":
            result = await self._restore_layers(job, policy)
        else:
            result = await self._restore(job, policy)
        if result.stats.failed_loads:
            log.warning(
                "%d of %d stored chunks (or layer reads) could not be used and were computed instead: %s",
                result.stats.failed_loads,
                result.stats.hit_chunks,
                result.stats.errors[-1],
            )
        if predicted is None and self.profile is None:
            # an exploring restore: set against what the costs it just taught predict for it, so the
            # planner knows how that strategy compares with its model (and that it has run it)
            predicted = self._predicted(policy, None, refs, stored)
        if predicted is not None and not result.stats.errors:
            self.calibration.observe(policy.name, predicted, result.stats.seconds)
        self.costs.observe_restore()
        await self._keep_learned()
        result.plan = plan
        return result

    def _learn(self, trace: Trace, refs: list[ChunkRef], layers_over: int | None = None) -> None:
        """Feed what a restore (or a save's restore) did to the cost model and the link estimate: its
        compute units (token-wise, or layer-wise over `layers_over` tokens) and its loads. Compute
        times are learned only where the restore had the compute lane to itself (not under a batch
        scheduler)."""
        if self.engine.times_restores_alone:
            for e in trace.of_kind("compute"):
                seconds = e.end_s - e.start_s
                if layers_over is None:
                    start = refs[e.first_chunk].start
                    self.costs.observe_compute(refs[e.last_chunk].end - start, start, seconds)
                else:
                    self.costs.observe_layers(layers_over, e.last_chunk - e.first_chunk + 1, seconds)
        moved = self.link.observe(trace)
        self.costs.observe_link(self.link.current, moved)

    async def _keep_learned(self) -> None:
        """Persist what was learned (a small JSON file; a failure to write it is logged, not raised)."""
        if self._learned_at is None or self.profile is not None:
            return
        self.costs.state.calibration = self.calibration.logs()
        self.costs.state.calibrated = dict(self.calibration.observations)
        try:
            await anyio.to_thread.run_sync(self.costs.save, self._learned_at)
        except OSError as exc:
            log.warning("could not keep the learned costs at %s: %s", self._learned_at, exc)
            self._learned_at = None

    async def _restore(self, job: _Job, policy: Policy) -> RestoreResult:
        """`restore` for tokens already chunked and looked up (`save` has done both before it needs KV)."""
        tokens, refs, stored, errors, on_event, out = job
        t0 = time.perf_counter()
        kv = self._buffer(out, len(tokens))
        progress = Progress([r.n_tokens for r in refs], list(stored))
        progress.min_unit_chunks = self._min_unit_chunks()

        def compute(a: int, b: int) -> None:
            self._prefill_into(kv, tokens, refs[a].start, refs[b - 1].end)

        def compute_apart(a: int, b: int) -> Callable[[], None]:
            return self._prefill_apart(kv, tokens, refs[a].start, refs[b - 1].end)

        async def load(i: int) -> int:
            return await self._load_chunk(refs[i], kv)

        damaged: list[str] = []  # found damaged on a lane thread: deleted once the restore is over

        def load_now(
            i: int,
        ) -> int:  # on a load-lane thread (`Engine.run`), for stores that read without the loop
            ref = refs[i]
            try:
                return self.loader.load_now(ref.key, ref.start, kv.chunk(ref.start, ref.end).data)
            except ChunkDecodeError:
                damaged.append(ref.key)
                raise

        try:
            trace = await self.engine.run(
                progress,
                policy,
                compute,
                load,
                on_event,
                self.load_timeout_s,
                load_now=load_now if self.loader.reads_now else None,
                compute_apart=compute_apart,
            )
        finally:
            for key in damaged:
                await self._forget(key)
        failed = trace.of_kind("load-failed")
        stats = RestoreStats(
            policy=policy.name,
            n_tokens=len(tokens),
            n_chunks=len(refs),
            hit_chunks=sum(stored),
            computed_chunks=sum(e.last_chunk - e.first_chunk + 1 for e in trace.of_kind("compute")),
            loaded_chunks=len(trace.of_kind("load")),
            failed_loads=len(failed),
            bytes_loaded=progress.bytes_loaded,
            seconds=time.perf_counter() - t0,
            errors=errors + [f"chunk {e.first_chunk}: {e.error}" for e in failed],
        )
        self._learn(trace, refs)
        return RestoreResult(kv, stats, trace)

    async def _restore_layers(self, job: _Job, policy: Policy) -> RestoreResult:
        """`restore` along layers: the stored prefix layer by layer (compute bottom-up, load top-down,
        as `policy` decides), then the chunks after it computed token-wise.

        A fault on any layer read (missing, damaged or foreign chunk, store error) fails that layer and
        every later one, which are computed instead: once a chunk is unusable, no layer read that
        includes it can be used.
        """
        tokens, refs, stored, errors, on_event, out = job
        k = stored.index(False) if False in stored else len(stored)
        if k == 0:  # nothing stored: layers have nothing to load
            return await self._restore(job, ComputeOnly())
        t0 = time.perf_counter()
        kv = self._buffer(out, len(tokens))
        n_layers, prefix = self.spec.num_layers, refs[k - 1].end
        progress = Progress([prefix] * n_layers, [True] * n_layers)
        reader = LayerReader(
            self.spec,
            self.store,
            [StoredChunk(r.key, r.start, r.start, r.n_tokens) for r in refs[:k]],
            stream=self.engine.cuda_stream("load", kv.data.device),
            pool=self.loader.pool(pinned=True),
        )
        compute = _LayerCompute(
            self.backend, tokens[:prefix], kv, self.engine.cuda_stream("compute", kv.data.device)
        )
        opening = anyio.Lock()

        async def load(layer: int) -> int:
            async with opening:  # the first read opens every chunk's header
                if not reader.opened:
                    await reader.open()
            if reader.unusable:  # a layer read without a chunk would leave its rows unset
                error = reader.errors[-1] if reader.errors else "not in the store"
                raise ChunkLoadFailed(reader.unusable, f"layer reads stopped: {error}")
            return await reader.read_layer(layer, kv)

        trace = await self.engine.run(progress, policy, compute, load, on_event, self.load_timeout_s)
        self._learn(trace, refs, layers_over=prefix)
        if k < len(refs):  # the chunks after the stored prefix, computed on top of it
            t_tail = time.perf_counter()
            await self.engine.compute(self._prefill_into, kv, tokens, prefix, len(tokens))
            if self.engine.times_restores_alone:
                self.costs.observe_compute(len(tokens) - prefix, prefix, time.perf_counter() - t_tail)
        failed = trace.of_kind("load-failed")
        computed_layers = sum(e.last_chunk - e.first_chunk + 1 for e in trace.of_kind("compute"))
        loaded_layers = len(trace.of_kind("load"))
        stats = RestoreStats(
            policy=policy.name,
            n_tokens=len(tokens),
            n_chunks=len(refs),
            hit_chunks=sum(stored),
            computed_chunks=len(refs) - k + (k if computed_layers else 0),
            loaded_chunks=k if loaded_layers else 0,
            failed_loads=len(failed),
            bytes_loaded=reader.bytes_read,
            seconds=time.perf_counter() - t0,
            errors=errors + [f"layer {e.first_chunk}: {e.error}" for e in failed],
            axis="layers",
            computed_layers=computed_layers,
            loaded_layers=loaded_layers,
        )
        return RestoreResult(kv, stats, trace)

    def _min_unit_tokens(self) -> int:
        """The fewest tokens a compute unit should cover: the backend's `min_unit_tokens` if it says;
        else, from the cost model, the fewest for which the fixed cost of a unit (on a GPU, mostly
        kernel launches) is at most `LAUNCH_SHARE` of its time, so launch-bound units are merged; before
        any cost is known, `CUDA_MIN_UNIT_TOKENS` on a GPU and none on a CPU."""
        own = getattr(self.backend, "min_unit_tokens", None)
        if own is not None:
            return int(own)
        model = self.cost_model
        if model is not None and model.chunk.per_token_s > 0:
            fixed, per_token = model.chunk.fixed_s, model.chunk.per_token_s
            return min(MAX_MIN_UNIT_TOKENS, math.ceil(fixed * (1 - LAUNCH_SHARE) / LAUNCH_SHARE / per_token))
        return CUDA_MIN_UNIT_TOKENS if torch.device(self.backend.device).type == "cuda" else 0

    def _prefill_into(self, kv: KVCache, tokens: torch.Tensor, start: int, end: int) -> None:
        """Compute tokens [start, end) on top of the KV of [0, start) (blocking, on the compute lane)."""
        stream = self.engine.cuda_stream("compute", kv.data.device)
        prefill_into = getattr(self.backend, "prefill_into", None)
        try:
            with on_stream(stream):  # its own CUDA stream, so load copies overlap it
                if prefill_into is not None:  # into the cache, attending over it: no copy of the past
                    prefill_into(tokens[start:end], kv.data, start)
                else:
                    past = kv.prefix(start) if start else None
                    kv.write(self.backend.prefill_chunk(tokens[start:end], past, start))
        finally:  # a unit is done when its kernels are, not when they are queued (also when cancelled)
            if stream is not None:
                stream.synchronize()

    def _prefill_apart(self, kv: KVCache, tokens: torch.Tensor, start: int, end: int) -> Callable[[], None]:
        """Compute tokens [start, end) on top of the KV of [0, start) without writing them into `kv`
        (a compute unit racing a fetch of the same rows); returns what writes them (on the lane)."""
        stream = self.engine.cuda_stream("compute", kv.data.device)
        try:
            with on_stream(stream):
                chunk = self.backend.prefill_chunk(
                    tokens[start:end], kv.prefix(start) if start else None, start
                )
        finally:
            if stream is not None:
                stream.synchronize()

        def commit() -> None:
            with on_stream(stream):
                kv.write(chunk)
            if stream is not None:
                stream.synchronize()

        return commit

    async def save_chunk(self, token_ids: TokenIds, prefix: TokenIds | None = None) -> str:
        """Prefill a chunk on its own and store its KV under a content key, for `restore_blend`.

        The key depends on the chunk's tokens (and the optional shared `prefix`, e.g. a system prompt,
        that it is prefilled after), not on its neighbours, so the chunk is found again in any prompt,
        at any position. Returns the key; a stored chunk is not recomputed.
        """
        from kvrestore.blend import save_chunk

        tokens = as_token_tensor(token_ids)
        self.backend.validate_tokens(tokens)
        head = self._optional_tokens(prefix)
        self._check_length(len(head) + len(tokens), "the prefix and chunk")
        key, _ = await save_chunk(self.backend, self.store, tokens, prefix=head, compression=self.compression)
        return key

    async def restore_blend(
        self,
        chunks: Sequence[TokenIds],
        suffix: TokenIds | None = None,
        policy: Blend | None = None,
        prefix: TokenIds | None = None,
    ) -> BlendResult:
        """CacheBlend: the KV of `prefix` + `chunks` (saved with `save_chunk`, in any order) + `suffix`,
        reusing the chunks' KV with selective recompute (`kvrestore.policies.Blend`). Returns a
        `kvrestore.blend.BlendResult`: `kv` and `tokens` go straight into `backend.generate()`."""
        from kvrestore.blend import restore_blend

        if isinstance(chunks, (str, bytes, torch.Tensor)) or not isinstance(chunks, Sequence):
            raise InvalidInputError("chunks must be a list of token-id sequences, one per chunk")
        if policy is not None and not isinstance(policy, Blend):
            raise InvalidInputError(f"policy must be a Blend (or None), got {policy!r}")
        parts = [as_token_tensor(c) for c in chunks]
        for t in parts:
            self.backend.validate_tokens(t)
        tail, head = self._optional_tokens(suffix), self._optional_tokens(prefix)
        total = len(head) + sum(len(t) for t in parts) + len(tail)
        self._check_length(total, "the blend (prefix, chunks and suffix)")
        return await restore_blend(
            self.backend,
            self.store,
            parts,
            tail,
            policy,
            prefix=head,
            load_stream=self.engine.cuda_stream("load", self.backend.device),
            pool=self.loader.pool(pinned=True),
        )

    async def choose_blend_store(
        self, candidates: Sequence[StoreCandidate], n_tokens: int, ratio: float = 0.15
    ) -> StorePlacement:
        """Where to `save_chunk` for blends of about `n_tokens` tokens at `ratio`: the cheapest of the
        `candidates` whose per-layer load hides behind the recompute (CacheBlend §5.1), measured on the
        stores themselves and on this restorer's profile (or the model, timed, without one); see
        `kvrestore.blend.placement`."""
        from kvrestore.blend.placement import choose_blend_store

        layer_cost = self.profile.layer if self.profile is not None else None
        return await choose_blend_store(
            self.backend, candidates, n_tokens=n_tokens, ratio=ratio, layer_cost=layer_cost
        )

    def _optional_tokens(self, token_ids: TokenIds | None) -> torch.Tensor:
        """Validated tokens, or an empty tensor for None / an empty sequence."""
        with contextlib.suppress(TypeError):  # no length: as_token_tensor says what is wrong
            if token_ids is None or len(token_ids) == 0:
                return torch.zeros(0, dtype=torch.int64)
        tokens = as_token_tensor(token_ids)
        self.backend.validate_tokens(tokens)
        return tokens

    async def close(self) -> None:
        await self._keep_learned()
        await self.store.close()

    async def __aenter__(self) -> Restorer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------------------------

    def _buffer(self, out: KVCache | None, n_tokens: int) -> KVCache:
        """A new KV buffer, or the head of `out` (checked by `restore`)."""
        if out is None:
            return KVCache.empty(self.spec, n_tokens, device=self.backend.device)
        return out.head(n_tokens)

    async def _load_chunk(self, ref: ChunkRef, kv: KVCache) -> int:
        try:
            return await self._read_chunk(ref, kv)
        except ChunkDecodeError:
            await self._forget(ref.key)
            raise

    async def _forget(self, key: str) -> None:
        """Delete a damaged chunk: never serve it again; the next save writes a good copy."""
        log.warning("chunk %s is damaged: deleted from the store (the next save writes it again)", key)
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.store.delete(key)  # best effort: the miss is what matters

    async def _read_chunk(self, ref: ChunkRef, kv: KVCache) -> int:
        """Fetch, verify and place one chunk in the cache's token range (`chunkio.ChunkLoader`); returns
        the stored bytes read. A fault raises before the chunk counts as loaded."""
        return await self.loader.load(ref.key, ref.start, kv.chunk(ref.start, ref.end).data)

    async def _write_chunks(self, kv: KVCache, refs: list[ChunkRef]) -> int:
        """Encode and store `refs`' chunks, `load_lanes` at a time; returns the bytes written. Store
        faults (`WRITE_FAULTS`) fail their chunk only: `SaveError` once all writes have ended."""
        nbytes = 0
        written: list[str] = []
        failed: dict[str, Exception] = {}
        limiter = anyio.CapacityLimiter(self.engine.load_lanes)

        async def write(ref: ChunkRef) -> None:
            nonlocal nbytes
            async with limiter:
                chunk = kv.chunk(ref.start, ref.end)
                blob = await anyio.to_thread.run_sync(
                    lambda: codec.encode_chunk(chunk, self.spec, ref.key, compression=self.compression)
                )
                try:
                    await self.store.put(ref.key, blob)
                except WRITE_FAULTS as exc:
                    failed[ref.key] = exc
                    return
                written.append(ref.key)
                nbytes += len(blob)

        try:
            async with anyio.create_task_group() as tg:
                for ref in refs:
                    tg.start_soon(write, ref)
        except BaseExceptionGroup as group:  # a bug, not a store fault: raise it as itself
            raise _first_error(group) from None
        if failed:
            first = next(iter(failed.values()))
            raise SaveError(
                f"{len(failed)} of {len(refs)} chunks could not be written ({len(written)} were, and stay "
                f"stored); first error: {type(first).__name__}: {first}",
                written,
                failed,
            ) from first
        return nbytes


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first error inside (nested) exception groups."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class _Job(NamedTuple):
    """One restore's tokens, chunks and lookup, as both axes take them."""

    tokens: torch.Tensor
    refs: list[ChunkRef]
    stored: list[bool]
    errors: list[str]
    on_event: Callable[[TraceEvent], None] | None
    out: KVCache | None


class _LayerCompute:
    """The compute lane of a layer-axis restore: layers [a, b) over every token of the prefix.

    It keeps the hidden states between units, so a unit continues where the last one stopped. Should a
    unit start above layers that were loaded (after a failed read lower down), it runs through them
    too: only computing gives the hidden states a higher layer needs.
    """

    def __init__(
        self, backend: ComputeBackend, tokens: torch.Tensor, kv: KVCache, stream: torch.cuda.Stream | None
    ) -> None:
        self.backend, self.tokens, self.kv, self.stream = backend, tokens, kv, stream
        self.positions = torch.arange(len(tokens))
        self.hidden: torch.Tensor | None = None
        self.layer = 0

    def __call__(self, a: int, b: int) -> None:
        n = len(self.tokens)
        with on_stream(self.stream):
            if self.hidden is None:
                self.hidden = self.backend.embed(self.tokens)
            for layer in range(self.layer, b):
                self.hidden, k, v = self.backend.run_layer(layer, self.hidden, None, None, self.positions)
                self.kv.data[layer, 0, :, :n].copy_(k)
                self.kv.data[layer, 1, :, :n].copy_(v)
            self.layer = b
        if self.stream is not None:
            self.stream.synchronize()


class SyncRestorer:
    """The same Restorer for callers without an event loop.

    Every call runs on one private event loop in a background thread (an anyio blocking portal), so
    stores that hold connections bound to a loop (s3fs) keep working across calls.
    """

    def __init__(
        self, backend: ComputeBackend, store: ChunkStore, chunk_size: int = DEFAULT_CHUNK_SIZE, **kwargs: Any
    ):
        self.restorer = Restorer(backend, store, chunk_size, **kwargs)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._portal.call(lambda: fn(*args, **kwargs))

    def save(self, token_ids: TokenIds, kv: KVCache | None = None) -> SaveStats:
        return self._call(self.restorer.save, token_ids, kv)

    def lookup(self, token_ids: TokenIds) -> int:
        return self._call(self.restorer.lookup, token_ids)

    def restore(
        self,
        token_ids: TokenIds,
        policy: Policy | None = None,
        on_event: Any = None,
        out: KVCache | None = None,
    ) -> RestoreResult:
        return self._call(self.restorer.restore, token_ids, policy, on_event, out)

    def close(self) -> None:
        if self._portal_cm is not None:
            try:
                self._call(self.restorer.close)
            finally:
                self._portal_cm.__exit__(None, None, None)
                self._portal_cm = None

    def __enter__(self) -> SyncRestorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
