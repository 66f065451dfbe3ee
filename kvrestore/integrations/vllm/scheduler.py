"""The scheduler side of the vLLM connector (`kvrestore.integrations.vllm.KVRestoreConnector`).

It looks each new prompt up in the store, picks the split (how many stored tokens to load), and tells
the worker side, step by step, which chunks to load and save (`meta`). It moves no KV: no I/O
thread, no saver. A lookup runs on an event loop of its own, in the scheduler's thread (vLLM waits for
the answer in any case), through `DeadlineStore`: at most `lookup_timeout_s`, and none for
`retry_after_s` once the store has failed one (every prompt is then a miss).

Many requests at once (``"batch": true``, the default): each split counts what the link and the step
hold before it (`LinkQueue`) and the room left in vLLM's token budget (`ConnectorContext.step_tokens`);
each step's loads go in the link's order, the one that saves the most compute per byte first
(`policies.batch.link_order`). A request whose suffix would spill past a full step may wait one step
instead, where that is predicted clearly sooner (`planning.split`): its lookup answers None and vLLM
asks again at its next pass. A request waits once at most.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvrestore.chunkio.pages import blocks_of
from kvrestore.chunkio.parts import Layout, candidate_keys, leading, stored_layouts
from kvrestore.core.errors import STORE_FAULTS
from kvrestore.core.keys import ChunkRef
from kvrestore.core.sync import CallerLoop
from kvrestore.integrations.vllm.config import ConnectorContext
from kvrestore.integrations.vllm.keys import RequestKeys
from kvrestore.integrations.vllm.meta import (
    KVRestoreConnectorMetadata,
    KVRestoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvrestore.integrations.vllm.stats import Counters, emit
from kvrestore.planning.link_queue import LinkQueue, carried
from kvrestore.planning.split import Follower, SplitChoice, choose_split_ahead
from kvrestore.policies.batch import link_order
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.deadline import Deadlines, DeadlineStore

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    refs: list[ChunkRef]
    stored: list[bool]
    n_tokens: int
    layout: Layout | None = None  # the parts its leading stored chunks are stored as
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # chunks before this one are saved or not to be saved
    load_k: int = 0
    load_from: int = 0  # where vLLM's own prefix cache ends: the load starts there
    need_load: bool = False
    choice: SplitChoice | None = None
    waited: bool = False  # it has waited a step once (`SplitChoice.waits`); it never waits again
    #: when the gathering it joined began (it was first answered "ask again" to gather a pass)
    gathered_at: float | None = None
    asked: int = 0  # the scheduling pass that last asked about it (`SchedulerSide.passes`)
    gathered: bool = False  # it was answered "ask again" to gather (counted once it is planned)

    def ends(self) -> list[int]:
        """Where its leading stored chunks end."""
        leading = itertools.takewhile(lambda pair: pair[1], zip(self.refs, self.stored, strict=True))
        return [ref.end for ref, _ in leading]

    @property
    def unplanned(self) -> bool:
        """Gathered, and neither planned nor gone to wait for the next step."""
        return self.gathered_at is not None and self.choice is None and not self.waited


def _emit_choice(event: str, req_id: str, choice: SplitChoice) -> None:
    """Log a split (or a wait for the next step) with its prediction, and keep it as a record."""
    emit(
        logging.INFO,
        event,
        "request %(request)s: %(explain)s",
        request=req_id,
        explain=choice.explain(),
        **choice.fields(),
    )


class SchedulerSide:
    """The connector's scheduler-role calls, over `ctx` and a store of its own."""

    def __init__(self, ctx: ConnectorContext, store: ChunkStore | None = None) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.store = store if store is not None else ctx.open_store()
        c = self.config
        retry = c.retry_after_s
        #: the store as lookups see it: bounded by `lookup_timeout_s`, then down for `retry_after_s`
        self.lookups = DeadlineStore(
            self.store, Deadlines(c.lookup_timeout_s, None, None, backoff_s=retry, max_backoff_s=retry)
        )
        self.loop = CallerLoop()
        self.counters = Counters()
        self.keys = RequestKeys(ctx.key_space)
        self.queue = LinkQueue(c.load_timeout_s)
        self._reqs: dict[str, _Request] = {}
        self._unkeyed: set[str] = set()  # requests neither loaded nor saved (`keys.Unkeyable`)
        self.passes = 0  # scheduling passes (`build_connector_meta` ends one)
        self._timed_pass, self._pass_at = -1, 0.0  # the pass `_pass_time` read the clock in, and when

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        st = self._reqs.get(request.request_id)
        if st is None:
            if request.request_id in self._unkeyed:
                return 0, False
            refs = self.keys.refs(request, tokens, self.config.chunk_size)
            if refs is None:  # its KV depends on what no key names: neither loaded nor saved
                self._unkeyed.add(request.request_id)
                self.counters.add(unkeyed_requests=1)
                return 0, False
            stored, layout = self._lookup([r.key for r in refs])
            st = self._reqs[request.request_id] = _Request(refs, stored, len(tokens), layout)
        st.asked = self.passes
        if not self.config.load:
            return 0, False
        ends = st.ends()
        costs = self.ctx.costs
        costs.refresh()
        ahead, compute_ahead, tokens_ahead = (
            self.queue.ahead(request.request_id) if self.config.batch else (0, 0, 0)
        )
        budget = self.ctx.step_tokens
        may_wait = self.config.batch and not st.waited and st.choice is None
        spill_s, spill_tokens = self.queue.later(request.request_id) if may_wait else (0.0, 0)
        link, compute = costs.link_cost(self.ctx.link_key) or self.ctx.prior_link(), costs.step_cost()
        known = bool(ends) and link is not None and compute is not None
        if known and self._gathers(st, ahead, compute_ahead):
            return None, False
        followers = [Follower(o.n_tokens, o.ends()) for o in self._gathering() if o is not st]
        choice = choose_split_ahead(
            followers,
            n_tokens=len(tokens),
            chunk_ends=ends,
            chunk_size=self.config.chunk_size,
            block_size=self.ctx.block_size,
            bytes_per_token=self.ctx.stored_bytes_per_token,
            num_layers=self.ctx.spec.num_layers,
            link=link,
            compute=compute,
            loading=costs.loading_factor(),
            mode=self.config.split,
            bytes_ahead=ahead,
            compute_ahead_s=compute_ahead,
            step_tokens=None if budget is None else max(0, budget - tokens_ahead),
            may_wait=may_wait,
            next_step_tokens=None if budget is None else max(0, budget - spill_tokens),
            next_compute_ahead_s=spill_s,
        )
        if choice.waits:  # vLLM skips it in this pass and asks again in the next
            st.waited = True
            self.counters.add(waited_requests=1)
            _emit_choice("wait", request.request_id, choice)
            return None, False
        fresh = st.choice is None
        st.choice = choice
        loads = choice.k > num_computed_tokens  # vLLM's own prefix cache may hold the whole split
        load = choice.queued(request.request_id) if loads else None
        self.queue.plan(request.request_id, load, choice)
        if fresh:  # counted in the pass that schedules it (vLLM may drop the counts of an empty one)
            self.counters.add(hit_tokens=choice.loadable_tokens, gathered_requests=int(st.gathered))
        if ends and fresh:
            _emit_choice("split", request.request_id, choice)
            self.counters.add(
                planned_tokens=choice.k, partial_splits=int(0 < choice.k < choice.loadable_tokens)
            )
        if not loads:
            return 0, False
        st.load_k, st.load_from = choice.k, num_computed_tokens
        return choice.k - num_computed_tokens, False

    def _gathers(self, st: _Request, bytes_ahead: float, compute_ahead_s: float) -> bool:
        """Whether to answer `st` "ask again" to gather the requests arriving with it (`gather_s`): a new
        request, under the batch rule, on an engine that loads nothing and computes less than `gather_s`
        ahead (asking again costs little), until `gather_s` after the gathering's first request. vLLM
        asks the rest of its queue in the same pass, so each is known when the first is planned."""
        g = self.config.gather_s
        if not (self.config.batch and g > 0 and self.config.split == "planned"):
            return False
        now = self._pass_time()
        if st.gathered_at is None:
            if st.choice is not None or st.waited or bytes_ahead > 0 or compute_ahead_s > g:
                return False
            # it joins the gathering under way, if any: all of it is planned in the same pass
            st.gathered_at = min((o.gathered_at or now for o in self._gathering()), default=now)
            st.gathered = now - st.gathered_at < g
            return st.gathered
        return st.unplanned and now - st.gathered_at < g

    def _pass_time(self) -> float:
        """The time of this scheduling pass, read at its first question: a gathering's window closes for
        every request of one pass at once, however long the pass takes between its questions."""
        if self._timed_pass != self.passes:
            self._timed_pass, self._pass_at = self.passes, time.monotonic()
        return self._pass_at

    def _gathering(self) -> list[_Request]:
        """The gathered requests not planned yet that vLLM still asks about (in this pass or the last:
        one it stopped asking about, finished or not, is not waited for); none where nothing gathers."""
        if not self.config.gather_s:
            return []
        return [o for o in self._reqs.values() if o.unplanned and o.asked >= self.passes - 1]

    def _lookup(self, keys: list[str]) -> tuple[list[bool], Layout | None]:
        """Which chunks are stored for this engine, and as what parts: the leading chunks whose parts of
        one layout (`ConnectorContext.layouts`: this engine's first) are all stored, so every rank
        finds its heads; all False (recorded, with a warning) if the store does not answer in time, and
        for `retry_after_s` after that."""
        if self.lookups.down_for > 0:
            return [False] * len(keys), None
        self.counters.add(lookups=1)
        spec, layouts = self.ctx.spec, self.ctx.layouts
        asked = candidate_keys(spec, keys, layouts)
        try:
            found = self.lookups.contains_sync(asked)  # a local store: no event loop, no thread
            if found is None:
                found = list(self.loop.call(self.lookups.contains, asked))
        except STORE_FAULTS as exc:
            self.lookups.failed()  # a timeout has marked it down already; any other fault does now
            self.counters.add(lookup_failures=1)
            emit(
                logging.WARNING,
                "lookup_failed",
                "store %(store)s did not answer a lookup (%(error)s); computing without it for %(retry_s).0f s",
                store=self.config.store_url,
                error=f"{type(exc).__name__}: {exc or 'timeout'}",
                retry_s=self.lookups.down_for,
            )
            return [False] * len(keys), None
        layout, n = leading(stored_layouts(spec, keys, layouts, dict(zip(asked, found, strict=True))))
        return [i < n for i in range(len(keys))], layout

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            st.need_load = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVRestoreConnectorMetadata:
        self.passes += 1
        meta = KVRestoreConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            n_new = sched.get(new.req_id, 0)
            self._step(meta, new.req_id, new.num_computed_tokens, n_new, new.block_ids[0], replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            self._step(
                meta,
                req_id,
                cached.num_computed_tokens[i],
                sched.get(req_id, 0),
                None if blocks is None else blocks[0],
                replace=req_id in cached.resumed_req_ids,
            )
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        if self.config.batch:  # the link serves the load that saves the most compute per byte first
            planned = [q for spec in meta.loads if (q := self.queue.planned(spec.req_id)) is not None]
            rank = {q.key: i for i, q in enumerate(link_order(planned))}
            meta.loads.sort(key=lambda spec: rank.get(spec.req_id, len(rank)))
        # what the step's requests carry into the next one (alone: nothing ahead)
        steps = [(st.n_tokens, c + n) for r, n, c in meta.steps if (st := self._reqs.get(r)) is not None]
        running = (
            carried(steps, self.ctx.costs.step_cost(), self.ctx.step_tokens)
            if self.config.batch
            else (0.0, 0)
        )
        self.queue.send((spec.req_id for spec in meta.loads), running)
        return meta

    def _forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._unkeyed.discard(req_id)
        self.queue.finished([req_id])

    def _step(
        self,
        meta: KVRestoreConnectorMetadata,
        req_id: str,
        computed: int,
        n_new: int,
        blocks: list[int] | None,
        replace: bool,
    ) -> None:
        """`req_id` in the step: its new `blocks` (replacing its blocks, or added to them), its load and
        the chunks it completes to save. A request not keyed still shares the step (the worker times
        steps)."""
        meta.steps.append((req_id, n_new, computed))
        st = self._reqs.get(req_id)
        if st is None:
            return
        if blocks is not None:
            st.block_ids = list(blocks) if replace else st.block_ids + list(blocks)
        if st.need_load:  # what vLLM lacks: [load_from, load_k), from the chunks that hold it
            st.need_load = False
            k, first = st.load_k, st.load_from
            chunks = [r for r in st.refs if r.start < k and r.end > first]
            meta.loads.append(LoadSpec(req_id, chunks, k, list(st.block_ids), first, st.layout))
        if not self.config.save or self.lookups.down_for > 0:
            return  # while the store is down, chunks are not even copied out
        done = computed + n_new
        todo = []
        while st.next_save < len(st.refs) and st.refs[st.next_save].end <= done:
            ref = st.refs[st.next_save]
            if not st.stored[ref.index]:
                todo.append(ref)
            st.next_save += 1
        if todo:
            meta.saves.append(
                SaveSpec(req_id, todo, blocks_of(st.block_ids, 0, todo[-1].end, self.ctx.block_size))
            )

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVRestoreWorkerMetadata):
            return
        self.queue.finished(meta.loaded)
        for req_id, chunks in meta.failed.items():
            st = self._reqs.get(req_id)
            if st is None or not chunks:
                continue
            for j in chunks:  # deleted by the loader: write them again once vLLM has recomputed them
                st.stored[j] = False
            st.next_save = min(st.next_save, min(chunks))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def shutdown(self) -> None:
        """Close the store on the loop its client was made on, then the loop."""
        with contextlib.suppress(*STORE_FAULTS):
            self.loop.call(self.store.close, timeout=self.config.lookup_timeout_s)
        self.loop.close()
