"""A restore along tokens: the engine runs `policy` over the prompt's chunks, computing some and
loading others at the same time (CacheFlow's token-wise two-pointer, or one resource alone)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvrestore.chunkio.load import Fetched
from kvrestore.chunkio.read import AllFetched, fetch_chunks_sync, load_chunks, load_chunks_aside
from kvrestore.chunkio.stored import forget
from kvrestore.costs.estimates import Priors
from kvrestore.policies import LaneTraits, Policy, Progress
from kvrestore.restore.compute import prefill_apart, prefill_into
from kvrestore.restore.results import Job, Parts, RestoreResult, RestoreStats
from kvrestore.runtime.request import FastPaths


async def restore_tokens(parts: Parts, job: Job, policy: Policy) -> RestoreResult:
    """`Restorer.restore` for tokens already chunked and looked up (a save has done both before it
    needs KV). Every load fault fails its chunk only (its unit, with `job.members`), which is computed
    instead. The trace counts units; the stats count the store's chunks."""
    tokens, refs, stored, errors, on_event, out, members = job
    chunks = members if members is not None else [[r] for r in refs]  # the stored chunks of each unit
    engine, backend, loader = parts.engine, parts.backend, parts.loader
    t0 = time.perf_counter()
    kv = parts.buffer(out, len(tokens))
    prior_compute_s, prior_link = parts.planner.priors(refs)
    priors = Priors(prior_compute_s, prior_link, parts.planner.unit_fixed_s(), parts.planner.floors(refs))
    progress = Progress(
        [r.n_tokens for r in refs], list(stored), lanes=LaneTraits(parts.planner.min_unit_chunks())
    )

    def compute(a: int, b: int) -> None:
        prefill_into(engine, backend, kv, tokens, refs[a].start, refs[b - 1].end)

    def compute_apart(a: int, b: int) -> Callable[[], None]:
        return prefill_apart(engine, backend, kv, tokens, refs[a].start, refs[b - 1].end)

    async def load(i: int) -> int:
        return await load_chunks(loader, chunks[i], kv)

    async def load_aside(i: int) -> tuple[int, Callable[[], None]]:
        return await load_chunks_aside(loader, chunks[i], kv)

    damaged: list[str] = []  # found damaged on a lane thread: deleted once the restore is over

    def fetch_sync(
        i: int,
    ) -> Fetched | AllFetched:  # on a load-lane thread, for a store read without the loop
        return fetch_chunks_sync(loader, chunks[i], kv, damaged)

    meter, bytes_per_token = parts.store.delivered_bytes, parts.planner.stored_bytes_per_token

    def tokens_delivered() -> float | None:  # tokens' worth of bytes the store has delivered
        nbytes = meter()
        return None if nbytes is None else nbytes / bytes_per_token

    delivered = None if meter() is None else tokens_delivered  # a store that cannot say is not asked

    try:
        fast = FastPaths(fetch_sync if parts.store.reads_sync else None, compute_apart, load_aside)
        fast_paths = fast if engine.takes_fast_paths else None
        request = parts.request(
            progress,
            policy,
            compute,
            load,
            on_event=on_event,
            fast_paths=fast_paths,
            delivered=delivered,
            priors=priors,
        )
        trace = await engine.run(request)
    finally:
        for key in damaged:
            await forget(parts.store, key)
    failed = trace.of_kind("load-failed")

    def n_chunks(units: Iterable[int]) -> int:  # the stored chunks in these units
        return sum(len(chunks[i]) for i in units)

    stats = RestoreStats(
        policy=policy.name,
        n_tokens=len(tokens),
        n_chunks=n_chunks(range(len(refs))),
        hit_chunks=n_chunks(i for i, ok in enumerate(stored) if ok),
        computed_chunks=n_chunks(trace.computed()),
        loaded_chunks=n_chunks(trace.loaded()),
        failed_loads=len(failed),
        bytes_loaded=trace.bytes_loaded(),
        seconds=time.perf_counter() - t0,
        errors=errors + [f"chunk {chunks[e.first_chunk][0].index}: {e.error}" for e in failed],
    )
    parts.planner.learn(trace, refs)
    return RestoreResult(kv, stats, trace)
