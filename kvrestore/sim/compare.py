"""Comparing batch schedulers on a workload, and the bounds to judge them by.

`compare_schedulers` runs one workload three ways on the same simulated machine (independent restores,
`FifoLanes`, `BatchAware`); `batch_lower_bound` is the makespan no schedule can beat and
`balance_bytes_per_s` the link speed at which loading and computing a workload's restores take as long.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrestore.core.bandwidth import BandwidthTrace, Link
from kvrestore.core.errors import InvalidInputError
from kvrestore.costs.compute import ChunkCost
from kvrestore.policies.batch import BatchAware, FifoLanes
from kvrestore.policies.compute_only import ComputeOnly
from kvrestore.policies.meeting import TokenTwoPointer
from kvrestore.sim.batch import BatchSimResult, sim_requests, simulate_batch, simulate_independent
from kvrestore.sim.workload import Request


def batch_lower_bound(
    workload: Sequence[Request], cost: ChunkCost, kv_bytes_per_token: int, chunk_size: int, bytes_per_s: float
) -> float:
    """Seconds before which no schedule can finish all of `workload` (taken as arriving at once) on one
    compute lane priced by `cost` and one link of `bytes_per_s`.

    Every stored chunk is either computed or loaded, every other chunk computed; the lane and the link
    each do one thing at a time, so the makespan is at least the smaller of max(compute, load) over all
    such splits. Relaxed to stay a bound whatever the units: no per-call cost, each chunk priced at what
    any unit containing it must spend on it at least (attention to the past at min(past, own-length)
    rate), no order between chunks, and a chunk may be split between lane and link. The best split loads
    the chunks that save the most compute per byte.
    """
    if bytes_per_s <= 0:
        raise InvalidInputError(f"bytes_per_s must be positive, got {bytes_per_s}")
    floor = ChunkCost(0.0, cost.per_token_s, min(cost.per_token_past_s, cost.per_token2_s), cost.per_token2_s)
    compute, loadable = 0.0, []
    for r in sim_requests(workload, floor, kv_bytes_per_token, chunk_size, ComputeOnly):
        for c, nbytes, stored in zip(r.chunk_cost, r.chunk_bytes, r.stored, strict=True):
            compute += c
            if stored:
                loadable.append((c, nbytes / bytes_per_s))
    load = 0.0
    for c, t in sorted(loadable, key=lambda x: -x[0] / x[1]):
        if compute - c <= load + t:  # the balance falls inside this chunk
            return load + (compute - load) / (c + t) * t
        compute -= c
        load += t
    return compute


#: the three ways `compare_schedulers` runs a workload
CASES = ("independent", "fifo", "batch-aware")


def compare_schedulers(
    workload: Sequence[Request],
    cost: ChunkCost,
    kv_bytes_per_token: int,
    bytes_per_s: float,
    *,
    chunk_size: int = 256,
    load_lanes: int = 4,
    token_budget: int = 512,
    latency_s: float = 0.001,
) -> dict[str, BatchSimResult]:
    """`workload` three ways on the same simulated machine: independent restores (a plain `Engine`),
    `FifoLanes` and `BatchAware`, each request with its own token-wise two-pointer."""
    out = {}
    for case in CASES:
        requests = sim_requests(workload, cost, kv_bytes_per_token, chunk_size, TokenTwoPointer)
        link = Link(BandwidthTrace.constant(bytes_per_s), latency_s)
        if case == "independent":
            out[case] = simulate_independent(requests, link, load_lanes)
        else:
            scheduler = FifoLanes(token_budget) if case == "fifo" else BatchAware(token_budget)
            out[case] = simulate_batch(scheduler, requests, link, load_lanes)
    return out


def balance_bytes_per_s(
    workload: Sequence[Request], cost: ChunkCost, kv_bytes_per_token: int, chunk_size: int = 256
) -> float:
    """The link speed at which loading the workload's stored chunks takes as long as computing its
    restores from scratch (its restores' stored bytes over their compute-only time)."""
    requests = [
        r
        for r in sim_requests(workload, cost, kv_bytes_per_token, chunk_size, ComputeOnly)
        if r.kind == "restore"
    ]
    compute = sum(r.compute_cost(0, len(r.chunk_tokens)) for r in requests)
    stored = sum(b for r in requests for b, s in zip(r.chunk_bytes, r.stored, strict=True) if s)
    if compute <= 0 or stored <= 0:
        raise InvalidInputError("the workload has no stored chunk to restore")
    return stored / compute
