"""The KV connector class vLLM makes (`KVRestoreConnector`), one per process and role, and its stats.

Each computed chunk of a prompt is saved in the background, under the key a `Restorer` computes for the
same tokens and checkpoint (one store, shared both ways); past `save_queue_bytes` waiting, a chunk is
dropped and counted, so saving never stalls a step. A new prompt is looked up (a bounded wait: a store
that is down means zero tokens, with a warning) and split (`planning.split`: load [0, k) layer by layer
while vLLM computes [k, n), from the measured costs and the loads queued on the link). A chunk missing,
corrupt or of another model goes to `get_block_ids_with_load_errors`: vLLM recomputes it (the connector
sets `kv_load_failure_policy` to "recompute" unless `on_load_error` is "fail"). Hits, bytes, faults,
saves and splits are counted in vLLM's KV connector stats (`KVRestoreStats`, ``vllm:kvrestore_*`` in
Prometheus) and logged with structured records (`stats.records`). docs/tutorial-vllm.md has it all.

As vLLM's OffloadingConnector, it is split by role: a `SchedulerSide` (`scheduler`) or a `WorkerSide`
(`worker`), telling each other `meta`'s metadata. This module is the glue to vLLM.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.fingerprint import of_checkpoint
from kvrestore.core.spec import ModelSpec
from kvrestore.integrations.vllm.config import (
    ConnectorConfig,
    ConnectorContext,
    check_shared_memory,
    parallel_sizes,
    preflight,
)
from kvrestore.integrations.vllm.meta import KVRestoreConnectorMetadata
from kvrestore.integrations.vllm.scheduler import SchedulerSide
from kvrestore.integrations.vllm.stats import COUNTERS, emit, log_through, records, sum_counts
from kvrestore.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVRestoreConnector", "KVRestoreConnectorMetadata", "KVRestoreStats", "flush_saves", "records"]

_WORKERS: weakref.WeakSet[WorkerSide] = weakref.WeakSet()
_FLUSH_AT_EXIT_S = 60.0


def flush_saves(timeout: float | None = 60.0) -> bool:
    """Wait until every chunk this process's connectors queued is written; False if some were still
    being written after `timeout` seconds. For a script that reads the store right after vLLM served a
    prompt, or before it exits. An engine core in another process (on a GPU, by default) flushes its
    connectors as it shuts down."""
    return all(w.saver.flush(timeout) for w in list(_WORKERS))


def step_tokens(scheduler_config: Any) -> int | None:
    """vLLM's token budget for one step where it chunks long prompts across steps; None where it does not
    (a prompt then waits for a step with room)."""
    if not getattr(scheduler_config, "enable_chunked_prefill", False):
        return None
    budget = getattr(scheduler_config, "max_num_scheduled_tokens", None)
    return int(budget or scheduler_config.max_num_batched_tokens)


def parallel_rank(tp: int, pp: int) -> tuple[int, int]:
    """This worker's (tensor-parallel rank, pipeline stage), from vLLM's process groups."""
    if tp == 1 and pp == 1:
        return 0, 0
    from vllm.distributed import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    stage = parallel_state.get_pp_group().rank_in_group if pp > 1 else 0
    return int(rank), int(stage)


def _checked_config(vllm_config: VllmConfig) -> ConnectorConfig:
    """The connector's checked config (`check_shared_memory` included); the ``kvrestore`` logger's lines
    go to vLLM's log (`log_through`)."""
    log_through(logging.getLogger("vllm"))
    tc = vllm_config.kv_transfer_config
    config = ConnectorConfig.from_extra(tc.kv_connector_extra_config if tc is not None else None)
    pc = vllm_config.parallel_config
    check_shared_memory(config, pc.distributed_executor_backend, pc.world_size)
    return config


class KVRestoreStats(KVConnectorStats):
    """The connector's counters (`stats.COUNTERS`) as vLLM's KV connector stats: sums, from the
    scheduler and every worker, over an interval."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = sum_counts(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVRestorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter: ``vllm:kvrestore_<name>``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, what in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:kvrestore_{name}", documentation=f"kvrestore: {what}", labelnames=labelnames
            )
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in self.per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in transfer_stats_data.items():
            if name in self.counters and n:
                self.counters[name][engine_idx].inc(n)


class KVRestoreConnector(KVConnectorBase_V1):
    """A vLLM KV connector that saves and loads prompts' KV through a kvrestore store (module docs). It
    forwards vLLM's calls to the side of its role (`scheduler` or `worker`, the other is None)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = _checked_config(vllm_config)
        mc = vllm_config.model_config
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        if cache_dtype in ("fp8", "fp8_e4m3"):  # its pages are stored as fp8 chunks, as they are
            if config.kv_encoding != "fp8":
                raise UnsupportedModelError(
                    f"vLLM runs an fp8 KV cache (kv_cache_dtype={cache_dtype!r}): set "
                    "kv_connector_extra_config['kv_encoding'] = 'fp8'"
                )
        elif cache_dtype != "auto" and cache_dtype != str(mc.dtype).removeprefix("torch."):
            raise UnsupportedModelError(
                f"kvrestore stores KV in the model's dtype or as fp8 e4m3; kv_cache_dtype={cache_dtype!r}"
            )
        fp = config.fingerprint or of_checkpoint(mc.model, mc.dtype)  # as HFBackend.from_pretrained's
        spec = ModelSpec.from_hf_config(mc.hf_config, mc.dtype, fp, name=str(mc.model))
        tp, pp, host_ranks = parallel_sizes(vllm_config.parallel_config, spec)
        self.ctx = ConnectorContext.make(
            config,
            spec,
            vllm_config.cache_config.block_size,
            step_tokens(vllm_config.scheduler_config),
            tp,
            pp,
            host_ranks,
        )
        self.config, self.spec = config, spec
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.ctx)
            # read by vLLM's scheduler after this
            self._kv_transfer_config.kv_load_failure_policy = config.on_load_error
        else:
            self.worker = WorkerSide(self.ctx, rank=parallel_rank(tp, pp))
            if not _WORKERS:  # a script that exits right after generating still writes what it queued
                atexit.register(flush_saves, _FLUSH_AT_EXIT_S)
            _WORKERS.add(self.worker)
        emit(
            logging.INFO,
            "started",
            "connector (%(role)s): store %(store)s, chunks of %(chunk_size)d tokens (%(kv_encoding)s), "
            "split %(split)s, model %(model)s (fingerprint %(fingerprint)s)",
            role=role.name.lower(),
            store=config.store_url,
            chunk_size=config.chunk_size,
            kv_encoding=config.kv_encoding,
            split=config.split,
            model=spec.name,
            fingerprint=fp[:12],
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes where it loads: the replay of a full CUDA graph skips the per-layer waits
        (`wait_for_layer_load`); piecewise graphs run them between the pieces. vLLM asks this (where it
        would capture full CUDA graphs) before any process starts: the config and a local store are
        checked here too."""
        config = ConnectorConfig.from_extra(extra_config)
        preflight(config)
        return config.load

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: the connector takes vLLM's layout as it is (`layouts`).

        vLLM asks this once the weights are loaded, before it profiles memory, compiles and warms the
        model up (most of a start-up on a CPU) and makes any connector: a configuration error (an
        unknown key, an unusable directory, a ``memory://`` store two processes cannot share) stops the
        server here."""
        preflight(_checked_config(vllm_config))
        return None

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler call to a worker's connector"
        return self.scheduler

    def _worker(self) -> WorkerSide:
        assert self.worker is not None, "a worker call to the scheduler's connector"
        return self.worker

    # -- scheduler side ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    # -- worker side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # each attention layer's K and V scale: what an fp8 cache's values are multiplied by
        layers = self._vllm_config.compilation_config.static_forward_context
        scales = {
            name: (
                float(getattr(layers.get(name), "_k_scale_float", 1.0)),
                float(getattr(layers.get(name), "_v_scale_float", 1.0)),
            )
            for name in kv_caches
        }
        self._worker().register_kv_caches(kv_caches, scales)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker().bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker().clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # chunks are copied out whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def build_connector_worker_meta(self) -> Any:
        return self._worker().build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    # -- both ----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.scheduler or self.worker
        counts = side.take_counts() if isinstance(side, WorkerSide) else self._scheduler().counters.take()
        return KVRestoreStats(data=counts) if any(counts.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVRestoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return KVRestorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
