"""The pipelined split of a prompt's stored prefix: how many stored tokens to load while the rest is
computed, when both run layer by layer (vLLM's connector; a simulator predicting one of its steps).

An engine computes a request's tokens [k, n) while [0, k) loads layer by layer, so loading layer l+1
overlaps computing layer l. Loading k tokens costs a round trip per layer plus the bytes of every chunk
that overlaps [0, k) over the link; computing n - k tokens after a past of k costs
`ChunkCost.seconds(n - k, k)`. With the two pipelined over L layers, a split finishes after about
``max(load + compute / L, compute + load / L)``: the slower of the two plus one layer of the other.
`choose_split` picks the k (block- and chunk-aligned, at most the stored prefix and n - 1) that
minimises it. Its compute also shares the host with the load's reads, checks and page writes: `loading`
(how much slower such steps computed than the model says: `costs.learned.loading_factor`) scales the
compute of every split that loads.

Many requests at once (CacheFlow's batch rule, §3.3). A split is not planned as if the link were free:
the bytes of the loads already queued on the link and not finished (`bytes_ahead`) are served before
this load's, so a request arriving while others load loads less and computes more than on a free link.
Among loads that have not started, the link then serves the one that saves the most compute per byte
first (`policies.batch.link_order`); a split never counts on jumping that queue (the loads before it
were planned on the bytes ahead of them, and were promised their place).

Only the link is a queue. A request's compute is its own: CacheFlow's Algorithm 1 advances every
request's compute pointer in every step (line 11: "for each r in R: recompute"), and grants only the
I/O to a chosen few (line 7); vLLM does the same, computing the new tokens of all the step's requests
in one batched forward pass, not one request's after another's. Another request's compute therefore
does not wait in front of this one's the way its bytes wait in front of this load's: it makes the
shared steps longer for both lanes of both requests (their loads are pipelined against those steps
too), which the compute costs learned from the server's own steps and `loading` see on average, not
a head start for the link. Counting it as compute owed ahead (an earlier version did) moved both lanes
alike when the requests look alike, and so rarely changed a split. The cost of this reading: where
compute is a throughput the step's requests share (a CPU) and the link is fast, the last request
planned behind queued bytes computes more than it should (`docs/benchmarks.md`, serving_batch at 2x).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrestore.core.errors import InvalidInputError
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.links import LinkCost
from kvrestore.policies.batch import QueuedLoad

SPLITS = ("planned", "load_all", "compute_all")


@dataclass(frozen=True)
class SplitChoice:
    """How many prompt tokens to load (`k`) and what that was predicted to cost."""

    k: int
    n_tokens: int
    stored_tokens: int  # the longest stored prefix (whole chunks)
    loadable_tokens: int  # the most that could be loaded (whole blocks, leaving a token to compute)
    predicted_s: float | None  # None: no measured costs to predict with
    load_s: float | None
    compute_s: float | None
    load_all_s: float | None  # the prediction for the largest k
    compute_all_s: float | None  # and for k = 0
    reason: str
    nbytes: float = 0.0  # bytes the load reads (whole chunks)
    saved_s: float = 0.0  # compute the load saves (0 where the costs are not known)
    bytes_ahead: float = 0.0  # bytes the link serves before this load

    def queued(self, key: str) -> QueuedLoad | None:
        """This split's load as it waits on the link (None: it loads nothing)."""
        return QueuedLoad(key, self.nbytes, self.saved_s) if self.k > 0 else None

    def fields(self) -> dict[str, Any]:
        """The choice as a record (`vllm_stats.emit`): tokens, predictions in seconds, the reason."""
        return {
            "k": self.k,
            "n_tokens": self.n_tokens,
            "stored_tokens": self.stored_tokens,
            "loadable_tokens": self.loadable_tokens,
            "predicted_s": self.predicted_s,
            "load_s": self.load_s,
            "compute_s": self.compute_s,
            "load_all_s": self.load_all_s,
            "compute_all_s": self.compute_all_s,
            "bytes_ahead": self.bytes_ahead,
            "reason": self.reason,
        }

    def explain(self) -> str:
        if self.predicted_s is None:
            return f"load {self.k} of {self.n_tokens} tokens ({self.reason})"
        ahead = f", {self.bytes_ahead / 1e6:.1f} MB queued ahead" if self.bytes_ahead else ""
        return (
            f"load {self.k} of {self.n_tokens} tokens, compute {self.n_tokens - self.k}: predicted "
            f"{self.predicted_s:.3f} s (load {self.load_s:.3f} s, compute {self.compute_s:.3f} s; "
            f"load-all {self.load_all_s:.3f} s, compute-all {self.compute_all_s:.3f} s{ahead}; {self.reason})"
        )


def max_loadable(n_tokens: int, stored_tokens: int, block_size: int) -> int:
    """The most tokens an engine can take from the store: within the stored prefix, leaving at least
    one prompt token to compute (it needs its logits), whole blocks."""
    return max(0, min(stored_tokens, n_tokens - 1)) // block_size * block_size


def loaded_tokens_read(k: int, chunk_ends: Sequence[int]) -> int:
    """Tokens whose bytes are read to load [0, k): every chunk that overlaps [0, k), whole."""
    for end in chunk_ends:
        if end >= k:
            return end if k > 0 else 0
    return chunk_ends[-1] if chunk_ends and k > 0 else 0


def choose_split(
    *,
    n_tokens: int,
    chunk_ends: Sequence[int],
    chunk_size: int,
    block_size: int,
    bytes_per_token: float,
    num_layers: int,
    link: LinkCost | None,
    compute: ChunkCost | None,
    loading: float | None = None,
    mode: str = "planned",
    bytes_ahead: float = 0.0,
) -> SplitChoice:
    """The split for a prompt of `n_tokens` whose leading stored chunks end at `chunk_ends`. A split that
    loads computes its suffix `loading` times slower than alone (`loading_factor`; 1 if not known).
    `bytes_ahead` is what the link serves before this request's load (loads queued on it, not finished:
    the module docstring); 0, the link is free."""
    if mode not in SPLITS:
        raise InvalidInputError(f"split must be one of {SPLITS}, got {mode!r}")
    if not (math.isfinite(bytes_ahead) and bytes_ahead >= 0):
        raise InvalidInputError(f"bytes_ahead must be a finite number >= 0, got {bytes_ahead!r}")
    stored = chunk_ends[-1] if chunk_ends else 0
    kmax = max_loadable(n_tokens, stored, block_size)
    step = math.lcm(chunk_size, block_size)
    candidates = sorted({0, kmax, *range(step, kmax, step)})

    def nbytes(k: int) -> float:
        return loaded_tokens_read(k, chunk_ends) * bytes_per_token

    def predict(k: int) -> tuple[float, float, float, float]:
        """(finish, load seconds, compute seconds, compute saved) of loading k tokens."""
        assert link is not None and compute is not None
        alone = compute.seconds(n_tokens, 0)
        c = compute.seconds(n_tokens - k, k)
        if k == 0:
            return c, 0.0, c, 0.0
        saved = max(0.0, alone - c)
        c *= loading or 1.0
        # headers, then a round per layer, after the bytes the link serves first
        ld = (num_layers + 1) * link.latency_s + (bytes_ahead + nbytes(k)) / link.bytes_per_s
        return max(ld + c / num_layers, c + ld / num_layers), ld, c, saved

    known = link is not None and compute is not None
    if mode == "compute_all" or kmax == 0:
        k, reason = 0, "split=compute_all" if mode == "compute_all" else "nothing loadable is stored"
    elif mode == "load_all":
        k, reason = kmax, "split=load_all"
    elif not known:
        missing = " and ".join(w for w, v in (("the link", link), ("compute", compute)) if v is None)
        k, reason = kmax, f"no measured cost of {missing} yet: loading every stored token"
    else:
        k = min(candidates, key=lambda c: (predict(c)[0], -c))
        reason = "planned: the load and the compute finish together"
    if not known:
        return SplitChoice(k, n_tokens, stored, kmax, None, None, None, None, None, reason, nbytes(k))
    total, ld, c, saved = predict(k)
    load_all, compute_all = predict(kmax)[0], predict(0)[0]
    return SplitChoice(
        k, n_tokens, stored, kmax, total, ld, c, load_all, compute_all, reason, nbytes(k), saved, bytes_ahead
    )


__all__ = ["SPLITS", "SplitChoice", "choose_split", "loaded_tokens_read", "max_loadable"]
