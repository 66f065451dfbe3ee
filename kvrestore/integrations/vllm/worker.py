"""The worker side of the vLLM connector (`connector.KVRestoreConnector`): vLLM's paged KV caches as
destinations of chunkio's reader, the step's loads and saves, and the blocks that did not load.

Each request's load is one `chunkio.layer_load.LayerLoad` of tokens [first, k) (first: where vLLM's own
prefix cache ends) into the request's pages, which vLLM's layout gives as K and V views (`layouts`). The
pages decide the destination, not a load class of ours:

* vLLM's CPU pages, from a store that reads without the event loop, chunks saved uncompressed and
  native: `HostPages`, filled straight from the store on the step's thread as vLLM asks for each layer;
* CUDA pages: `RowPages`, each read checked on the GPU in a device buffer and written into the pages on
  a stream of the connector's own, which vLLM's stream waits on per layer;
* any other (a remote store, compressed or encoded chunks, an fp8 cache): `SectionPages`, read on the I/O
  thread, each layer written by the step's thread (or on the load stream, CUDA) as vLLM asks for it.

Computed chunks are copied out of the pages (`pages.gather`) for chunkio's `ChunkSaver`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvrestore.chunkio.host_pages import HostPages
from kvrestore.chunkio.layer_load import LayerDest, LayerLoad
from kvrestore.chunkio.page_dest import PageWrites, RowPages, SectionPages
from kvrestore.chunkio.pages import PagedCache, blocks_of, copy_out, fp8_layer_scales
from kvrestore.chunkio.part_loads import PartLoads, share_loads
from kvrestore.chunkio.parts import Layout, part_ref, part_spec, rank_part, whole
from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.core.errors import STORE_FAULTS, UnsupportedModelError
from kvrestore.core.kv import KVChunk
from kvrestore.core.sync import LoopThread
from kvrestore.costs.steps import StepTimer
from kvrestore.integrations.vllm.config import ConnectorContext
from kvrestore.integrations.vllm.layouts import applies, detect_layout, kv_views
from kvrestore.integrations.vllm.meta import (
    KVRestoreConnectorMetadata,
    KVRestoreWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvrestore.integrations.vllm.stats import Counters, emit, log
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.deadline import Deadlines, DeadlineStore

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class WorkerSide:
    """The connector's worker-role calls, over `ctx`: its own store (loads and saves each under their own
    back-off, `DeadlineStore`), I/O thread and saver."""

    def __init__(
        self,
        ctx: ConnectorContext,
        store: ChunkStore | None = None,
        io: LoopThread | None = None,
        saver: ChunkSaver | None = None,
        rank: tuple[int, int] = (0, 0),
    ) -> None:
        self.ctx = ctx
        #: this worker's heads of its stage's layers (`chunkio.parts`), saved by it unless a rank before
        #: it holds the same replicated heads; its pages hold exactly the part: its spec is the part's
        self.part, self.writes = rank_part(ctx.spec, ctx.tp, rank[0], ctx.pp, rank[1])
        self.spec = part_spec(ctx.spec, self.part)
        self.config = c = ctx.config
        self.costs = ctx.costs
        self.block_size = ctx.block_size
        raw = store if store is not None else ctx.open_store()
        # a late load marks the store down for `retry_after_s`: the loads after it fail at once
        self.store = DeadlineStore(raw, Deadlines(None, None, None, c.retry_after_s, c.retry_after_s))
        self.io = io if io is not None else LoopThread()
        self.saver = saver or ChunkSaver(
            self.spec,
            raw,
            self.io,
            compression=c.compression,
            max_bytes=c.save_queue_bytes,
            encoding=c.kv_encoding,
            seal=ctx.seal,
            retry_after_s=c.retry_after_s,
        )
        self.counters = Counters()
        self._layer_of: dict[str, int] = {}
        self._caches: list[torch.Tensor] = []  # vLLM's, a tensor a layer
        self._layout = "cpu"
        self.paged: PagedCache | None = None
        self._meta: KVRestoreConnectorMetadata | None = None
        self._loads: list[tuple[LoadSpec, LayerLoad | PartLoads]] = []
        self._load_errors: set[int] = set()
        self._failed_chunks: dict[str, set[int]] = {}
        self._loaded: set[str] = set()  # requests whose loads ended since the last report
        self._waited_s = 0.0  # this step's time in wait_for_layer_load: the step minus it is compute
        self._load_stream: torch.cuda.Stream | None = None  # set with the caches, on CUDA
        self._lane: TransferLane | None = None  # `RowPages`' staging pool and stream, on CUDA
        self.steps = StepTimer(self.costs, self.spec.num_layers)  # each step: what computing costs

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        scales: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """Take vLLM's paged caches (layer name -> tensor) and work out their layout. An fp8 cache (one
        byte an element under a wider model dtype) needs `kv_encoding="fp8"` and each layer's K and V
        scale (`scales`, vLLM's ``_k_scale_float`` and ``_v_scale_float``; 1.0 where not given): its pages
        are saved as the fp8 chunks' values, as they are (`pages.fp8_sections`)."""
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
        caches = [kv_caches[name] for name in ordered]
        fp8 = None
        if caches[0].element_size() == 1 and self.spec.dtype.itemsize > 1:  # vLLM's fp8 cache
            if self.config.kv_encoding != "fp8":
                raise UnsupportedModelError(
                    "vLLM runs an fp8 KV cache: set kv_connector_extra_config['kv_encoding'] = 'fp8' "
                    f"(got {self.config.kv_encoding!r}), whose chunks hold its pages as they are"
                )
            caches = [c.view(torch.uint8) for c in caches]
            fp8 = fp8_layer_scales([(scales or {}).get(name, (1.0, 1.0)) for name in ordered])
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        self._caches = caches
        self._layout = self.config.layout or detect_layout(caches[0], H, D)
        views = [kv_views(c, self._layout, H, D) for c in caches]
        self.paged = PagedCache([k for k, _ in views], [v for _, v in views], fp8)
        first = caches[0]
        # on CUDA the pages are written on a stream of the connector's own, ordered on the device against
        # vLLM's (which need not be the default stream, and does not sync with it)
        self._load_stream = torch.cuda.Stream(first.device) if first.is_cuda else None
        if self._load_stream is not None:
            self._lane = TransferLane(StagingPool(pinned=True), self._load_stream)
        if self._layout == "cpu":
            self._check_cpu_kernels(int(first.shape[2]))
        # the keys of native chunks stored as the pages keep them, a tile a page: read back straight
        # into the pages (`HostPages`); every other reader converts them (`codec.layout`)
        self.saver.key_tile = int(first.shape[2]) if self._layout == "cpu" and fp8 is None else 0
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
        self.steps.begin(self._device)

    def clear(self) -> None:
        self._meta = None

    @property
    def _device(self) -> torch.device:
        return self.paged.device if self.paged is not None else torch.device("cpu")

    def start_load_kv(self) -> None:
        """Start the step's loads. vLLM's forward context is not needed (its Model Runner V2 passes
        None)."""
        meta, paged = self._meta, self.paged
        if meta is None or not meta.loads or paged is None:
            return
        if self._load_stream is not None:  # the pages are written after what vLLM queued
            self._load_stream.wait_stream(torch.cuda.current_stream(paged.device))
        c = self.config
        direct = applies(self.store, self._layout, c.kv_encoding, c.compression) and HostPages.takes(paged)
        for spec in meta.loads:
            layout = spec.layout or (whole(self.ctx.spec),)
            if layout != self.ctx.layout:  # stored by an engine of another layout
                self._cross_load(spec, layout)
                continue
            dest: LayerDest
            options: dict[str, Any] = {"layers_per_read": 4}
            if direct:  # read on this thread as vLLM asks for each layer, straight into the pages
                dest = HostPages(paged, spec.block_ids, spec.first, spec.k)
            elif self._lane is not None and paged.scales is None:  # CUDA pages: checked on the GPU
                dest = RowPages(PageWrites(paged, spec.block_ids, self._load_stream))
                rows = RowPages.buffer(self.spec, spec.chunks, 2, paged.device, self._load_stream)
                options = {"layers_per_read": 2, "rows": rows, "lane": self._lane}
            else:  # through the I/O thread; written by the step's thread (on the load stream on CUDA)
                dest = SectionPages(PageWrites(paged, spec.block_ids, self._load_stream))
            load = LayerLoad(
                self.spec,
                self.store,
                [part_ref(c, self.part, self.ctx.spec) for c in spec.chunks],
                spec.k,
                dest,
                first=spec.first,
                encoding=c.kv_encoding,
                seal=self.ctx.seal,
                **options,
            )
            load.start(self.io, c.load_timeout_s)
            self._loads.append((spec, load))

    def _cross_load(self, spec: LoadSpec, layout: Layout) -> bool:
        """Load `spec` from chunks stored in another layout than this engine's: of each stored part over
        this rank's heads and layers, those (`part_loads.share_loads`). Into fp8 pages nothing loads: its
        blocks are load errors, recomputed by vLLM on every rank."""
        paged, c = self.paged, self.config
        assert paged is not None
        if paged.scales is not None:
            self._load_errors.update(blocks_of(spec.block_ids, spec.first, spec.k, self.block_size))
            self._loaded.add(spec.req_id)
            self.counters.add(load_failures=1)
            log.warning(
                "kvrestore: request %s: chunks stored as %s are not read into fp8 pages", spec.req_id, layout
            )
            return False
        load = share_loads(
            self.ctx.spec,
            self.part,
            layout,
            self.store,
            spec.chunks,
            spec.k,
            paged,
            lambda pages: PageWrites(pages, spec.block_ids, self._load_stream),
            first=spec.first,
            encoding=c.kv_encoding,
            seal=self.ctx.seal,
            layers_per_read=4,
        )
        load.start(self.io, c.load_timeout_s)
        self._loads.append((spec, load))
        return True

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
                    tokens=spec.k - spec.first,
                )
        self._waited_s += time.perf_counter() - t

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        loads = list(self._loads)
        failed = self._finish_loads()
        computed = [(n_new, past) for _, n_new, past in meta.steps if n_new > 0]
        load_s = loads[0][1].seconds if len(loads) == 1 else None
        if len(computed) == 1 and not failed and (not loads or load_s is not None):
            # one request computed: a sample of what computing costs, alone or beside a load; a load
            # read on this thread ran before each layer, not beside it (a sample of computing only)
            beside = load_s if loads and not loads[0][1].here else None
            self.steps.end(self._device, computed, self._waited_s, beside)
        elif len(computed) > 1 and not loads:  # several requests in one pass, nothing loaded beside it
            self.steps.end(self._device, computed, self._waited_s)
        self.steps.learn()
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
            tokens = spec.k - spec.first
            if bad:
                failed.add(spec.req_id)
                self._load_errors.update(bad)
                self._failed_chunks.setdefault(spec.req_id, set()).update(
                    spec.chunks[j].index for j in load.failed
                )
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
                self.counters.add(loads=1, loaded_tokens=tokens, loaded_bytes=load.bytes_read)
                emit(
                    logging.INFO,
                    "loaded",
                    "request %(request)s: loaded %(tokens)d tokens (%(bytes)d bytes) in %(seconds).3f s",
                    request=spec.req_id,
                    tokens=tokens,
                    bytes=load.bytes_read,
                    seconds=load.seconds,
                    first=spec.first,
                    blocks=blocks_of(spec.block_ids, spec.first, spec.k, self.block_size),
                )
        if moved:
            self.costs.observe_load(self.ctx.link_key, moved, longest)
        if self._loads and self._load_stream is not None and self.paged is not None:
            # every load is settled: vLLM's stream goes on after every page they wrote
            torch.cuda.current_stream(self.paged.device).wait_stream(self._load_stream)
        self._loads.clear()
        return failed

    def _save(self, spec: SaveSpec) -> None:
        """Copy each chunk out of the pages behind the step's kernels (`pages.copy_out`: before vLLM can
        reuse the pages) and hand it to the saver."""
        paged = self.paged
        assert paged is not None
        if not self.writes:  # a replicated head: the first rank that holds it writes it
            return
        views = list(zip(paged.k, paged.v, strict=True))
        for c in (part_ref(r, self.part, self.ctx.spec) for r in spec.chunks):
            nbytes = self.spec.kv_bytes_per_token * (c.end - c.start)
            if not self.saver.reserve(c.key, nbytes):  # dropped: not even copied out
                continue
            try:
                data, ready = copy_out(views, spec.block_ids, c.start, c.end)
            except BaseException:
                self.saver.unreserve(nbytes)
                raise
            # an fp8 cache's values are stored as they are, with its scales (the saver's thread lays out
            # the sections)
            self.saver.submit_reserved(c.key, KVChunk(c.start, data), nbytes, ready, fp8_scales=paged.scales)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._failed_chunks and not self._loaded:
            return None
        meta = KVRestoreWorkerMetadata(self._failed_chunks, self._loaded)
        self._failed_chunks, self._loaded = {}, set()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_counts(self) -> dict[str, int]:
        """The worker's counters since last taken, the saver's included."""
        self.counters.add(**self.saver.take_counts())
        return self.counters.take()

    def shutdown(self) -> None:
        for _, load in self._loads:
            load.cancel("shutdown")
        self._loads.clear()
        self.saver.finish(timeout=60)
        self.costs.flush()  # what it learned since the last write, for the next process
        with contextlib.suppress(*STORE_FAULTS):  # on the loop its client was made on
            self.io.call(self.store.close, timeout=self.config.lookup_timeout_s)
        self.io.close()
        if self._lane is not None:
            self._lane.pool.close()
