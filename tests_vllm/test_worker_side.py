"""The connector's worker side, driven step by step without an engine (vLLM's classes are real)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.parts import whole
from kvrestore.core.errors import StoreError
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.costs.learned import CostLearner
from kvrestore.integrations.vllm.config import ConnectorConfig, ConnectorContext
from kvrestore.integrations.vllm.meta import KVRestoreConnectorMetadata, LoadSpec, SaveSpec
from kvrestore.integrations.vllm.scheduler import SchedulerSide
from kvrestore.integrations.vllm.worker import WorkerSide
from kvrestore.planning.link_queue import carried
from kvrestore.stores import MemoryStore

L, H, D, BLOCK, N_BLOCKS, CHUNK = 2, 2, 4, 8, 16, 16
SPEC = ModelSpec("m", L, H, D, 100, torch.float32, "f" * 32)


class Saver:
    def __init__(self) -> None:
        self.submitted: list[int] = []
        self.written = self.written_bytes = self.dropped = self.failed = 0

    def reserve(self, key: str, nbytes: int) -> bool:
        return True

    def submit_reserved(
        self, key: str, chunk: KVChunk, nbytes: int, ready: object = None, fp8_scales: object = None
    ) -> None:
        self.submitted.append(chunk.start)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def finish(self, timeout: float | None = None) -> None:
        pass

    def take_counts(self) -> dict[str, int]:
        now = {
            "saved_chunks": self.written,
            "saved_bytes": self.written_bytes,
            "dropped_chunks": self.dropped,
            "failed_saves": self.failed,
        }
        seen, self.seen = getattr(self, "seen", {}), now
        return {name: n - seen.get(name, 0) for name, n in now.items()}


def worker(store: MemoryStore) -> WorkerSide:
    """A worker side over flash-attn pages of a tiny model, its costs in memory only."""
    ctx = ConnectorContext(
        ConnectorConfig.from_extra({"store_url": "memory://"}), SPEC, BLOCK, CostLearner(SPEC)
    )
    side = WorkerSide(ctx, store=store, saver=Saver())  # type: ignore[arg-type]
    side.register_kv_caches(
        {f"model.layers.{i}.self_attn.attn": torch.zeros(2, N_BLOCKS, BLOCK, H, D) for i in range(L)}
    )
    return side


def step(side: WorkerSide, meta: KVRestoreConnectorMetadata) -> None:
    """One forward pass as vLLM drives a connector."""
    side.bind(meta)
    side.start_load_kv()
    for name in side._layer_of:
        side.wait_for_layer_load(name)
    side.wait_for_save()
    side.clear()


def test_chunks_computed_over_a_failed_load_are_not_saved():
    """A step loads [0, 16) and computes [16, 32) on top of it. The load fails (the chunk is gone), so
    vLLM's [16, 32) attended over KV that never arrived: saving it would store a wrong chunk under a
    valid key. It is saved once recomputed instead (the scheduler side moves its next save back)."""
    refs = chunk_keys(list(range(48)), SPEC.fingerprint, CHUNK)
    blocks = list(range(4))

    def meta(req: str) -> KVRestoreConnectorMetadata:
        m = KVRestoreConnectorMetadata()
        m.loads.append(LoadSpec(req, [refs[0]], 16, blocks))
        m.saves.append(SaveSpec(req, [refs[1]], blocks))
        m.steps.append((req, 16, 16))
        return m

    store = MemoryStore()  # empty: the chunk the lookup found is gone
    side = worker(store)
    saver: Saver = side.saver  # type: ignore[assignment]
    try:
        step(side, meta("a"))
        assert side.get_block_ids_with_load_errors() == {0, 1}
        assert saver.submitted == [] and side.costs.state.loading == [] and side.costs.state.steps == []
        assert side.build_connector_worker_meta().failed == {"a": {0}}  # type: ignore[union-attr]
        counts = side.take_counts()
        assert counts["load_failures"] == 1 and counts["failed_chunks"] == 1 and counts["loads"] == 0
        # the same step with the chunk in the store: loaded into the pages, the computed chunk saved
        kv = torch.randn(L, 2, H, 16, D)
        blob = codec.encode_chunk(KVChunk(0, kv), SPEC, refs[0].key)
        side.io.call(store.put, refs[0].key, blob)
        step(side, meta("b"))
        assert side.get_block_ids_with_load_errors() == set()
        assert saver.submitted == [16]
        for layer in range(L):  # flash_attn pages: [2, blocks, block_size, H, D]; blocks 0 and 1
            pages = side._caches[layer][:, :2].reshape(2, 16, H, D).transpose(1, 2)
            assert torch.equal(pages, kv[layer])
        # a step that loaded is a sample of computing after a past, and of computing beside a load
        ((n_new, past, load_s, step_s, layers),) = side.costs.state.loading
        assert (n_new, past, layers) == (16, 16, L) and load_s > 0 and step_s > 0
        ((n_new, past, seconds),) = side.costs.state.steps
        assert (n_new, past) == (16, 16) and 0 < seconds <= step_s
        counts = side.take_counts()
        assert (
            counts["loads"] == 1
            and counts["loaded_tokens"] == 16
            and counts["loaded_bytes"] > blob.__len__() // 2
        )
    finally:
        side.io.close()


def test_a_worker_and_a_scheduler_are_separate_objects_with_separate_resources():
    """The scheduler side holds no I/O thread and no saver; the connector composes one side per role."""
    from kvrestore.integrations.vllm import KVRestoreConnector
    from kvrestore.integrations.vllm.scheduler import SchedulerSide

    ctx = ConnectorContext(
        ConnectorConfig.from_extra({"store_url": "memory://"}), SPEC, BLOCK, CostLearner(SPEC)
    )
    threads = set(threading.enumerate())
    sched = SchedulerSide(ctx)
    assert sched.loop.call(sched.store.contains, ["ab" * 20], timeout=5) == [False]  # a lookup
    assert set(threading.enumerate()) <= threads  # none was started (an earlier test's may have ended)
    assert not hasattr(sched, "io") and not hasattr(sched, "saver")
    sched.shutdown()
    assert not issubclass(KVRestoreConnector, (WorkerSide, SchedulerSide))


def test_loading_asks_vllm_for_piecewise_cuda_graphs():
    """A full graph's replay would skip the per-layer waits for loads."""
    from kvrestore.integrations.vllm import KVRestoreConnector

    assert KVRestoreConnector.requires_piecewise_for_cudagraph({"store_url": "/kv"}) is True
    assert KVRestoreConnector.requires_piecewise_for_cudagraph({"store_url": "/kv", "load": False}) is False


def test_an_fp8_cache_is_saved_as_it_is_and_loads_back_byte_for_byte():
    """vLLM's fp8 cache (one byte an element under the fp32 model; flash_attn pages, whose layout is the
    same whatever the element): its pages are saved as fp8 chunks holding the values and each layer's
    scales, which a Restorer's fp8 reader decodes to value x scale; another fp8 cache loads them back as
    the same bytes, with no decode and re-rounding between."""
    from kvrestore.codec.quant import key_space
    from kvrestore.core.errors import UnsupportedModelError

    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    scales = dict.fromkeys(names, (0.5, 2.0))  # bf16 holds both exactly
    ctx = ConnectorContext(
        ConnectorConfig.from_extra({"store_url": "memory://", "kv_encoding": "fp8"}),
        SPEC,
        BLOCK,
        CostLearner(SPEC),
    )
    store = MemoryStore()
    pages = {n: torch.randn(2, N_BLOCKS, BLOCK, H, D).to(torch.float8_e4m3fn) for n in names}
    refs = chunk_keys(list(range(32)), key_space(SPEC.fingerprint, "fp8"), CHUNK)
    chunks = refs[:2]
    saving, loading = WorkerSide(ctx, store=store), WorkerSide(ctx, store=store)
    try:
        saving.register_kv_caches(pages, scales)
        save = KVRestoreConnectorMetadata(saves=[SaveSpec("a", chunks, [0, 1, 2, 3])], steps=[("a", 32, 0)])
        step(saving, save)
        assert saving.saver.flush(timeout=10) and saving.saver.written == 2
        blob = saving.io.call(store.get, refs[0].key)
        got = codec.decode_chunk(blob, SPEC, refs[0].key, 0, CHUNK, encoding="fp8").data
        for i, n in enumerate(names):  # blocks 0 and 1: tokens [0, 16) as [2, H, T, D]
            values = pages[n][:, :2].reshape(2, CHUNK, H, D).transpose(1, 2).float()
            assert torch.equal(got[i], values * torch.tensor([0.5, 2.0]).view(2, 1, 1, 1))

        empty = {n: torch.zeros(2, N_BLOCKS, BLOCK, H, D, dtype=torch.float8_e4m3fn) for n in names}
        loading.register_kv_caches(empty, scales)
        load = KVRestoreConnectorMetadata(
            loads=[LoadSpec("b", chunks, 32, [4, 5, 6, 7])], steps=[("b", 1, 32)]
        )
        step(loading, load)
        assert loading.get_block_ids_with_load_errors() == set()
        for n in names:
            assert torch.equal(empty[n][:, 4:8].view(torch.uint8), pages[n][:, :4].view(torch.uint8))

        native = WorkerSide(
            ConnectorContext(
                ConnectorConfig.from_extra({"store_url": "memory://"}), SPEC, BLOCK, CostLearner(SPEC)
            ),
            store=store,
        )
        try:
            with pytest.raises(UnsupportedModelError, match="kv_encoding"):
                native.register_kv_caches(pages, scales)
        finally:
            native.io.close()
    finally:
        saving.io.close()
        loading.io.close()


def test_host_pages_from_a_local_directory_are_read_on_the_step_thread(tmp_path):
    """vLLM's CPU pages from a store that reads without the event loop: `HostPages`, read on the step's
    thread, with the same pages as a load through the I/O thread (a throttled link) gives."""
    from kvrestore.chunkio.host_pages import HostPages
    from kvrestore.chunkio.page_dest import SectionPages
    from kvrestore.chunkio.pages import gather
    from kvrestore.stores import LocalStore, ThrottledStore

    d, block = 32, 32  # the shapes of vLLM's "vec" CPU kernels: 16-token chunks, 32-token pages
    spec = ModelSpec("m", L, H, d, 100, torch.float32, "e" * 32)
    refs = chunk_keys(list(range(40)), spec.fingerprint, CHUNK)
    kv = torch.randn(L, 2, H, 40, d)
    local = LocalStore(str(tmp_path))
    blocks = [5, 1]  # the request's pages, out of order
    seen = {}
    for name, store in (("local", local), ("throttled", ThrottledStore(local, 1e9))):
        ctx = ConnectorContext(
            ConnectorConfig.from_extra({"store_url": str(tmp_path)}), spec, block, CostLearner(spec)
        )
        side = WorkerSide(ctx, store=store, saver=Saver())  # type: ignore[arg-type]
        side.register_kv_caches(
            {f"model.layers.{i}.self_attn.attn": torch.zeros(8, H, block, 2 * d) for i in range(L)}
        )
        try:
            if name == "local":
                for r in refs:
                    side.io.call(
                        store.put,
                        r.key,
                        codec.encode_chunk(
                            KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()), spec, r.key
                        ),
                    )
            meta = KVRestoreConnectorMetadata()
            meta.loads.append(LoadSpec("a", refs, 36, blocks))
            meta.steps.append(("a", 4, 36))
            side.bind(meta)
            side.start_load_kv()
            seen[name] = type(side._loads[0][1].dest)
            for layer_name in side._layer_of:
                side.wait_for_layer_load(layer_name)
            side.wait_for_save()
            side.clear()
            assert side.get_block_ids_with_load_errors() == set()
            assert side.take_counts()["loaded_tokens"] == 36
            # a step that read on its own thread computed after each read, not beside it: a sample of
            # computing only
            assert len(side.costs.state.steps) == 1
            assert len(side.costs.state.loading) == (0 if name == "local" else 1)
            for layer in range(L):
                got = gather([(side.paged.k[layer], side.paged.v[layer])], blocks, 0, 36)[0]
                assert torch.equal(got, kv[layer, :, :, :36])
        finally:
            side.io.close()
    assert seen == {"local": HostPages, "throttled": SectionPages}


class _Request:
    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.prompt_token_ids = request_id, tokens


def test_hit_tokens_count_only_what_a_load_can_take():
    store = MemoryStore()
    ctx = ConnectorContext(
        ConnectorConfig.from_extra({"store_url": "memory://"}), SPEC, BLOCK, CostLearner(SPEC)
    )
    tokens = list(range(40))  # one stored chunk of 40 tokens; blocks of 8
    side = SchedulerSide(ctx, store)
    try:
        for r in chunk_keys(tokens, ctx.key_space, ctx.config.chunk_size):
            side.loop.call(store.put, r.key, b"x")
        assert side.get_num_new_matched_tokens(_Request("r", tokens), 0) == (32, False)  # type: ignore[arg-type]
        assert (
            side.counters.take()["hit_tokens"] == 32
        )  # 40 stored; the last block holds the token to compute
    finally:
        side.shutdown()


def test_a_failed_lookup_makes_every_prompt_a_miss_for_retry_after_s():
    """Lookups go through the library's DeadlineStore: a store that refuses one is counted once, then
    not asked again for `retry_after_s` (every prompt a miss, nothing saved)."""

    class Refusing(MemoryStore):
        asked = 0

        def contains_sync(self, keys):
            return None  # as a remote store: asked on the event loop

        async def contains(self, keys):
            self.asked += 1
            raise StoreError("connection refused")

    store = Refusing()
    ctx = ConnectorContext(
        ConnectorConfig.from_extra({"store_url": "memory://", "retry_after_s": 60}),
        SPEC,
        BLOCK,
        CostLearner(SPEC),
    )
    side = SchedulerSide(ctx, store)
    try:
        tokens = list(range(40))
        assert side.get_num_new_matched_tokens(_Request("a", tokens), 0) == (0, False)  # type: ignore[arg-type]
        assert side.get_num_new_matched_tokens(_Request("b", tokens), 0) == (0, False)  # type: ignore[arg-type]
        counts = side.counters.take()
        assert store.asked == 1 and counts["lookups"] == 1 and counts["lookup_failures"] == 1
        assert 0 < side.lookups.down_for <= 60
    finally:
        side.shutdown()


def _costed_side(
    store: MemoryStore, batch: bool, step_tokens: int | None = None, gather_s: float = 0.0
) -> SchedulerSide:
    """A scheduler side whose costs are known: a 400-token prompt computes in about 4 s, and the link
    loads it in as long (the balance); an engine step computes `step_tokens` at most; each request is
    planned when first asked, unless `gather_s`."""
    extra = {"store_url": "memory://", "chunk_size": 16, "batch": batch, "gather_s": gather_s}
    probe = ConnectorContext(ConnectorConfig.from_extra(extra), SPEC, BLOCK, CostLearner(SPEC))
    extra["link_bytes_per_s"] = 400 * probe.stored_bytes_per_token / 4.0
    book = CostLearner(SPEC)
    for n, past, s in [(400, 0, 4.0), (200, 200, 2.2), (100, 300, 1.2), (1, 400, 0.01)]:
        book.observe_step(n, past, s)
    ctx = ConnectorContext(ConnectorConfig.from_extra(extra), SPEC, BLOCK, book, step_tokens)
    return SchedulerSide(ctx, store)


def _output(side: SchedulerSide, req_ids: list[str], k: dict[str, int]) -> object:
    """vLLM's SchedulerOutput for a step that schedules `req_ids`, new, each after its loaded `k`."""
    from types import SimpleNamespace

    new = [
        SimpleNamespace(req_id=r, block_ids=([i * 50 + b for b in range(50)],), num_computed_tokens=k[r])
        for i, r in enumerate(req_ids)
    ]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r: 400 - k[r] for r in req_ids},
        finished_req_ids=set(),
    )


def test_requests_loading_at_once_share_the_link_under_the_batch_rule():
    """Four prompts asked in one scheduling pass: with the batch rule each split counts what both lanes
    hold before it (the bytes queued on the link, and the compute planned in this pass: the step they
    share), the step's loads go in the link's order (most compute saved per byte first), and once the
    worker reports them finished the link is free again. Without it, every split is planned as if
    alone."""
    from types import SimpleNamespace

    from kvrestore.integrations.vllm.meta import KVRestoreWorkerMetadata
    from kvrestore.policies.batch import link_order

    store = MemoryStore()
    prompts = {r: [1000 * i + t for t in range(400)] for i, r in enumerate("abcd")}
    alone, batched = _costed_side(store, False), _costed_side(store, True)
    try:
        for ref in (ref for t in prompts.values() for ref in chunk_keys(t, batched.ctx.key_space, 16)):
            batched.loop.call(store.put, ref.key, b"x")
        ks_alone = [alone.get_num_new_matched_tokens(_Request(r, t), 0)[0] for r, t in prompts.items()]  # type: ignore[arg-type]
        assert len(set(ks_alone)) == 1 and 0 < ks_alone[0] < 392  # a split of each, as if alone
        ks = {r: batched.get_num_new_matched_tokens(_Request(r, t), 0)[0] for r, t in prompts.items()}  # type: ignore[arg-type]
        assert ks["a"] == ks_alone[0]  # the first finds the engine free
        choices = [batched._reqs[r].choice for r in "abcd"]
        for i, c in enumerate(choices):  # each counts the ones before it, on both lanes
            assert c.bytes_ahead == pytest.approx(sum(p.nbytes for p in choices[:i] if p.k > 0))  # type: ignore[union-attr]
            assert c.compute_ahead_s == pytest.approx(sum(p.compute_s for p in choices[:i]))  # type: ignore[union-attr, misc]
        predicted = [c.predicted_s for c in choices]  # type: ignore[union-attr]
        assert predicted == sorted(predicted) and predicted[0] < predicted[-1]  # the step, as planned so far
        for r, t in prompts.items():
            batched.update_state_after_alloc(_Request(r, t), ks[r])  # type: ignore[arg-type]
        sent = [r for r in prompts if ks[r] > 0]
        expected = [q.key for q in link_order(batched.queue.planned(r) for r in sent)]  # type: ignore[misc]
        meta = batched.build_connector_meta(_output(batched, list(prompts), ks))  # type: ignore[arg-type]
        assert [spec.req_id for spec in meta.loads] == expected
        late = [5000 + t for t in range(400)]
        for ref in chunk_keys(late, batched.ctx.key_space, 16):
            batched.loop.call(store.put, ref.key, b"x")
        assert batched.get_num_new_matched_tokens(_Request("e", late), 0)[0] < ks["a"]  # they still load
        batched.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=KVRestoreWorkerMetadata(loaded=set(sent)))
        )
        assert batched.get_num_new_matched_tokens(_Request("e", late), 0)[0] == ks["a"]  # the link is free
    finally:
        alone.shutdown()
        batched.shutdown()


def test_each_split_knows_the_room_the_step_has_left():
    """vLLM computes at most its token budget in a step (here 450 tokens): each split of a pass plans
    with what the requests before it left of it; one that would find the step full (its suffix
    computed only after every load of the step) waits for the next pass, where it is planned with what
    the requests scheduled carry into it (the rest of a prompt vLLM cut, one token for a request that
    decodes), and never waits twice."""
    store = MemoryStore()
    prompts = {r: [1000 * i + t for t in range(400)] for i, r in enumerate("abc")}
    side = _costed_side(store, True, step_tokens=450)
    try:
        for ref in (ref for t in prompts.values() for ref in chunk_keys(t, side.ctx.key_space, 16)):
            side.loop.call(store.put, ref.key, b"x")
        ks = {r: side.get_num_new_matched_tokens(_Request(r, t), 0)[0] for r, t in prompts.items()}  # type: ignore[arg-type]
        assert ks["c"] is None and side._reqs["c"].choice is None  # 66 tokens of room left: it waits
        assert side.counters.take()["waited_requests"] == 1
        planned = {r: k for r, k in ks.items() if k is not None}
        room = 450
        for r in planned:
            c = side._reqs[r].choice
            assert c is not None and c.step_new_tokens == min(400 - c.k, max(1, room))
            room -= c.step_new_tokens
        # c weighed waiting behind what a and b spill into the next step
        spill = [side._reqs[r].choice for r in planned]
        assert side.queue.later("c") == pytest.approx(
            (sum(c.later_s for c in spill), sum(c.later_tokens for c in spill))  # type: ignore[union-attr]
        )
        # the step ran: a and b computed what fit; the next pass starts with their rest
        cost = side.ctx.costs.step_cost()
        assert cost is not None
        n_new = {r: side._reqs[r].choice.step_new_tokens for r in planned}  # type: ignore[union-attr]
        steps = [(r, n_new[r], planned[r]) for r in planned]
        # what the step's requests carry into the next one, as `build_connector_meta` counts it
        running = [(400, computed + n) for _, n, computed in steps]
        carry_s, carry_tokens = carried(running, cost, side.ctx.step_tokens)
        rests = {r: 400 - planned[r] - n_new[r] for r in planned}
        assert carry_tokens == sum(n if n > 0 else 1 for n in rests.values())
        expected = sum(
            cost.seconds(n, 400 - n) if n > 0 else cost.seconds(1, 400) - cost.fixed_s for n in rests.values()
        )
        assert carry_s == pytest.approx(expected)
        output = _output(side, list(planned), planned)  # type: ignore[arg-type]
        output.num_scheduled_tokens = n_new  # type: ignore[attr-defined]
        side.build_connector_meta(output)  # type: ignore[arg-type]
        assert side.queue.ahead("c")[1:] == pytest.approx((carry_s, carry_tokens))
        side.queue.finished(planned)  # the worker reported the step's loads finished
        k = side.get_num_new_matched_tokens(_Request("c", prompts["c"]), 0)[0]  # type: ignore[arg-type]
        c = side._reqs["c"].choice
        assert k is not None and c is not None and c.k == k and c.wait_s is None  # it waits once at most
        assert c.step_new_tokens == min(400 - c.k, max(1, 450 - carry_tokens))
        assert c.compute_ahead_s == pytest.approx(carry_s)
        assert side.counters.take()["hit_tokens"] == 392  # counted once, when planned
    finally:
        side.shutdown()


def _gathering(monkeypatch: pytest.MonkeyPatch) -> tuple[SchedulerSide, list[float], dict, Any, Any]:
    """A scheduler side that gathers for 0.05 s on a clock the test moves (`clock[0]`), with two stored
    400-token prompts "a" and "b" (`prompts`); `ask(r)` asks it about prompt r, `end_pass()` ends a
    scheduling pass that scheduled nothing."""
    from kvrestore.integrations.vllm import scheduler as vllm_scheduler

    clock = [100.0]
    monkeypatch.setattr(vllm_scheduler.time, "monotonic", lambda: clock[0])
    prompts = {r: [1000 * i + t for t in range(400)] for i, r in enumerate("ab")}
    side = _costed_side(MemoryStore(), True, step_tokens=450, gather_s=0.05)
    for ref in (ref for t in prompts.values() for ref in chunk_keys(t, side.ctx.key_space, 16)):
        side.loop.call(side.store.put, ref.key, b"x")

    def ask(r: str) -> int | None:
        return side.get_num_new_matched_tokens(_Request(r, prompts[r]), 0)[0]  # type: ignore[arg-type]

    def end_pass() -> None:
        side.build_connector_meta(_output(side, [], {}))  # type: ignore[arg-type]

    return side, clock, prompts, ask, end_pass


def test_requests_arriving_together_are_gathered_and_planned_as_one_pass(monkeypatch):
    """On an idle engine, new requests are answered "ask again" (None) for `gather_s`, so the ones
    arriving together are all known when the first is planned: it plans with the others after it
    (`choose_split_ahead`), and the pass ends sooner than with each split planned best alone. Gathering
    stops at `gather_s` after the first request of the gathering; it is counted once per request, and a
    request is never gathered behind a load, nor under `"batch": false`."""
    from kvrestore.integrations.vllm import scheduler as vllm_scheduler
    from kvrestore.planning.split import Follower, pass_end_s

    side, clock, prompts, ask, end_pass = _gathering(monkeypatch)
    store = side.store
    try:
        assert ask("a") is None  # gathered
        end_pass()
        clock[0] += 0.03
        assert ask("a") is None and ask("b") is None  # b arrived 0.03 s later: it joins a's gathering
        end_pass()
        clock[0] += 0.01
        assert ask("a") is None and ask("b") is None  # still within 0.05 s of the first
        end_pass()
        clock[0] += 0.02  # 0.06 s after a, 0.03 s after b: the gathering is planned, b with a
        assert side.counters.take().get("gathered_requests", 0) == 0  # counted once planned
        ka = ask("a")
        a = side._reqs["a"].choice
        assert ka is not None and a is not None and "1 request after it" in a.reason
        kb = ask("b")
        b = side._reqs["b"].choice
        assert kb is not None and b is not None and "planned:" in b.reason  # none after it
        assert side.counters.take()["gathered_requests"] == 2
        # planned together, the pass ends sooner than with a split best alone first
        args = dict(
            n_tokens=400,
            chunk_ends=side._reqs["a"].ends(),
            chunk_size=16,
            block_size=BLOCK,
            bytes_per_token=side.ctx.stored_bytes_per_token,
            num_layers=L,
            link=side.ctx.prior_link(),
            compute=side.ctx.costs.step_cost(),
            step_tokens=450,
            next_step_tokens=450,
            may_wait=True,
        )
        follower = [Follower(400, side._reqs["b"].ends())]
        alone = vllm_scheduler.choose_split_ahead([], **args)
        assert pass_end_s(a, follower, **args) < pass_end_s(alone, follower, **args)
        assert b.predicted_s == pytest.approx(pass_end_s(a, follower, **args))
        # a third arriving while a and b load is planned at once: asking again would cost a step
        prompts["c"] = [3000 + t for t in range(400)]
        for ref in chunk_keys(prompts["c"], side.ctx.key_space, 16):
            side.loop.call(store.put, ref.key, b"x")
        assert ask("c") is not None or side._reqs["c"].waited
        assert side.counters.take().get("gathered_requests", 0) == 0
    finally:
        side.shutdown()
    alone_side = _costed_side(MemoryStore(), False, step_tokens=450, gather_s=0.05)
    try:
        for ref in chunk_keys(prompts["a"], alone_side.ctx.key_space, 16):
            alone_side.loop.call(alone_side.store.put, ref.key, b"x")
        assert alone_side.get_num_new_matched_tokens(_Request("a", prompts["a"]), 0)[0] is not None  # type: ignore[arg-type]
    finally:
        alone_side.shutdown()


def test_a_gathering_closes_for_every_request_of_a_pass_at_once(monkeypatch):
    """The window of `gather_s` is judged once per scheduling pass (at its first question): a pass whose
    questions straddle the window's end (a host that stalls between them) answers all of them the same,
    so the requests gathered together are planned in one pass, never the later one alone first."""
    side, clock, _, ask, end_pass = _gathering(monkeypatch)
    try:
        assert ask("a") is None and ask("b") is None  # both gathered
        end_pass()
        clock[0] += 0.04
        assert ask("a") is None  # within the window
        clock[0] += 0.02  # the host stalls: the window ends between the pass's two questions
        assert ask("b") is None  # the pass's time is its first question's: still gathering
        end_pass()
        clock[0] += 0.01
        ka, kb = ask("a"), ask("b")  # the next pass plans both, a knowing b comes after it
        a = side._reqs["a"].choice
        assert ka is not None and kb is not None and a is not None and "1 request after it" in a.reason
    finally:
        side.shutdown()


def test_loads_that_share_a_step_are_one_sample_of_the_link_and_reported_finished():
    """Two requests load in one step: they share the link, so the book learns one sample (their bytes
    over the longer load), not two slow ones; the worker reports both loads over (the scheduler's
    `LinkQueue` frees the link)."""
    store = MemoryStore()
    side = worker(store)
    meta = KVRestoreConnectorMetadata()
    try:
        for i, req in enumerate("ab"):
            (ref,) = chunk_keys(list(range(100 * i, 100 * i + 16)), SPEC.fingerprint, CHUNK)
            blob = codec.encode_chunk(KVChunk(0, torch.randn(L, 2, H, 16, D)), SPEC, ref.key)
            side.io.call(store.put, ref.key, blob)
            meta.loads.append(LoadSpec(req, [ref], 16, [2 * i, 2 * i + 1]))
            meta.steps.append((req, 1, 16))
        step(side, meta)
        counts = side.take_counts()
        assert counts["loads"] == 2 and counts["load_failures"] == 0
        ((nbytes, seconds),) = side.costs.state.links[side.ctx.link_key]
        assert nbytes == counts["loaded_bytes"] and seconds > 0
        assert side.build_connector_worker_meta().loaded == {"a", "b"}  # type: ignore[union-attr]
        assert side.build_connector_worker_meta() is None  # reported once
    finally:
        side.io.close()


def test_the_step_budget_is_vllm_s_where_it_chunks_prompts():
    """The connector plans with the token budget of vLLM's own scheduler config where vLLM cuts long
    prompts across steps, and with none where it does not (a prompt then waits for a step with room)."""
    from vllm.config import SchedulerConfig

    from kvrestore.integrations.vllm import step_tokens

    config = SchedulerConfig.default_factory(max_num_batched_tokens=1536, enable_chunked_prefill=True)
    assert step_tokens(config) == 1536
    config.enable_chunked_prefill = False
    assert step_tokens(config) is None


def test_a_step_of_several_requests_is_learned_as_one_pass():
    """The worker times every forward pass: a step that computed several requests and loaded nothing is
    one sample of their tokens and attention pairs (`CostLearner.observe_pass`); one that loaded beside
    them is not (its compute shared the host with the reads)."""
    store = MemoryStore()
    side = worker(store)
    try:
        meta = KVRestoreConnectorMetadata()
        meta.steps.extend([("a", 24, 0), ("b", 8, 40), ("c", 0, 8)])  # c scheduled, nothing to compute
        step(side, meta)
        assert side.costs.state.steps == []
        ((n, pairs, seconds),) = side.costs.state.passes
        assert n == 32 and pairs == 24 * 12 + 8 * 44 and seconds > 0
        (ref,) = chunk_keys(list(range(16)), SPEC.fingerprint, CHUNK)
        side.io.call(
            store.put, ref.key, codec.encode_chunk(KVChunk(0, torch.randn(L, 2, H, 16, D)), SPEC, ref.key)
        )
        loading = KVRestoreConnectorMetadata()
        loading.loads.append(LoadSpec("d", [ref], 16, [0, 1]))
        loading.steps.extend([("d", 16, 16), ("e", 24, 0)])
        step(side, loading)
        assert len(side.costs.state.passes) == 1 and side.costs.state.steps == []
    finally:
        side.io.close()


@pytest.mark.parametrize("head_checks", [True, False])
def test_a_tp2_rank_reads_only_its_head_of_whole_chunks(head_checks):
    """Rank 1 of a tp-2 engine over chunks a tp-1 engine (or a `Restorer`) saved whole: its cross-layout
    load reads each chunk's header probe and, where the chunk has per-head checks (format 6), only its
    head's keys and values, half the KV, each head verified; a format-4 chunk whole per layer. Its
    pages hold its head's KV either way."""
    spec = ModelSpec("m", 2, 2, 64, 100, torch.float32, "f" * 32)
    chunk, block, n = 64, 16, 128
    config = ConnectorConfig.from_extra({"store_url": "memory://"})
    ctx = ConnectorContext(config, spec, block, CostLearner(spec), tp=2)
    store = MemoryStore()
    side = WorkerSide(ctx, store=store, saver=Saver(), rank=(1, 0))  # type: ignore[arg-type]
    side.register_kv_caches(
        {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 16, block, 1, 64) for i in range(2)}
    )
    refs = chunk_keys(list(range(n)), spec.fingerprint, chunk)
    kv = torch.randn(2, 2, 2, n, 64)
    blobs = [
        codec.encode_chunk(
            KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()), spec, r.key, head_checks=head_checks
        )
        for r in refs
    ]
    for r, blob in zip(refs, blobs, strict=True):
        side.io.call(store.put, r.key, blob)
    meta = KVRestoreConnectorMetadata()
    meta.loads.append(LoadSpec("a", refs, n, list(range(8)), layout=(whole(spec),)))
    try:
        step(side, meta)
        assert side.get_block_ids_with_load_errors() == set()
        for layer in range(2):  # flash_attn pages: [2, blocks, block_size, 1, D]; blocks 0-7
            pages = side._caches[layer][:, :8].reshape(2, n, 1, 64).transpose(1, 2)
            assert torch.equal(pages, kv[layer, :, 1:2])
        share = len(refs) * 2 * 2 * chunk * 64 * 4  # its head's keys and values of each layer and chunk
        body = sum(len(b) - codec.read_header(b)[0].layers[0].offset for b in blobs)  # the sections
        assert body == 2 * share
        loaded = side.take_counts()["loaded_bytes"]
        assert loaded == len(refs) * codec.HEADER_PROBE + (share if head_checks else body)
    finally:
        side.io.close()
