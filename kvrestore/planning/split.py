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

Many requests at once (CacheFlow's batch rule, §3.3). A split is not planned as if it had the engine to
itself. vLLM computes the new tokens of every request it schedules in one pass in the same forward
steps, and the connector loads their stored prefixes against those steps, layer by layer: the
requests of one pass share both lanes and get their first tokens when the step ends, once the link
has served every load of the pass and the model has computed every suffix. So a split counts what
both lanes hold before it: the bytes queued on the link and not finished (`bytes_ahead`: loads
planned in this pass, and loads sent and not reported finished) and the compute planned in this pass
for the requests before it (`compute_ahead_s`). Each request then adds its load and its compute where
the step, as planned so far, finishes soonest: behind more loading than computing it computes more,
behind more computing it loads more, and the pass's loads and compute end together. A split planned
as if alone sees its own lanes only: requests that look alike all split alike, and a pass of them
leaves one lane idle while the other works. Among loads that have not started, the link then serves the one that saves the most compute
per byte first (`policies.batch.link_order`); a split never counts on jumping that queue.

A step computes a bounded number of tokens (vLLM's token budget under chunked prefill:
`step_tokens`, what the requests before this one left of it). What a request cannot compute in this
step it computes in the next ones, and those start only when this step ends: once the link has served
every load of the step. So a request whose suffix does not fit gets its first token after the step
and the rest of its compute, and its split weighs both: a load that lengthens the step delays the rest
as much as it saves.

Waiting for the next step (`may_wait`). A request that joins a full step shares its end with every
request of the step, and what does not fit is computed only after the step's loads. The same request
may instead wait for the next step, which starts when this one ends (both lanes served what is
ahead), and split there behind what the requests of this step spill into it (`next_compute_ahead_s`),
with the room that leaves (`next_step_tokens`). It waits where that first token is predicted sooner
by more than `WAIT_MARGIN`: the prediction does not count that the requests of this step end sooner
too, so only a clear win is taken.

Planning a pass (`choose_split_ahead`). An engine asks about its requests one at a time and schedules
each on its answer, so the first split of a pass is planned before the others are known, and the split
best for it alone is not the best for the pass: two alike prompts at the balance each load about half
of themselves, where one loading most of its prompt beside one computing most of its own ends the
step sooner. Where the requests after it are known (`Follower`s: the vLLM connector gathers a pass's
requests on an idle engine), a split is chosen for when the pass's last first token comes
(`pass_end_s`), each follower taking its own best split behind it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrestore.core.errors import InvalidInputError
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.links import LinkCost
from kvrestore.policies.batch import QueuedLoad

SPLITS = ("planned", "load_all", "compute_all")
#: how much sooner waiting for the next step must be predicted to be than joining this one
WAIT_MARGIN = 0.05


@dataclass(frozen=True)
class SplitChoice:
    """How many prompt tokens to load (`k`) and what that was predicted to cost."""

    k: int
    n_tokens: int
    stored_tokens: int  # the longest stored prefix (whole chunks)
    loadable_tokens: int  # the most that could be loaded (whole blocks, leaving a token to compute)
    predicted_s: float | None  # None: no measured costs to predict with
    load_s: float | None
    compute_s: float | None  # the compute in this step (`step_tokens` of it at most)
    load_all_s: float | None  # the prediction for the largest k
    compute_all_s: float | None  # and for k = 0
    reason: str
    nbytes: float = 0.0  # bytes the load reads (whole chunks)
    saved_s: float = 0.0  # compute the load saves (0 where the costs are not known)
    bytes_ahead: float = 0.0  # bytes the link serves before this load
    compute_ahead_s: float = 0.0  # compute planned for the step's requests before this one
    later_s: float = 0.0  # compute left for the steps after this one (what `step_tokens` did not fit)
    step_new_tokens: int = 0  # tokens computed in this step
    wait_s: float | None = None  # the first token if it waits for the next step (None: not weighed)

    @property
    def waits(self) -> bool:
        """Waiting for the next step is predicted clearly sooner than joining this one."""
        return (
            self.wait_s is not None
            and self.predicted_s is not None
            and self.wait_s < (1 - WAIT_MARGIN) * self.predicted_s
        )

    @property
    def later_tokens(self) -> int:
        """Tokens left for the steps after this one (what `step_tokens` did not fit)."""
        return self.n_tokens - self.k - self.step_new_tokens

    def queued(self, key: str) -> QueuedLoad | None:
        """This split's load as it waits on the link (None: it loads nothing)."""
        return QueuedLoad(key, self.nbytes, self.saved_s) if self.k > 0 else None

    def fields(self) -> dict[str, Any]:
        """The choice as a record (`integrations.vllm.stats.emit`): tokens, predictions in seconds, the reason."""
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
            "compute_ahead_s": self.compute_ahead_s,
            "later_s": self.later_s,
            "wait_s": self.wait_s,
            "reason": self.reason,
        }

    def explain(self) -> str:
        if self.predicted_s is None:
            return f"load {self.k} of {self.n_tokens} tokens ({self.reason})"
        ahead = f", {self.bytes_ahead / 1e6:.1f} MB queued ahead" if self.bytes_ahead else ""
        ahead += f", {self.compute_ahead_s:.3f} s of the step's compute ahead" if self.compute_ahead_s else ""
        ahead += f", {self.later_s:.3f} s computed in later steps" if self.later_s else ""
        if self.waits:
            return (
                f"waits for the next step: predicted {self.wait_s:.3f} s, against {self.predicted_s:.3f} s "
                f"loading {self.k} of {self.n_tokens} tokens in this one{ahead}"
            )
        return (
            f"load {self.k} of {self.n_tokens} tokens, compute {self.n_tokens - self.k}: predicted "
            f"{self.predicted_s:.3f} s (load {self.load_s:.3f} s, compute {self.compute_s:.3f} s; "
            f"load-all {self.load_all_s:.3f} s, compute-all {self.compute_all_s:.3f} s{ahead}; {self.reason})"
        )


def max_loadable(n_tokens: int, stored_tokens: int, block_size: int) -> int:
    """The most tokens an engine can take from the store: within the stored prefix, leaving at least
    one prompt token to compute (it needs its logits), whole blocks."""
    return max(0, min(stored_tokens, n_tokens - 1)) // block_size * block_size


def split_candidates(kmax: int, chunk_size: int, block_size: int) -> list[int]:
    """The splits a planner weighs, up to `kmax` (`max_loadable`): whole chunks and whole blocks, and
    `kmax` itself."""
    step = math.lcm(chunk_size, block_size)
    return sorted({0, kmax, *range(step, kmax, step)})


def loaded_tokens_read(k: int, chunk_ends: Sequence[int]) -> int:
    """Tokens whose bytes are read to load [0, k): every chunk that overlaps [0, k), whole."""
    for end in chunk_ends:
        if end >= k:
            return end if k > 0 else 0
    return chunk_ends[-1] if chunk_ends and k > 0 else 0


def pipelined_s(load_s: float, compute_s: float, num_layers: int) -> float:
    """When a load and a compute that run layer by layer side by side both end: the slower of the two
    plus one layer of the other."""
    if load_s == 0:
        return compute_s
    return max(load_s + compute_s / num_layers, compute_s + load_s / num_layers)


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
    compute_ahead_s: float = 0.0,
    step_tokens: int | None = None,
    may_wait: bool = False,
    next_step_tokens: int | None = None,
    next_compute_ahead_s: float = 0.0,
    k: int | None = None,
) -> SplitChoice:
    """The split for a prompt of `n_tokens` whose leading stored chunks end at `chunk_ends`. A split that
    loads computes its suffix `loading` times slower than alone (`loading_factor`; 1 if not known).
    `bytes_ahead` (loads queued on the link, not finished) and `compute_ahead_s` (compute planned for
    the requests of the same step before this one) are what the lanes hold before it, and `step_tokens`
    how many tokens the step can still compute for it (None: no bound) (the module docstring); 0, 0
    and None, it has the engine to itself. `may_wait`: also weigh waiting for the next step, which
    holds `next_compute_ahead_s` of compute before it and has room for `next_step_tokens`
    (`SplitChoice.wait_s`; planned splits only). `k`: the split to predict, instead of the best one (a
    planned split; one of the aligned candidates)."""
    if mode not in SPLITS:
        raise InvalidInputError(f"split must be one of {SPLITS}, got {mode!r}")
    for name, v in (
        ("bytes_ahead", bytes_ahead),
        ("compute_ahead_s", compute_ahead_s),
        ("next_compute_ahead_s", next_compute_ahead_s),
    ):
        if not (math.isfinite(v) and v >= 0):
            raise InvalidInputError(f"{name} must be a finite number >= 0, got {v!r}")
    for name, t in (("step_tokens", step_tokens), ("next_step_tokens", next_step_tokens)):
        if t is not None and not (isinstance(t, int) and t >= 0):
            raise InvalidInputError(f"{name} must be an int >= 0 or None, got {t!r}")
    stored = chunk_ends[-1] if chunk_ends else 0
    kmax = max_loadable(n_tokens, stored, block_size)
    candidates = split_candidates(kmax, chunk_size, block_size)

    def nbytes(k: int) -> float:
        return loaded_tokens_read(k, chunk_ends) * bytes_per_token

    def now(k: int, room: int | None = step_tokens) -> int:
        """Tokens computed in this step: the suffix, or what the step has left (at least one: vLLM
        asks only while the step has room)."""
        return n_tokens - k if room is None else min(n_tokens - k, max(1, room))

    def predict(
        k: int, b_ahead: float = bytes_ahead, c_ahead: float = compute_ahead_s, room: int | None = step_tokens
    ) -> tuple[float, float, float, float, float]:
        """(first token, load seconds, compute seconds in this step, compute saved, compute later) of
        loading k tokens: when the step ends, both lanes having served what is ahead and this
        request's part, and then the steps that compute what did not fit in this one."""
        assert link is not None and compute is not None
        saved = max(0.0, compute.seconds(n_tokens, 0) - compute.seconds(n_tokens - k, k)) if k > 0 else 0.0
        c = compute.seconds(now(k, room), k) * ((loading or 1.0) if k > 0 else 1.0)
        rest = n_tokens - k - now(k, room)
        later = compute.seconds(rest, n_tokens - rest) if rest > 0 else 0.0
        # headers, then a round per layer, after the bytes the link serves first
        ld = (num_layers + 1) * link.latency_s + nbytes(k) / link.bytes_per_s if k > 0 else 0.0
        ends = pipelined_s(b_ahead / link.bytes_per_s + ld, c_ahead + c, num_layers)
        return ends + later, ld, c, saved, later

    known = link is not None and compute is not None
    if mode == "compute_all" or kmax == 0:
        k, reason = 0, "split=compute_all" if mode == "compute_all" else "nothing loadable is stored"
    elif mode == "load_all":
        k, reason = kmax, "split=load_all"
    elif not known:
        missing = " and ".join(w for w, v in (("the link", link), ("compute", compute)) if v is None)
        k, reason = kmax, f"no measured cost of {missing} yet: loading every stored token"
    elif k is not None:
        if k not in candidates:
            raise InvalidInputError(f"k must be one of the aligned splits {candidates}, got {k!r}")
        reason = "planned: this split, by request"
    else:
        k = min(candidates, key=lambda c: (predict(c)[0], -c))
        reason = "planned: the load and the compute finish together"
    if not known:
        return SplitChoice(
            k, n_tokens, stored, kmax, None, None, None, None, None, reason, nbytes(k), step_new_tokens=now(k)
        )
    total, ld, c, saved, later = predict(k)
    load_all, compute_all = predict(kmax)[0], predict(0)[0]
    wait_s = None
    if may_wait and mode == "planned" and (bytes_ahead > 0 or compute_ahead_s > 0):
        assert link is not None
        ahead_end_s = pipelined_s(bytes_ahead / link.bytes_per_s, compute_ahead_s, num_layers)
        nxt = [predict(c, 0.0, next_compute_ahead_s, next_step_tokens)[0] for c in candidates]
        wait_s = ahead_end_s + min(nxt)
    return SplitChoice(
        k,
        n_tokens,
        stored,
        kmax,
        total,
        ld,
        c,
        load_all,
        compute_all,
        reason,
        nbytes(k),
        saved,
        bytes_ahead,
        compute_ahead_s,
        later,
        now(k),
        wait_s,
    )


@dataclass(frozen=True)
class Follower:
    """A request the engine will ask about after this one in the same pass: its prompt's length and
    where its leading stored chunks end (`choose_split`'s `n_tokens` and `chunk_ends`)."""

    n_tokens: int
    chunk_ends: Sequence[int]


def pass_end_s(choice: SplitChoice, followers: Sequence[Follower], **split: Any) -> float:
    """When the last of a pass's first tokens comes if this request takes `choice` and each of
    `followers` then takes its own best split behind it (`choose_split` with what the step holds by
    then, waiting for the next step where that is clearly sooner). `split`: the arguments `choice` was
    planned with."""
    t = choice.wait_s if choice.waits else choice.predicted_s
    assert t is not None
    end = t
    lanes = dict(split)
    for key in ("k", "n_tokens", "chunk_ends"):
        lanes.pop(key, None)
    ahead = [] if choice.waits else [choice]
    for f in followers:
        step, nxt = lanes.get("step_tokens"), lanes.get("next_step_tokens")
        room = None if step is None else step - sum(a.step_new_tokens for a in ahead)
        c = choose_split(
            **{
                **lanes,
                "bytes_ahead": lanes.get("bytes_ahead", 0.0) + sum(a.nbytes for a in ahead),
                "compute_ahead_s": lanes.get("compute_ahead_s", 0.0) + sum(a.compute_s or 0.0 for a in ahead),
                "step_tokens": None if room is None else max(0, room),
                "may_wait": True,
                "next_step_tokens": None if nxt is None else max(0, nxt - sum(a.later_tokens for a in ahead)),
                "next_compute_ahead_s": lanes.get("next_compute_ahead_s", 0.0)
                + sum(a.later_s for a in ahead),
            },
            n_tokens=f.n_tokens,
            chunk_ends=f.chunk_ends,
        )
        # a step with no room left is not joined: vLLM schedules the request in the next one
        waits = c.waits or (room is not None and room <= 0 and c.wait_s is not None)
        t = c.wait_s if waits else c.predicted_s
        if t is None:
            return math.inf
        end = max(end, t)
        if not waits:
            ahead.append(c)
    return end


def choose_split_ahead(followers: Sequence[Follower] = (), **split: Any) -> SplitChoice:
    """`choose_split`, for a request the engine asks about before `followers` in the same pass: the
    split after which the pass's last first token comes soonest, each follower then taking its own best
    split behind it (`pass_end_s`); among equals, the one best for this request alone. Two alike
    prompts at the balance, for instance: the best split of each alone loads about half of each, and the
    step serves both halves on the link and both suffixes on the model; one prompt computed whole while
    the other loads whole ends the step sooner. Without followers, or where the split is not planned
    from known costs, `choose_split` itself."""
    alone = choose_split(**split)
    if not followers or alone.predicted_s is None or split.get("mode", "planned") != "planned":
        return alone
    best: tuple[tuple[float, float, int], SplitChoice] | None = None
    for k in split_candidates(alone.loadable_tokens, split["chunk_size"], split["block_size"]):
        c = alone if k == alone.k else choose_split(**split, k=k)
        assert c.predicted_s is not None
        key = (pass_end_s(c, followers, **split), c.predicted_s, -k)
        if best is None or key < best[0]:
            best = (key, c)
    assert best is not None
    after = f"{len(followers)} request{'s' if len(followers) > 1 else ''}"
    return dataclasses.replace(best[1], reason=f"planned with the {after} after it in the pass")


__all__ = [
    "SPLITS",
    "WAIT_MARGIN",
    "Follower",
    "SplitChoice",
    "choose_split",
    "choose_split_ahead",
    "loaded_tokens_read",
    "max_loadable",
    "pass_end_s",
    "pipelined_s",
    "split_candidates",
]
