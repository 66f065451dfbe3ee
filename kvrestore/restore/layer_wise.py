"""A restore along layers: the stored prefix layer by layer (compute bottom-up, load top-down, as the
policy decides: CacheFlow's layer-wise two-pointer), then the chunks after it computed token-wise.

A layer-axis policy that, by the restorer's costs, would load every layer before the first could be
computed (a store far faster than computing) is handed to the token axis: the whole prompt is stored,
and whole chunks land sooner than the same bytes read layer by layer (one read per chunk, not one per
chunk and layer), so it loads them along tokens. It keeps the promise every two-pointer keeps (never
much slower than loading alone). The restore says so: `stats.axis` is "tokens", `stats.policy` stays
the policy asked for, and `stats.handoff` says why (`WHOLE_CHUNKS`). Where no link is known yet (a
fresh restorer) nothing predicts that, and the restore runs along layers.

A fault on any layer read (missing, damaged or foreign chunk, store error) fails that layer and every
later one, which are computed instead: once a chunk is unusable, no layer read that includes it can be
used.
"""

from __future__ import annotations

import time

import anyio

from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader
from kvrestore.costs.estimates import Priors
from kvrestore.planning.auto import loads_every_layer_first
from kvrestore.policies import ComputeOnly, LoadOnly, Policy, Progress
from kvrestore.restore.compute import LayerCompute, prefill_into
from kvrestore.restore.results import Job, Parts, RestoreResult, RestoreStats
from kvrestore.restore.token_wise import restore_tokens

#: `RestoreStats.handoff` of a layer-axis restore handed to the token axis (see the module docstring)
WHOLE_CHUNKS = (
    "loaded whole chunks along tokens: the loads were predicted to land every layer before the first "
    "layer could be computed, and whole chunks land sooner than per-layer reads"
)


async def restore_layers(parts: Parts, job: Job, policy: Policy) -> RestoreResult:
    """`Restorer.restore` along layers (see the module docstring)."""
    tokens, refs, stored, errors, on_event, out, members = job
    units = members if members is not None else [[r] for r in refs]  # the stored chunks of each unit
    k = stored.index(False) if False in stored else len(stored)
    if k == 0:  # nothing stored: layers have nothing to load
        return await restore_tokens(parts, job, ComputeOnly())
    engine, spec = parts.engine, parts.backend.spec
    n_layers, prefix = spec.num_layers, refs[k - 1].end
    prior_compute_s, prior_link = parts.planner.layer_priors(prefix)
    priors = Priors(prior_compute_s, prior_link, floor_s=parts.planner.layer_floors(prefix))
    progress = Progress([prefix] * n_layers, [True] * n_layers)
    if k == len(refs) and loads_every_layer_first(policy, prefix, n_layers, engine.load_lanes, priors):
        # whole chunks land sooner still (one read each, not one per layer): the prompt goes along tokens
        result = await restore_tokens(parts, job, LoadOnly())
        result.stats.policy, result.stats.handoff = policy.name, WHOLE_CHUNKS
        return result
    t0 = time.perf_counter()
    kv = parts.buffer(out, len(tokens))
    reader = LayerReader(
        spec,
        parts.store,
        [r for unit in units[:k] for r in unit],
        lane=parts.loader.lane(kv.data.device),
        encoding=parts.loader.encoding.name,
        seal=parts.loader.seal,
    )
    compute = LayerCompute(parts.backend, tokens[:prefix], kv, engine.cuda_stream("compute", kv.data.device))
    opening = anyio.Lock()

    async def load(layer: int) -> int:
        async with opening:  # the first read opens every chunk's header
            if not reader.opened:
                await reader.open()
        if reader.unusable:  # a layer read without a chunk would leave its rows unset
            error = reader.errors[-1] if reader.errors else "not in the store"
            raise ChunkLoadFailed(reader.unusable, f"layer reads stopped: {error}")
        return await reader.read_layer(layer, kv)

    trace = await engine.run(parts.request(progress, policy, compute, load, on_event=on_event, priors=priors))
    parts.planner.learn(trace, refs, layers_over=prefix)
    if k < len(refs):  # the chunks after the stored prefix, computed on top of it
        t_tail = time.perf_counter()
        await engine.compute(prefill_into, engine, parts.backend, kv, tokens, prefix, len(tokens))
        parts.planner.learn_compute(len(tokens) - prefix, prefix, time.perf_counter() - t_tail)
    failed = trace.of_kind("load-failed")
    computed_layers = sum(e.last_chunk - e.first_chunk + 1 for e in trace.of_kind("compute"))
    loaded_layers = len(trace.of_kind("load"))
    n_chunks, read = sum(map(len, units)), sum(map(len, units[:k]))  # the store's chunks, those read
    stats = RestoreStats(
        policy=policy.name,
        n_tokens=len(tokens),
        n_chunks=n_chunks,
        hit_chunks=sum(len(unit) for unit, ok in zip(units, stored, strict=True) if ok),
        computed_chunks=n_chunks - read + (read if computed_layers else 0),
        loaded_chunks=read if loaded_layers else 0,
        failed_loads=len(failed),
        bytes_loaded=reader.bytes_read,
        seconds=time.perf_counter() - t0,
        errors=errors + [f"layer {e.first_chunk}: {e.error}" for e in failed],
        axis="layers",
        computed_layers=computed_layers,
        loaded_layers=loaded_layers,
    )
    return RestoreResult(kv, stats, trace)
