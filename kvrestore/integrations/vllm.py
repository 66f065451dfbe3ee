"""kvrestore inside vLLM: a KV connector (V1 API) over kvrestore's stores, chunk keys and wire format.

Use it with::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=checkpoint_dir, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
        kv_connector="KVRestoreConnector", kv_connector_module_path="kvrestore.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={"store_url": "/var/cache/kv"}))

What it does:

* Saving. Once a prompt's chunk has been computed, its KV is copied out of vLLM's pages and written in
  the background, in kvrestore's wire format under the key a `Restorer` computes for the same tokens and
  model (`chunk_keys`, with the fingerprint of the same checkpoint and dtype): vLLM and a `Restorer`
  share one store, both ways. At most `save_queue_bytes` of KV wait to be written; past that a chunk is
  dropped and counted, so saving never stalls a step.
* Loading. The scheduler side looks the prompt up (a bounded wait: a store that is down means zero
  tokens, with a warning) and picks the split k (`vllm_plan.choose_split`: load [0, k), compute [k, n),
  both finishing together, from the link and compute costs the connector has measured), logged at INFO
  with its prediction. The worker side loads [0, k) layer by layer in the background
  (`vllm_io.LayerLoad`) while vLLM computes; `wait_for_layer_load` waits only for the layer about to run.
* Faults. A chunk missing, corrupt or of another model when loaded: its blocks go to
  `get_block_ids_with_load_errors` and vLLM recomputes them (the connector sets vLLM's
  `kv_load_failure_policy` to "recompute" unless `on_load_error` is "fail").

The vLLM-free parts are in `vllm_layout` (paged layouts), `vllm_plan` (config, split, learned costs,
fingerprint) and `vllm_io` (background I/O); this module is the glue to vLLM's interface: the connector's
set-up and scheduler side here, its worker side (and the metadata the two exchange) in `vllm_worker`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.keys import ChunkRef, chunk_keys
from kvrestore.core.streams import HostEvent
from kvrestore.integrations.vllm_io import STORE_FAULTS, ChunkSaver, IOThread, LayerLoad, LoadChunk
from kvrestore.integrations.vllm_layout import blocks_of
from kvrestore.integrations.vllm_plan import (
    ConnectorConfig,
    CostBook,
    SplitChoice,
    checkpoint_fingerprint,
    choose_split,
    model_spec,
)
from kvrestore.integrations.vllm_worker import (
    KVRestoreConnectorMetadata,
    KVRestoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
    WorkerSide,
)
from kvrestore.stores import ThrottledStore, open_store
from kvrestore.stores.base import ChunkStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvrestore.vllm")

__all__ = ["KVRestoreConnector", "KVRestoreConnectorMetadata", "flush_saves"]

_LIVE: weakref.WeakSet[KVRestoreConnector] = weakref.WeakSet()


def flush_saves(timeout: float | None = 60.0) -> bool:
    """Wait until every chunk the connectors of this process queued is written (saves run in the
    background); False if some were still being written after `timeout` seconds. For a script that
    reads the store right after vLLM served a prompt (a `Restorer`, a test), or before it exits."""
    return all(c.saver.flush(timeout) for c in list(_LIVE))


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    refs: list[ChunkRef]
    stored: list[bool]
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # chunks before this one are saved or not to be saved
    load_k: int = 0
    need_load: bool = False
    choice: SplitChoice | None = None


class KVRestoreConnector(WorkerSide, KVConnectorBase_V1):
    """A vLLM KV connector that saves and loads prompts' KV through a kvrestore store (module docs).

    This class holds the set-up and the scheduler side; the worker side is `vllm_worker.WorkerSide`.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        mc = vllm_config.model_config
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        if cache_dtype not in ("auto", None) and str(cache_dtype) != str(mc.dtype).removeprefix("torch."):
            raise UnsupportedModelError(
                f"kvrestore stores KV in the model's dtype; kv_cache_dtype={cache_dtype!r}"
            )
        dtype = mc.dtype
        fp = self.config.fingerprint or checkpoint_fingerprint(mc.model, dtype)
        self.spec = model_spec(mc.hf_config, dtype, fp, name=str(mc.model))
        self.block_size = vllm_config.cache_config.block_size
        self.store = self._open_store()
        self.link_key = self._link_key()
        self.costs = CostBook.shared(fp, self.config.cost_dir)
        self.io = IOThread()
        self._down_until = 0.0
        # scheduler side
        self._reqs: dict[str, _Request] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._layout = "cpu"
        self._loads: list[tuple[LoadSpec, LayerLoad]] = []
        self._load_errors: set[int] = set()
        self._failed_chunks: dict[str, set[int]] = {}
        self._errors_lock = threading.Lock()
        self._bound_at: float | None = None
        self._waited_s = 0.0  # this step's time in wait_for_layer_load: the step minus it is compute
        self._load_stream: torch.cuda.Stream | None = None  # set with the caches, on CUDA
        self._layer_placed: dict[int, torch.cuda.Event] = {}
        self._step_start: torch.cuda.Event | HostEvent = HostEvent()  # where the step began, on vLLM's stream
        self._timed_steps: deque = deque(maxlen=16)  # compute samples whose device time is not read yet
        self.saver = ChunkSaver(
            self.spec,
            self.store,
            self.io,
            compression=self.config.compression,
            max_bytes=self.config.save_queue_bytes,
        )
        _LIVE.add(self)
        if role == KVConnectorRole.SCHEDULER:
            tc.kv_load_failure_policy = self.config.on_load_error  # read by the scheduler after this
        log.info(
            "kvrestore connector (%s): store %s, chunks of %d tokens, split %s, model %s (fingerprint %s)",
            role.name.lower(),
            self.config.store_url,
            self.config.chunk_size,
            self.config.split,
            self.spec.name,
            fp[:12],
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes where it loads: its loads are waited for layer by layer (`wait_for_layer_load`), which the
        replay of a full CUDA graph skips; piecewise graphs run the waits between the pieces."""
        return ConnectorConfig.from_extra(extra_config).load

    def _open_store(self) -> ChunkStore:
        store = open_store(self.config.store_url, **dict(self.config.store_options))
        if self.config.throttle_bytes_per_s is not None:
            store = ThrottledStore(
                store, self.config.throttle_bytes_per_s, latency_s=self.config.throttle_latency_s
            )
        return store

    def _link_key(self) -> str:
        t = self.config.throttle_bytes_per_s
        return self.config.store_url + (f"@{t:.0f}B/s+{self.config.throttle_latency_s}s" if t else "")

    # -- scheduler side ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        st = self._reqs.get(request.request_id)
        if st is None:
            refs = chunk_keys(tokens, self.spec.fingerprint, self.config.chunk_size)
            st = self._reqs[request.request_id] = _Request(refs, self._lookup([r.key for r in refs]))
        if not self.config.load:
            return 0, False
        ends = []
        for ref, ok in zip(st.refs, st.stored, strict=True):
            if not ok:
                break
            ends.append(ref.end)
        self.costs.refresh()
        choice = choose_split(
            n_tokens=len(tokens),
            chunk_ends=ends,
            chunk_size=self.config.chunk_size,
            block_size=self.block_size,
            bytes_per_token=self.spec.kv_bytes_per_token,
            num_layers=self.spec.num_layers,
            link=self.costs.link(self.link_key) or self._prior_link(),
            compute=self.costs.compute_cost(),
            mode=self.config.split,
        )
        st.choice = choice
        if ends:
            log.info("kvrestore: request %s: %s", request.request_id, choice.explain())
        if choice.k <= num_computed_tokens:
            return 0, False
        st.load_k = choice.k
        return choice.k - num_computed_tokens, False

    def _prior_link(self) -> Any:
        from kvrestore.costs.links import LinkCost

        bw = self.config.link_bytes_per_s or self.config.throttle_bytes_per_s
        return LinkCost(bw, self.config.throttle_latency_s) if bw else None

    def _lookup(self, keys: list[str]) -> list[bool]:
        """Which chunks are stored; all False (with a warning) if the store does not answer in time."""
        if time.monotonic() < self._down_until:
            return [False] * len(keys)
        try:
            return list(self.io.call(self.store.contains, keys, timeout=self.config.lookup_timeout_s))
        except STORE_FAULTS as exc:
            self._down_until = time.monotonic() + self.config.retry_after_s
            log.warning(
                "kvrestore: store %s did not answer a lookup (%s: %s); computing without it for %.0f s",
                self.config.store_url,
                type(exc).__name__,
                exc or "timeout",
                self.config.retry_after_s,
            )
            return [False] * len(keys)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            st.need_load = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVRestoreConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._step(meta, new.req_id, st, new.num_computed_tokens, sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                st.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            self._step(meta, req_id, st, cached.num_computed_tokens[i], sched.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def _step(
        self, meta: KVRestoreConnectorMetadata, req_id: str, st: _Request, computed: int, n_new: int
    ) -> None:
        meta.steps.append((req_id, n_new, computed))
        if st.need_load:
            st.need_load = False
            covering = [r for r in st.refs if r.start < st.load_k]
            meta.loads.append(
                LoadSpec(
                    req_id,
                    [LoadChunk(r.key, r.start, r.end) for r in covering],
                    st.load_k,
                    list(st.block_ids),
                )
            )
        if not self.config.save or time.monotonic() < self._down_until:
            return  # while the store is down, chunks are not even copied out
        done = computed + n_new
        todo = []
        while st.next_save < len(st.refs) and st.refs[st.next_save].end <= done:
            ref = st.refs[st.next_save]
            if not st.stored[ref.index]:
                todo.append(LoadChunk(ref.key, ref.start, ref.end))
            st.next_save += 1
        if todo:
            meta.saves.append(
                SaveSpec(req_id, todo, blocks_of(st.block_ids, 0, todo[-1].end, self.block_size))
            )

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVRestoreWorkerMetadata):
            return
        for req_id, chunks in meta.failed.items():
            st = self._reqs.get(req_id)
            if st is None or not chunks:
                continue
            for j in chunks:  # deleted by the loader: write them again once vLLM has recomputed them
                st.stored[j] = False
            st.next_save = min(st.next_save, min(chunks))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        for _, load in self._loads:
            load.cancel("shutdown")
        self._loads.clear()
        if not self.saver.flush(timeout=60):
            log.warning("kvrestore: some chunk writes were still running at shutdown")
        if self.saver.dropped or self.saver.failed:
            log.warning(
                "kvrestore: %d chunks saved, %d dropped (queue full), %d failed",
                self.saver.written,
                self.saver.dropped,
                self.saver.failed,
            )
        self.io.close()
