"""One restore or save from start to end: look the chunks up, plan, run along tokens or layers, learn.

The facade (`Restorer`) checks its arguments and chunks the prompt; everything after that is here, so
`save` (which restores what it does not have KV for) and `restore` share one path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvrestore.chunkio.save import SaveStats, write_chunks
from kvrestore.core.errors import LOAD_FAULTS, InvalidInputError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache, buffer_problem
from kvrestore.core.spec import ModelSpec
from kvrestore.core.trace import TraceEvent
from kvrestore.planning.auto import Auto
from kvrestore.policies import Blend, ComputeOnly, LoadOnly, Policy, TokenTwoPointer
from kvrestore.restore.layer_wise import restore_layers
from kvrestore.restore.results import Job, Parts, RestoreResult, Units
from kvrestore.restore.token_wise import restore_tokens

log = logging.getLogger("kvrestore.restorer")


def check_policy(policy: object) -> Policy | Auto | None:
    """`policy` if `restore` can run it (a `Policy`, the `Auto` planner, or None), else InvalidInputError."""
    if policy is None or isinstance(policy, (Policy, Auto)):
        return policy
    hint = " (a Blend goes to restore_blend)" if isinstance(policy, Blend) else ""
    raise InvalidInputError(f"policy must be a Policy such as TokenTwoPointer(), got {policy!r}{hint}")


def check_kv(spec: ModelSpec, name: str, kv: object, n_tokens: int, in_place: bool = False) -> KVCache:
    """`kv` if it is a KVCache of this model with room for `n_tokens` (and, `in_place`, a buffer a restore
    can write as it lies: `buffer_problem`), else InvalidInputError."""
    if not isinstance(kv, KVCache):
        raise InvalidInputError(
            f"{name} must be a KVCache (e.g. KVCache.empty(restorer.spec, n_tokens)), got {type(kv).__name__}"
        )
    problem = buffer_problem(spec, kv.data) if in_place else None
    if problem is not None:
        raise InvalidInputError(f"{name} cannot be restored into: {problem}")
    if not kv.fits(spec, n_tokens):
        raise InvalidInputError(
            f"{name} ({kv.n_tokens} tokens of {kv.spec.name}, {kv.data.dtype}) cannot hold {n_tokens} "
            f"tokens of {spec.name} ({spec.dtype})"
        )
    return kv


async def run_axis(parts: Parts, job: Job, policy: Policy) -> RestoreResult:
    """Run `policy` along its axis: layers or tokens."""
    if policy.axis == "layers":
        return await restore_layers(parts, job, policy)
    return await restore_tokens(parts, job, policy)


async def restore(
    parts: Parts,
    tokens: torch.Tensor,
    refs: list[ChunkRef],
    policy: Policy | Auto | None,
    on_event: Callable[[TraceEvent], None] | None,
    out: KVCache | None,
    started: float | None = None,
) -> RestoreResult:
    """`Restorer.restore` for checked tokens and their chunks (see there). Its `stats.seconds` is the
    whole call's wall time from `started` (`time.perf_counter()`; default now), the lookup and the
    planning included: what the caller waited."""
    t0 = time.perf_counter() if started is None else started
    errors: list[str] = []
    try:
        stored = await parts.store.contains([r.key for r in refs])
    except LOAD_FAULTS as exc:  # the store is down: a restore still finishes, by computing
        stored = [False] * len(refs)
        errors.append(f"lookup: {type(exc).__name__}: {exc}")
        log.warning(
            "store lookup failed (%s: %s): computing all %d tokens", type(exc).__name__, exc, len(tokens)
        )
    planner = parts.planner
    chosen = policy or (Auto() if parts.engine.plans_by_default else TokenTwoPointer())
    units = Units.of(refs, stored)  # short chunks are planned and run in units that pay their cost
    plan = None
    if isinstance(chosen, Auto) and chosen.candidates is None and units.members is not None:
        # a layer read is one read per chunk, however short: units of short chunks are token-wise only
        chosen = Auto([ComputeOnly(), LoadOnly(), TokenTwoPointer()])
    if isinstance(chosen, Auto):
        plan = planner.plan(units.refs, units.stored, chosen)
        chosen = plan.choice
        if log.isEnabledFor(logging.DEBUG):  # explain() works out L_delta: dozens of simulations
            log.debug("restore of %d tokens: %s", len(tokens), plan.explain())
    judged = planner.judged(chosen, plan, units.stored)
    job = Job(tokens, units.refs, units.stored, errors, on_event, out, units.members)
    result = await run_axis(parts, job, chosen)
    result.stats.seconds = time.perf_counter() - t0
    if result.stats.failed_loads:
        log.warning(
            "%d of %d stored chunks (or layer reads) could not be used and were computed instead: %s",
            result.stats.failed_loads,
            result.stats.hit_chunks,
            result.stats.errors[-1],
        )
    planner.calibrate(
        chosen, judged, units.refs, units.stored, result.stats.seconds, clean=not result.stats.errors
    )
    await planner.keep()
    result.plan = plan
    result.stats.seconds = time.perf_counter() - t0
    return result


async def save(
    parts: Parts, tokens: torch.Tensor, refs: list[ChunkRef], kv: KVCache | None, compression: str
) -> SaveStats:
    """`Restorer.save` for checked tokens and their chunks (see there)."""
    t0 = time.perf_counter()
    present = await parts.store.contains([r.key for r in refs])
    todo = [r for r, ok in zip(refs, present, strict=True) if not ok]
    written = 0
    if todo:
        if kv is None:
            policy = LoadOnly() if any(present) else ComputeOnly()
            result = await restore_tokens(parts, Job(tokens, refs, present, [], None, None), policy)
            kv = result.kv
            failed = {e.first_chunk for e in result.trace.of_kind("load-failed")}
            todo = [r for r, ok in zip(refs, present, strict=True) if not ok or r.index in failed]
        spec = parts.backend.spec
        lanes, encoding = parts.engine.load_lanes, parts.loader.encoding.name  # what it reads, it writes
        seal = parts.loader.seal  # what it checks, it signs
        written = await write_chunks(parts.store, spec, kv, todo, lanes, compression, encoding, seal)
    return SaveStats(len(refs), len(todo), len(refs) - len(todo), written, time.perf_counter() - t0)
