"""One stage of a stage-parallel restore: its layers' KV for a whole prompt, at the same time as the others.

Every rank of a process group runs a `StageRestorer` over the same store (or its own link to it). Rank 0
looks up which chunks and boundary activations are stored and broadcasts that plan (`StagePlan`); then each
stage restores its shard with the engine and a two-pointer policy (`TokenTwoPointer` by default) against
its own compute lane and store link: it loads its layers' sections of stored chunks from the back and
computes chunks from the front, starting each computed chunk from its boundary activation (stage 0: from
the token embedding). A chunk without an activation is computed in the sequential pipeline: the stage
before computes it too and sends its output (`Pipe`). At the end the ranks exchange their outcome, so a
failure anywhere (a rank that died, a stage without its input, a bug) is a `StageFailedError` on every rank
within the group's timeout. A chunk whose KV cannot be loaded is computed instead, as in `Restorer`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch
import torch.distributed as dist

from kvrestore import codec
from kvrestore.backends.base import ComputeBackend
from kvrestore.core.errors import InvalidInputError, MissingChunkError, StageFailedError, StoreError
from kvrestore.core.keys import DEFAULT_CHUNK_SIZE, ChunkRef
from kvrestore.core.settings import check_instance, check_number
from kvrestore.core.spec import ModelSpec
from kvrestore.core.trace import Trace
from kvrestore.distributed.boundaries import BoundaryReader
from kvrestore.distributed.layout import StageLayout
from kvrestore.distributed.pipe import Pipe, global_rank, started, world
from kvrestore.distributed.plan import StagePlan
from kvrestore.distributed.stage_backend import StageBackend
from kvrestore.policies import LoadOnly, Policy, Progress, TokenTwoPointer
from kvrestore.restorer import Restorer
from kvrestore.runtime.engine import _single
from kvrestore.runtime.request import RunRequest
from kvrestore.stores.base import ChunkStore

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("kvrestore.distributed")


@dataclass
class StageStats:
    stage: int
    layers: tuple[int, int]
    n_tokens: int
    n_chunks: int
    computed_chunks: int
    loaded_chunks: int
    failed_loads: int
    pipelined_chunks: int  # computed in the sequential pipeline (no boundary activation here or next)
    bytes_loaded: int  # KV sections (and headers) read
    boundary_bytes: int  # boundary activations read
    seconds: float
    errors: list[str] = field(default_factory=list)


@dataclass
class StageResult:
    """This stage's shard of the restored KV: layers [start, end) of every token, [n, 2, H, N, D]."""

    stage: int
    layers: tuple[int, int]
    shard: torch.Tensor
    stats: StageStats
    trace: Trace
    plan: StagePlan


class StageRestorer:
    """The restorer of one pipeline stage; construct one on every rank of `group` (rank = stage index).

    `layout` says which layers each stage owns (`StageLayout.even(num_layers, world_size)`); the backend
    computes only this stage's layers (`StageBackend`). `timeout_s` bounds every wait on another rank (the
    group's own timeout bounds its collectives: `spawn` and `init_stages` set both).
    """

    def __init__(
        self,
        backend: ComputeBackend,
        store: ChunkStore,
        layout: StageLayout,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        group: dist.ProcessGroup | None = None,
        load_lanes: int = 4,
        load_timeout_s: float | None = 30.0,
        timeout_s: float = 60.0,
        namespace: str | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        """`namespace` and `secret` are a `Restorer`'s: whose chunks, and the key that signs them."""
        check_instance("layout", layout, StageLayout, "a StageLayout")
        timeout_s = check_number("timeout_s", timeout_s, positive=True)
        if not dist.is_initialized():
            raise InvalidInputError(
                "torch.distributed is not initialised: use kvrestore.distributed.spawn or torchrun"
            )
        self.group = group if group is not None else world()
        self.stage = dist.get_rank(self.group)
        if self.stage < 0:
            raise InvalidInputError("this process is not a member of the group")
        n = dist.get_world_size(self.group)
        if layout.n_stages != n:
            raise InvalidInputError(f"the layout has {layout.n_stages} stages for a group of {n} ranks")
        self.restorer = Restorer(
            backend,
            store,
            chunk_size,
            load_lanes=load_lanes,
            load_timeout_s=load_timeout_s,
            namespace=namespace,
            secret=secret,
        )
        self.layout = layout.check(self.restorer.spec.num_layers)
        self.stage_backend = StageBackend(backend, *layout.stages[self.stage])
        self.store, self.timeout_s = store, timeout_s
        self.engine = self.restorer.engine
        self.restores = 0  # restores begun: every rank counts the same (they call `restore` together)

    @property
    def spec(self):  # noqa: ANN201 - ModelSpec
        return self.restorer.spec

    async def restore(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        policy: Policy | None = None,
        *,
        sequential: bool = False,
    ) -> StageResult:
        """Restore this stage's layers for `token_ids`; every rank calls it with the same tokens.

        `sequential=True` runs the stages one after another (stage s starts once stage s-1 has finished):
        the sequential pipeline of the same stages, for comparison. Raises `StageFailedError` on every rank
        if the restore failed on any.
        """
        policy = policy or TokenTwoPointer()
        if policy.axis != "tokens":
            raise InvalidInputError(f"a stage restores along tokens; {policy!r} works along {policy.axis}")
        tokens, refs = self.restorer.chunks(token_ids)
        plan = await self._agree(refs)
        sb = self.stage_backend
        pipe = Pipe(
            self.group,
            self.stage,
            self.layout.n_stages,
            sb.hidden_size,
            self.spec.dtype,
            self.timeout_s,
            self.restores,
        )
        self.restores += 1
        error: BaseException | None = None
        result: StageResult | None = None
        try:
            if sequential:
                await anyio.to_thread.run_sync(pipe.wait_go)
            result = await self._run(plan, tokens, refs, pipe, policy)
            if sequential:
                pipe.go()
            await anyio.to_thread.run_sync(pipe.flush)
        except Exception as exc:  # any failure here fails the restore on every rank: tell them
            error = exc
            log.error("stage %d failed: %s: %s", self.stage, type(exc).__name__, exc)
            pipe.poison([c for c, s in enumerate(plan.sends(self.stage)) if s])
            if sequential:
                pipe.fail_go()
        status = None if error is None else f"{type(error).__name__}: {error}"
        statuses = await anyio.to_thread.run_sync(self._all_gather, status)
        failures = {r: s for r, s in enumerate(statuses) if s is not None}
        if failures:
            first = min(failures)
            raise StageFailedError(
                f"stage-parallel restore failed on stage(s) {sorted(failures)}; stage {first}: {failures[first]}",
                failures,
            ) from error
        assert result is not None
        return result

    # -- agreeing on the plan --------------------------------------------------------------------

    async def _agree(self, refs: list[ChunkRef]) -> StagePlan:
        plan: StagePlan | None = None
        if self.stage == 0:
            try:
                plan = await self._plan(refs)
            except (StoreError, OSError, TimeoutError) as exc:  # nothing known to be stored: all computed
                log.warning("store lookup failed, computing everything: %s: %s", type(exc).__name__, exc)
                none = [False] * len(refs)
                plan = StagePlan.make(self.layout, none, [none] * (self.layout.n_stages - 1))
        box = [plan]
        await anyio.to_thread.run_sync(
            self._collective, dist.broadcast_object_list, box, "agreeing on the plan"
        )
        plan = box[0]
        assert isinstance(plan, StagePlan)
        if plan.n_chunks != len(refs):
            raise StageFailedError(
                f"stage 0 planned {plan.n_chunks} chunks, stage {self.stage} has {len(refs)}"
            )
        return plan

    async def _plan(self, refs: list[ChunkRef]) -> StagePlan:
        kv_stored = await self.store.contains([r.key for r in refs])
        present = [
            await self.store.contains([codec.boundary_key(r.key, b) for r in refs])
            for b in self.layout.boundaries
        ]
        plan = StagePlan.make(self.layout, kv_stored, present)
        for s in range(1, self.layout.n_stages):
            if any(plan.missing[s]):
                log.info("stage %d lacks %d boundary activations: pipelined", s, sum(plan.missing[s]))
        return plan

    def _collective(self, fn, obj, what: str) -> None:  # noqa: ANN001
        try:
            if fn is dist.broadcast_object_list:
                fn(obj, src=global_rank(self.group, 0), group=self.group)
            else:
                fn(*obj, group=self.group)
        except RuntimeError as exc:  # a rank gone, or the group's timeout
            raise StageFailedError(f"stage {self.stage}: {what}: {exc}", {self.stage: str(exc)}) from exc

    def _all_gather(self, status: str | None) -> list[str | None]:
        out: list[str | None] = [None] * self.layout.n_stages
        self._collective(dist.all_gather_object, (out, status), "exchanging outcomes")
        return out

    # -- the stage's restore ---------------------------------------------------------------------

    async def _run(
        self, plan: StagePlan, tokens: torch.Tensor, refs: list[ChunkRef], pipe: Pipe, policy: Policy
    ) -> StageResult:
        t0 = time.perf_counter()
        s, sb = self.stage, self.stage_backend
        shard = sb.empty_shard(len(tokens))
        receives, sends = plan.receives(s), plan.sends(s)
        reader = BoundaryReader(
            self.store,
            self.spec,
            refs,
            sb.start,
            sb.hidden_size,
            plan.wants_boundary(s),
            sb.device,
            self.restorer.loader.seal,
        )

        def compute(a: int, b: int) -> None:  # on the compute lane's thread
            if s == 0:
                hidden = sb.input_of(tokens[refs[a].start : refs[b - 1].end])
            else:
                parts = [
                    pipe.recv(c, refs[c].n_tokens, sb.device)
                    if receives[c]
                    else anyio.from_thread.run(reader.get, c)
                    for c in range(a, b)
                ]
                hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            out = sb.forward_into(hidden, shard, refs[a].start)
            for c in range(a, b):
                if sends[c]:
                    pipe.send(c, out[:, refs[c].start - refs[a].start : refs[c].end - refs[a].start])

        async def load(i: int) -> int:
            return await self._load_layers(refs[i], shard)

        progress = Progress([r.n_tokens for r in refs], plan.stored(s))
        try:
            async with anyio.create_task_group() as tg:
                reader.tg = tg
                if not isinstance(policy, LoadOnly):  # it computes only failed loads: fetched on demand
                    reader.start(tg)  # before the first KV load asks the link for anything
                    await anyio.lowlevel.checkpoint()  # let the requests reach the link first
                request = RunRequest(progress, policy, compute, load, None, self.restorer.load_timeout_s)
                trace = await self.engine.run(request)
                tg.cancel_scope.cancel()  # boundary prefetches nobody will use
        except BaseExceptionGroup as group:  # a unit's own error (a stage without its input), as itself
            raise _single(group) from None
        failed = trace.of_kind("load-failed")
        for e in failed:
            log.warning(
                "stage %d: chunk %d could not be loaded, computed instead: %s", s, e.first_chunk, e.error
            )
        stats = StageStats(
            stage=s,
            layers=(sb.start, sb.end),
            n_tokens=len(tokens),
            n_chunks=len(refs),
            computed_chunks=sum(e.last_chunk - e.first_chunk + 1 for e in trace.of_kind("compute")),
            loaded_chunks=len(trace.of_kind("load")),
            failed_loads=len(failed),
            pipelined_chunks=sum(plan.pipelined(s)),
            bytes_loaded=trace.bytes_loaded(),
            boundary_bytes=reader.bytes_read,
            seconds=time.perf_counter() - t0,
            errors=[f"chunk {e.first_chunk}: {e.error}" for e in failed],
        )
        return StageResult(s, (sb.start, sb.end), shard, stats, trace, plan)

    async def _load_layers(self, ref: ChunkRef, shard: torch.Tensor) -> int:
        """Read this stage's sections of one chunk (a header probe, then one range read) into the shard."""
        a, b = self.stage_backend.start, self.stage_backend.end
        head = await self._get(ref.key, 0, codec.HEADER_PROBE, exact=False)  # a small object ends sooner
        if len(head) >= codec.PREFIX_SIZE and codec.header_length(head) > len(head):
            head = await self._get(ref.key, 0, codec.header_length(head))
        header, _ = codec.read_header(head)
        codec.check_header(
            header, self.spec, ref.key, ref.start, ref.n_tokens, seal=self.restorer.loader.seal
        )
        lo, hi = header.layers[a].offset, header.layers[b - 1].offset + header.layers[b - 1].length
        body = await self._get(ref.key, lo, hi)
        mv = memoryview(body)
        sections = {
            i: mv[header.layers[i].offset - lo : header.layers[i].offset - lo + header.layers[i].length]
            for i in range(a, b)
        }
        dest = shard[:, :, :, ref.start : ref.end]

        def place() -> None:
            seal = self.restorer.loader.seal  # signed: every section's tag checked before it is placed
            if dest.device.type == "cpu":
                codec.decode_layers(header, sections, self.spec, range(a, b), out=dest, seal=seal)
            else:
                dest.copy_(codec.decode_layers(header, sections, self.spec, range(a, b), seal=seal))

        await anyio.to_thread.run_sync(place)
        return len(head) + len(body)

    async def _get(self, key: str, start: int, end: int, exact: bool = True) -> bytes:
        data = await self.store.get_range(key, start, end)
        if data is None:
            raise MissingChunkError(f"chunk {key[:12]} is not in the store")
        if exact and len(data) < end - start:
            raise MissingChunkError(f"chunk {key[:12]}: {len(data)} of {end - start} bytes")
        return data


def gather_kv(
    result: StageResult,
    spec: ModelSpec,
    group: dist.ProcessGroup | None = None,
    dst: int = 0,
    timeout_s: float = 60.0,
):  # noqa: ANN201
    """Every stage's shard in one `KVCache` on stage `dst` (None on the others); every rank calls it.
    The result is an ordinary KVCache: `KVCache.to_hf()` and `HFBackend.generate()` take it."""
    from datetime import timedelta

    from kvrestore.core.kv import KVCache

    group = group if group is not None else world()
    layout, wait = result.plan.layout, timedelta(seconds=timeout_s)
    try:
        if result.stage != dst:
            started(
                dist.isend(
                    result.shard.detach().to("cpu").contiguous(), global_rank(group, dst), group=group, tag=7
                )
            ).wait(wait)
            return None
        kv = KVCache.empty(spec, result.shard.shape[3])
        for s, (a, b) in enumerate(layout.stages):
            if s == dst:
                kv.data[a:b].copy_(result.shard)
            else:
                started(dist.irecv(kv.data[a:b], global_rank(group, s), group=group, tag=7)).wait(wait)
        return kv
    except RuntimeError as exc:
        raise StageFailedError(
            f"stage {result.stage}: gathering the shards: {exc}", {result.stage: str(exc)}
        ) from exc
