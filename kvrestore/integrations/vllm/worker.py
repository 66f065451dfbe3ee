"""The worker side of the vLLM connector (`kvrestore.integrations.vllm.KVRestoreConnector`): it takes
vLLM's paged KV caches, loads each step's stored tokens layer by layer, waits only for the layer about to
run, copies computed chunks out of the pages for the saver, and reports the blocks that did not load so
vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.kv import KVChunk
from kvrestore.core.streams import HostEvent, on_stream, timing_event
from kvrestore.integrations.vllm.config import ConnectorContext
from kvrestore.integrations.vllm.device import DeviceLayerLoad
from kvrestore.integrations.vllm.io import STORE_FAULTS, ChunkSaver, IOThread
from kvrestore.integrations.vllm.layouts import (
    blocks_of,
    fp8_layer_scales,
    fp8_values,
    gather_chunk,
    kv_views,
    scatter_tokens,
)
from kvrestore.integrations.vllm.load import LayerLoad, Pieces
from kvrestore.integrations.vllm.meta import (
    KVRestoreConnectorMetadata,
    KVRestoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvrestore.integrations.vllm.pages import HostLayer, HostPageLoad, applies
from kvrestore.integrations.vllm.stats import Counters, emit, log
from kvrestore.stores.base import ChunkStore

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class WorkerSide:
    """The connector's worker-role calls, over `ctx`: its own store, I/O thread and saver.

    Loaded layers reach vLLM's pages three ways. On CUDA the I/O thread sends a few layers of every
    chunk up at a time, checks them on the GPU and writes them into the pages on a stream of its own
    (`DeviceLayerLoad`; an fp8 cache's through the host, `LayerLoad`); vLLM's stream waits on the device
    for each layer. On the CPU, from a store that reads without the event loop and chunks saved
    uncompressed and native, the step's thread reads each layer as vLLM asks for it straight into the
    pages (`HostPageLoad`): one copy, no thread of ours beside vLLM's compute threads. Otherwise the I/O
    thread reads in the background and the step's thread writes each layer as vLLM asks for it.
    """

    def __init__(
        self,
        ctx: ConnectorContext,
        store: ChunkStore | None = None,
        io: IOThread | None = None,
        saver: ChunkSaver | None = None,
    ) -> None:
        self.ctx = ctx
        self.spec = ctx.spec
        self.config = ctx.config
        self.costs = ctx.costs
        self.block_size = ctx.block_size
        self.store = store if store is not None else ctx.open_store()
        self.io = io if io is not None else IOThread()
        self.saver = saver or ChunkSaver(
            self.spec,
            self.store,
            self.io,
            compression=self.config.compression,
            max_bytes=self.config.save_queue_bytes,
            encoding=self.config.kv_encoding,
            seal=ctx.seal,
            retry_after_s=self.config.retry_after_s,
        )
        self.counters = Counters()
        self._saver_seen = (0, 0, 0, 0)  # the saver's written, bytes, dropped, failed last reported
        self._caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._layout = "cpu"
        self._meta: KVRestoreConnectorMetadata | None = None
        self._loads: list[tuple[LoadSpec, LayerLoad | DeviceLayerLoad | HostPageLoad]] = []
        self._pending: dict[int, list[tuple[list[int], Pieces]]] = {}  # CPU: layer -> pieces to write
        self._pending_lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._failed_chunks: dict[str, set[int]] = {}
        self._loaded: set[str] = set()  # requests whose loads ended since the last report
        self._errors_lock = threading.Lock()
        self._waited_s = 0.0  # this step's time in wait_for_layer_load: the step minus it is compute
        self._load_stream: torch.cuda.Stream | None = None  # set with the caches, on CUDA
        self._lane: TransferLane | None = None  # `DeviceLayerLoad`'s staging pool and stream, on CUDA
        self._host_layers: list[HostLayer] | None = None  # the caches as `HostPageLoad` writes them
        self._layer_placed: dict[int, torch.cuda.Event] = {}
        self._fp8_scales: torch.Tensor | None = None  # [L, 2] bf16: an fp8 cache's K and V scales
        self._step_start: torch.cuda.Event | HostEvent = HostEvent()  # where the step began, on vLLM's stream
        #: steps whose device time is not read yet: ((n new, past) of each request, start, end, waited,
        #: load seconds or None)
        self._timed_steps: deque[tuple[list[tuple[int, int]], Any, Any, float, float | None]] = deque(
            maxlen=16
        )

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        scales: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """Take vLLM's paged caches (layer name -> tensor) and work out their layout. An fp8 cache (one
        byte an element under a wider model dtype) needs `kv_encoding="fp8"` and each layer's K and V
        scale (`scales`, vLLM's ``_k_scale_float`` and ``_v_scale_float``; 1.0 where not given): its pages
        are saved as the fp8 chunks' values, as they are (`fp8_sections`)."""
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
        self._host_layers = None
        first = self._caches[0]
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        if first.element_size() == 1 and self.spec.dtype.itemsize > 1:  # vLLM's fp8 cache
            if self.config.kv_encoding != "fp8":
                raise UnsupportedModelError(
                    "vLLM runs an fp8 KV cache: set kv_connector_extra_config['kv_encoding'] = 'fp8' "
                    f"(got {self.config.kv_encoding!r}), whose chunks hold its pages as they are"
                )
            self._caches = [c.view(torch.uint8) for c in self._caches]
            first = self._caches[0]
            self._fp8_scales = fp8_layer_scales([(scales or {}).get(name, (1.0, 1.0)) for name in ordered])
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
        if self._load_stream is not None:
            self._lane = TransferLane(StagingPool(pinned=True), self._load_stream)
        if self._layout == "cpu":
            self._check_cpu_kernels(int(first.shape[2]))
        # the keys of native chunks stored as the pages keep them, a tile a page: read back straight
        # into the pages (`HostPageLoad`); every other reader converts them (`codec.layout`)
        self.saver.key_tile = int(first.shape[2]) if self._layout == "cpu" and self._fp8_scales is None else 0
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

    def bind(self, meta: KVConnectorMetadata) -> None:
        """The step's metadata (vLLM binds it before the forward pass)."""
        assert isinstance(meta, KVRestoreConnectorMetadata)
        self._meta = meta
        self._waited_s = 0.0
        self._step_start = self._mark()

    def clear(self) -> None:
        self._meta = None

    def _mark(self) -> torch.cuda.Event | HostEvent:
        """Now, on vLLM's current stream: on CUDA the host only launches a step's kernels, so the device
        times its compute (the host's clock off CUDA, or before the caches are known)."""
        device = self._caches[0].device if self._caches else torch.device("cpu")
        event = timing_event(device)
        event.record(torch.cuda.current_stream(device) if device.type == "cuda" else None)
        return event

    def start_load_kv(self) -> None:
        """Start the step's loads in the background. vLLM's forward context is not needed (its Model
        Runner V2 passes None)."""
        meta = self._meta
        if meta is None or not meta.loads:
            return
        if self._load_stream is not None:  # the pages are written after what vLLM queued
            self._load_stream.wait_stream(torch.cuda.current_stream(self._caches[0].device))
        direct = self._fp8_scales is None and applies(
            self.store, self._layout, self.config.kv_encoding, self.config.compression
        )
        if direct and self._host_layers is None:
            H, D = self.spec.num_kv_heads, self.spec.head_dim
            self._host_layers = [HostLayer(c, H, D) for c in self._caches]
        encoding, seal = self.config.kv_encoding, self.ctx.seal
        for spec in meta.loads:
            what = (self.spec, self.store, spec.chunks, spec.k)
            load: LayerLoad | DeviceLayerLoad | HostPageLoad
            if direct:  # read on this thread as vLLM asks for each layer, straight into the pages
                load = HostPageLoad(*what, self._host_layers or [], spec.block_ids, seal=seal)
            elif self._lane is not None and self._fp8_scales is None:  # CUDA pages: checked on the GPU
                place = self._device_placer(spec.block_ids)
                device = self._caches[0].device
                load = DeviceLayerLoad(*what, place, self._lane, device, encoding=encoding, seal=seal)
            else:
                load = LayerLoad(*what, self._placer(spec.block_ids), encoding=encoding, seal=seal)
            load.start(self.io, self.config.load_timeout_s)
            self._loads.append((spec, load))

    def _placer(self, block_ids: list[int]) -> Callable[[int, Pieces], None]:
        if self._load_stream is None:  # CPU: the step's thread writes the pages (`wait_for_layer_load`)

            def keep(layer: int, pieces: Pieces) -> None:
                with self._pending_lock:
                    self._pending.setdefault(layer, []).append((block_ids, pieces))

            return keep

        def place(layer: int, pieces: Pieces) -> None:
            self._on_load_stream(layer, lambda: self._write(layer, block_ids, pieces))

        return place

    def _device_placer(self, block_ids: list[int]) -> Callable[[int, torch.Tensor], None]:
        """`DeviceLayerLoad`'s `place`: a layer's rows ``[2, H, T, D]``, already on the device, into the
        request's pages (whole pages with one indexed copy for K and one for V)."""
        H, D = self.spec.num_kv_heads, self.spec.head_dim

        def place(layer: int, rows: torch.Tensor) -> None:
            self._on_load_stream(
                layer, lambda: scatter_tokens(self._caches[layer], self._layout, block_ids, 0, rows, H, D)
            )

        return place

    def _on_load_stream(self, layer: int, write: Callable[[], None]) -> None:
        """Run `write` (a layer's pages) on the load stream, then mark the layer placed there: vLLM's
        stream waits for that event before it runs the layer."""
        stream = self._load_stream
        with on_stream(stream):
            write()
            # the newest event for the layer covers every load's copies of it
            placed = torch.cuda.Event()
            placed.record(stream)
            self._layer_placed[layer] = placed

    def _write(self, layer: int, block_ids: list[int], pieces: Pieces) -> None:
        """Write one layer's pieces into its pages, each straight from the bytes read, decoded where the
        pages are if encoded (on CUDA only an fp8 cache's: quantized with the layer's scales there)."""
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        cache = self._caches[layer]
        for p in pieces:
            if self._fp8_scales is not None:
                data = fp8_values(p, self._fp8_scales[layer], cache.device)
            else:
                data = p.kv(cache.device)
            scatter_tokens(cache, self._layout, block_ids, p.start, data, H, D)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        t = time.perf_counter()
        for spec, load in self._loads:
            if not load.wait(layer):
                emit(
                    logging.WARNING,
                    "load_late",
                    "request %(request)s: layer %(layer)d not loaded within %(timeout_s).1f s: "
                    "its %(tokens)d tokens are recomputed",
                    request=spec.req_id,
                    layer=layer,
                    timeout_s=self.config.load_timeout_s,
                    tokens=spec.k,
                )
        # what the loads kept for the layer (CPU); a load cancelled since (late) failed every chunk, so
        # vLLM recomputes those blocks whatever is written
        with self._pending_lock:
            todo = self._pending.pop(layer, [])
        for block_ids, pieces in todo:
            self._write(layer, block_ids, pieces)
        placed = self._layer_placed.get(layer)
        if placed is not None:  # vLLM's stream runs the layer once its pages are written
            torch.cuda.current_stream(self._caches[layer].device).wait_event(placed)
        self._waited_s += time.perf_counter() - t

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        loads = list(self._loads)
        failed = self._finish_loads()
        computed = [(n_new, past) for _, n_new, past in meta.steps if n_new > 0]
        if len(computed) == 1 and not failed:
            # one request computed: a sample of what computing costs, alone or beside a load
            load_s = loads[0][1].seconds if len(loads) == 1 else None
            if not loads or load_s is not None:
                # a load read on this thread (`HostPageLoad`) ran before each layer, not beside it: the
                # step is a sample of computing (less its waits, the reads), not of computing beside one
                beside = load_s if loads and not isinstance(loads[0][1], HostPageLoad) else None
                self._timed_steps.append((computed, self._step_start, self._mark(), self._waited_s, beside))
        elif len(computed) > 1 and not loads:
            # several requests in one forward pass, nothing loaded beside it: a sample of the pass
            self._timed_steps.append((computed, self._step_start, self._mark(), self._waited_s, None))
        self._add_timed_steps()
        for spec in meta.saves:
            if spec.req_id in failed:  # computed this step over KV that did not load: wrong, not saved
                emit(
                    logging.INFO,
                    "not_saved",
                    "request %(request)s: %(chunks)d chunks not saved (computed over a failed load; "
                    "saved once recomputed)",
                    request=spec.req_id,
                    chunks=len(spec.chunks),
                )
                continue
            self._save(spec)

    def _add_timed_steps(self) -> None:
        """Learn from the timed steps the device has completed (never waits for one). Each is a sample of
        compute (its time less its waits for layers; only a step that loaded computes after a long past,
        as a split's suffix does), and one that loaded of computing beside a load (`loading_factor`)."""
        while self._timed_steps and self._timed_steps[0][2].query():
            requests, start, end, waited, load_s = self._timed_steps.popleft()
            seconds = start.elapsed_time(end) / 1e3
            self.costs.observe_pass(requests, max(0.0, seconds - waited))
            if load_s is not None:
                ((n_new, past),) = requests
                self.costs.observe_loading(n_new, past, load_s, seconds, self.spec.num_layers)

    def _finish_loads(self) -> set[str]:
        """Settle the step's loads (cancelling any still running): note the blocks and chunks that did not
        load, learn the link's cost from those that did. Returns the requests whose load failed."""
        failed: set[str] = set()
        moved, longest = 0, 0.0  # the step's loads share the link: one sample, their bytes over the longest
        for spec, load in self._loads:
            load.cancel("the step ended")  # a no-op for a load that finished
            self._loaded.add(spec.req_id)
            ranges = load.failed_ranges()
            bad = [b for a, e in ranges for b in blocks_of(spec.block_ids, a, e, self.block_size)]
            if bad:
                failed.add(spec.req_id)
                with self._errors_lock:
                    self._load_errors.update(bad)
                self._failed_chunks.setdefault(spec.req_id, set()).update(load.failed)
                first = min(a for a, _ in ranges)
                self.counters.add(
                    load_failures=1, failed_chunks=len(load.failed), recomputed_tokens=spec.k - first
                )
                emit(
                    logging.WARNING,
                    "load_failed",
                    "request %(request)s: %(failed)d of %(chunks)d chunks did not load (%(errors)s); "
                    "vLLM recomputes from token %(from_token)d",
                    request=spec.req_id,
                    failed=len(load.failed),
                    chunks=len(load.chunks),
                    errors="; ".join(load.errors[:3]),
                    from_token=first,
                )
            elif load.seconds is not None:
                moved, longest = moved + load.bytes_read, max(longest, load.seconds)
                self.counters.add(loads=1, loaded_tokens=spec.k, loaded_bytes=load.bytes_read)
                emit(
                    logging.INFO,
                    "loaded",
                    "request %(request)s: loaded %(tokens)d tokens (%(bytes)d bytes) in %(seconds).3f s",
                    request=spec.req_id,
                    tokens=spec.k,
                    bytes=load.bytes_read,
                    seconds=load.seconds,
                    blocks=blocks_of(spec.block_ids, 0, spec.k, self.block_size),
                )
        if moved:
            self.costs.observe_load(self.ctx.link_key, moved, longest)
        if self._loads and self._load_stream is not None:  # every load is settled: vLLM's stream goes on
            vllm_stream = torch.cuda.current_stream(self._caches[0].device)  # after every page they wrote
            vllm_stream.wait_stream(self._load_stream)
        with self._pending_lock:
            self._pending.clear()
        self._layer_placed.clear()
        self._loads.clear()
        return failed

    def _save(self, spec: SaveSpec) -> None:
        """Copy each chunk out of the pages behind the step's kernels on vLLM's stream (before vLLM can
        reuse the pages) and hand it to the saver. On CUDA the copy goes to pinned memory; the saver's
        thread, not the host, waits for it before it encodes."""
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
            # an fp8 cache's values are stored as they are, with its scales (the saver's thread lays out
            # the sections)
            self.saver.submit_reserved(
                c.key, KVChunk(c.start, data), nbytes, ready, fp8_scales=self._fp8_scales
            )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._failed_chunks and not self._loaded:
            return None
        meta = KVRestoreWorkerMetadata(self._failed_chunks, self._loaded)
        self._failed_chunks, self._loaded = {}, set()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_counts(self) -> dict[str, int]:
        """The worker's counters since last taken, the saver's included."""
        s = self.saver
        now = (s.written, s.written_bytes, s.dropped, s.failed)
        seen, self._saver_seen = self._saver_seen, now
        self.counters.add(
            saved_chunks=now[0] - seen[0],
            saved_bytes=now[1] - seen[1],
            dropped_chunks=now[2] - seen[2],
            failed_saves=now[3] - seen[3],
        )
        return self.counters.take()

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
        self.costs.flush()  # what it learned since the last write, for the next process
        with contextlib.suppress(*STORE_FAULTS):  # on the loop its client was made on
            self.io.call(self.store.close, timeout=self.config.lookup_timeout_s)
        self.io.close()
        if self._lane is not None:
            self._lane.pool.close()
