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
fingerprint) and `vllm_io` (background I/O); this module is the glue to vLLM's interface.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.keys import ChunkRef, chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.integrations.vllm_io import STORE_FAULTS, ChunkSaver, IOThread, LayerLoad, LoadChunk
from kvrestore.integrations.vllm_layout import blocks_of, gather_tokens, kv_views, scatter_tokens
from kvrestore.integrations.vllm_plan import (
    ConnectorConfig,
    CostBook,
    SplitChoice,
    checkpoint_fingerprint,
    choose_split,
    model_spec,
)
from kvrestore.stores import ThrottledStore, open_store
from kvrestore.stores.base import ChunkStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
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
class LoadSpec:
    req_id: str
    chunks: list[LoadChunk]
    k: int
    block_ids: list[int]


@dataclass
class SaveSpec:
    req_id: str
    chunks: list[LoadChunk]
    block_ids: list[int]


@dataclass
class KVRestoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: (req_id, new tokens, tokens already computed) of every request in the step: what compute costs
    steps: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class KVRestoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per request, the chunks that did not load (vLLM recomputes them; the
    scheduler side then saves them again)."""

    failed: dict[str, set[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVRestoreWorkerMetadata):
            for req_id, chunks in other.failed.items():
                self.failed.setdefault(req_id, set()).update(chunks)
        return self


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


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class KVRestoreConnector(KVConnectorBase_V1):
    """A vLLM KV connector that saves and loads prompts' KV through a kvrestore store (module docs)."""

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

    # -- worker side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)

        def index(name: str) -> int:
            m = _LAYER_INDEX.search(name)
            return int(m.group(1)) if m else names.index(name)

        ordered = sorted(names, key=index)
        if len(ordered) != self.spec.num_layers:
            raise UnsupportedModelError(
                f"vLLM has {len(ordered)} KV cache layers, the model config says {self.spec.num_layers}"
            )
        self._layer_of = {name: i for i, name in enumerate(ordered)}
        self._caches = [kv_caches[name] for name in ordered]
        first = self._caches[0]
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        if self.config.layout is not None:
            self._layout = self.config.layout
        elif first.dim() == 4 and first.shape[1] == H and first.shape[3] == 2 * D:
            # the CPU backend keeps a page's keys, then its values; CUDA backends one token's K then V
            self._layout = "cpu" if first.device.type == "cpu" else "cuda"
        elif first.dim() == 5 and first.shape[0] == 2 and tuple(first.shape[3:]) == (H, D):
            self._layout = "flash_attn"
        else:
            raise UnsupportedModelError(
                f"unknown vLLM KV cache layout {tuple(first.shape)} for {H} heads of {D}; "
                "set kv_connector_extra_config['layout']"
            )
        kv_views(first, self._layout, H, D)  # checks the shape
        if self._layout == "cpu":
            self._check_cpu_kernels(int(first.shape[2]))
        log.info("kvrestore: %d KV layers, layout %s %s", len(ordered), self._layout, tuple(first.shape))

    def _check_cpu_kernels(self, block_size: int) -> None:
        """The "cpu" layout is that of vLLM's portable CPU kernels ("vec"); AMX, NEON and the others keep
        their pages their own way."""
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        except ImportError:  # another vLLM: trust the layout
            return
        isa = _get_attn_isa(self.spec.dtype, block_size, self.spec.head_dim)
        if isa != "vec":
            raise UnsupportedModelError(
                f"vLLM's CPU attention uses its {isa!r} kernels here; kvrestore reads and writes the pages of its "
                "'vec' kernels only (fp32, or bf16 without AMX, on x86, with block sizes a multiple of 32)"
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bound_at = time.perf_counter()
        self._waited_s = 0.0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRestoreConnectorMetadata)
        for spec in meta.loads:
            load = LayerLoad(self.spec, self.store, spec.chunks, spec.k, self._placer(spec.block_ids))
            load.start(self.io, self.config.load_timeout_s)
            self._loads.append((spec, load))

    def _placer(self, block_ids: list[int]) -> Any:
        H, D = self.spec.num_kv_heads, self.spec.head_dim

        def place(layer: int, data: torch.Tensor) -> None:
            scatter_tokens(self._caches[layer], self._layout, block_ids, 0, data, H, D)

        return place

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        t = time.perf_counter()
        for spec, load in self._loads:
            if not load.wait(layer):
                log.warning(
                    "kvrestore: request %s: layer %d not loaded within %.1f s: its %d tokens are recomputed",
                    spec.req_id,
                    layer,
                    self.config.load_timeout_s,
                    spec.k,
                )
        self._waited_s += time.perf_counter() - t

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # chunks are copied out whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRestoreConnectorMetadata)
        elapsed = time.perf_counter() - self._bound_at if self._bound_at is not None else None
        if meta.loads and elapsed is not None:
            log.info("kvrestore: a step that loaded %d requests took %.3f s", len(meta.loads), elapsed)
        failed = any(load.failed for _, load in self._loads)
        self._finish_loads()
        if elapsed is not None and len(meta.steps) == 1 and meta.steps[0][1] > 0 and not failed:
            # a step that loaded computed while it did not wait for a layer: a sample with a past, which
            # steps from scratch never give (the split's suffix is computed after a loaded prefix)
            _, n_new, past = meta.steps[0]
            self.costs.add_compute(n_new, past, elapsed - self._waited_s)
        for spec in meta.saves:
            self._save(spec)

    def _finish_loads(self) -> None:
        for spec, load in self._loads:
            load.cancel("the step ended")  # a no-op for a load that finished
            bad = [
                b for a, e in load.failed_ranges() for b in blocks_of(spec.block_ids, a, e, self.block_size)
            ]
            if bad:
                with self._errors_lock:
                    self._load_errors.update(bad)
                self._failed_chunks.setdefault(spec.req_id, set()).update(load.failed)
                log.warning(
                    "kvrestore: request %s: %d of %d chunks did not load (%s); vLLM recomputes from token %d",
                    spec.req_id,
                    len(load.failed),
                    len(load.chunks),
                    "; ".join(load.errors[:3]),
                    min(a for a, _ in load.failed_ranges()),
                )
            elif load.seconds is not None:
                self.costs.add_load(self.link_key, load.bytes_read, load.seconds)
                log.info(
                    "kvrestore: request %s: loaded %d tokens (%d bytes) in %.3f s",
                    spec.req_id,
                    spec.k,
                    load.bytes_read,
                    load.seconds,
                )
        self._loads.clear()

    def _save(self, spec: SaveSpec) -> None:
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        for c in spec.chunks:
            data = torch.stack(
                [
                    gather_tokens(cache, self._layout, spec.block_ids, c.start, c.end, H, D)
                    for cache in self._caches
                ]
            ).to("cpu")
            self.saver.submit(c.key, KVChunk(c.start, data))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._failed_chunks:
            return None
        meta, self._failed_chunks = KVRestoreWorkerMetadata(self._failed_chunks), {}
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

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
