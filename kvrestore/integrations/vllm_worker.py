"""The worker side of the vLLM connector (`kvrestore.integrations.vllm.KVRestoreConnector`), and the
metadata its scheduler side sends it each step.

The worker registers vLLM's paged KV caches (and works out their layout), starts each step's loads layer by
layer in the background (`vllm_io.LayerLoad`), waits only for the layer about to run, copies computed
chunks out of the pages for the saver, and reports blocks that did not load so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.streams import HostEvent, on_stream, timing_event
from kvrestore.integrations.vllm_io import ChunkSaver, IOThread, LayerLoad, LoadChunk
from kvrestore.integrations.vllm_layout import blocks_of, gather_chunk, kv_views, scatter_tokens
from kvrestore.integrations.vllm_plan import ConnectorConfig, CostBook
from kvrestore.stores.base import ChunkStore

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata

log = logging.getLogger("kvrestore.vllm")


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


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class WorkerSide:
    """The connector's worker-side calls (a mixin of `KVRestoreConnector`, whose constructor sets the
    state below; `_get_connector_metadata` and `has_connector_metadata` are vLLM's base class's)."""

    spec: ModelSpec
    config: ConnectorConfig
    store: ChunkStore
    io: IOThread
    costs: CostBook
    saver: ChunkSaver
    link_key: str
    block_size: int
    _caches: list[torch.Tensor]
    _layer_of: dict[str, int]
    _layout: str
    _loads: list[tuple[LoadSpec, LayerLoad]]
    _load_errors: set[int]
    _failed_chunks: dict[str, set[int]]
    _errors_lock: threading.Lock
    _bound_at: float | None
    _waited_s: float
    _load_stream: torch.cuda.Stream | None
    _layer_placed: dict[int, torch.cuda.Event]
    _step_start: torch.cuda.Event | HostEvent
    _timed_steps: deque[tuple[int, int, torch.cuda.Event | HostEvent, torch.cuda.Event | HostEvent, float]]
    _get_connector_metadata: Any
    has_connector_metadata: Any

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
        # on CUDA the pages are written on a stream of the connector's own, ordered on the device against
        # vLLM's (which need not be the default stream, and does not sync with it)
        self._load_stream = torch.cuda.Stream(first.device) if first.is_cuda else None
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
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]  # vLLM's base, next in the MRO
        self._bound_at = time.perf_counter()
        self._waited_s = 0.0
        self._step_start = self._mark()

    def _mark(self) -> torch.cuda.Event | HostEvent:
        """Now, on vLLM's current stream: on CUDA the host only launches a step's kernels, so its compute
        is timed by the device (the host's clock off CUDA, or before the caches are known)."""
        device = self._caches[0].device if self._caches else torch.device("cpu")
        event = timing_event(device)
        event.record(torch.cuda.current_stream(device) if device.type == "cuda" else None)
        return event

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRestoreConnectorMetadata)
        if meta.loads and self._load_stream is not None:  # the pages are written after what vLLM queued
            self._load_stream.wait_stream(torch.cuda.current_stream(self._caches[0].device))
        for spec in meta.loads:
            load = LayerLoad(self.spec, self.store, spec.chunks, spec.k, self._placer(spec.block_ids))
            load.start(self.io, self.config.load_timeout_s)
            self._loads.append((spec, load))

    def _placer(self, block_ids: list[int]) -> Any:
        H, D = self.spec.num_kv_heads, self.spec.head_dim

        def place(layer: int, data: torch.Tensor) -> None:
            stream = self._load_stream
            with on_stream(stream):
                scatter_tokens(self._caches[layer], self._layout, block_ids, 0, data, H, D)
                if stream is not None:  # the newest for the layer covers every load's copies of it
                    placed = torch.cuda.Event()
                    placed.record(stream)
                    self._layer_placed[layer] = placed

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
        placed = self._layer_placed.get(layer)
        if placed is not None:  # vLLM's stream runs the layer once its pages are written
            torch.cuda.current_stream(self._caches[layer].device).wait_event(placed)
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
        failed = self._finish_loads()
        if elapsed is not None and len(meta.steps) == 1 and meta.steps[0][1] > 0 and not failed:
            # a step that loaded computed while it did not wait for a layer: a sample with a past, which
            # steps from scratch never give (the split's suffix is computed after a loaded prefix)
            _, n_new, past = meta.steps[0]
            self._timed_steps.append((n_new, past, self._step_start, self._mark(), self._waited_s))
        self._add_timed_steps()
        for spec in meta.saves:
            if spec.req_id in failed:  # computed this step over KV that did not load: wrong, not saved
                log.info(
                    "kvrestore: request %s: %d chunks not saved (computed over a failed load; saved once recomputed)",
                    spec.req_id,
                    len(spec.chunks),
                )
                continue
            self._save(spec)

    def _add_timed_steps(self) -> None:
        """Learn from the timed steps that have completed on the device (never waits for one)."""
        while self._timed_steps and self._timed_steps[0][3].query():
            n_new, past, start, end, waited = self._timed_steps.popleft()
            self.costs.add_compute(n_new, past, max(0.0, start.elapsed_time(end) / 1e3 - waited))  # type: ignore[arg-type]

    def _finish_loads(self) -> set[str]:
        """Settle the step's loads (a load still running is cancelled): note the blocks and chunks that
        did not load, learn the link's cost from those that did. Returns the requests whose load failed."""
        failed: set[str] = set()
        for spec, load in self._loads:
            load.cancel("the step ended")  # a no-op for a load that finished
            bad = [
                b for a, e in load.failed_ranges() for b in blocks_of(spec.block_ids, a, e, self.block_size)
            ]
            if bad:
                failed.add(spec.req_id)
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
        if self._loads and self._load_stream is not None:  # every load is settled: vLLM's stream goes on
            vllm_stream = torch.cuda.current_stream(self._caches[0].device)  # after every page they wrote
            vllm_stream.wait_stream(self._load_stream)
        self._layer_placed.clear()
        self._loads.clear()
        return failed

    def _save(self, spec: SaveSpec) -> None:
        """Copy each chunk out of the pages, behind the step's kernels on vLLM's stream (so before vLLM
        can reuse the pages), and hand it to the saver. On CUDA the copy goes to pinned memory and the
        host does not wait for it: the saver's thread does, before it encodes."""
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        for c in spec.chunks:
            nbytes = self.spec.kv_bytes_per_token * (c.end - c.start)
            if not self.saver.reserve(c.key, nbytes):  # dropped: not even copied out
                continue
            try:
                data = gather_chunk(self._caches, self._layout, spec.block_ids, c.start, c.end, H, D)
                ready = None
                if data.is_cuda:
                    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                    host.copy_(data, non_blocking=True)  # padded pages cut on the device first
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(data.device))
                    data = host
                else:
                    data = data.contiguous()  # its own memory, as the saver wants it
            except BaseException:
                self.saver.unreserve(nbytes)
                raise
            self.saver.submit_reserved(c.key, KVChunk(c.start, data), ready)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._failed_chunks:
            return None
        meta, self._failed_chunks = KVRestoreWorkerMetadata(self._failed_chunks), {}
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors
