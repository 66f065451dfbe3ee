"""The CacheBlend fusor: per-layer loading pipelined with selective recompute (§4.2, §5.1).

One blend of chunks c_0..c_{m-1} plus a new suffix lays them out at positions 0..N-1 (chunk j at offset
o_j) and builds the KV of all N tokens:

* a loader task fetches layer 1, 2, ... of every chunk from the store (one range read per chunk for
  each layer, or on CUDA for a few consecutive layers at a time: `LayerReader.read_plan`), re-rotates
  the keys to their new positions and signals the layers as ready; it runs ahead of the compute, so
  loading layer i+1 overlaps the recompute of layer i;
* the compute lane (one worker-thread call for the whole blend, which waits for each layer's load on a
  thread event: no turn of the event loop between layers) recomputes layer 0 fully -- its KV needs no
  cross-attention and every token gets a hidden state -- then, on each layer i >= 1 once it is loaded,
  projects the candidates' K/V, keeps the forced tokens plus the reused ones with the highest KV
  deviation (`select`), and runs the layer for those only (`HFBackend.run_layer_selective`): their K/V
  overwrite the loaded rows, their queries attend over the blended KV, in groups over key prefixes
  (`SelectionBounds`, `row_groups`). The kept set is the next layer's candidates. On CUDA nothing in a
  layer waits for the device: the lane queues kernels and runs ahead.

Layer 0 is never loaded (it is recomputed). The suffix, the last token and the tokens of chunks that
could not be loaded are forced: recomputed on every layer, so a missing or damaged chunk costs time,
never correctness. A chunk that fails part-way restarts the blend with that chunk forced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from kvrestore.blend.chunks import BlendKeys, StoreChunkSource, chunk_key
from kvrestore.blend.controller import choose_ratio
from kvrestore.blend.select import SelectionBounds, select_hkvd, selection_sizes, stacked_kv_deviation
from kvrestore.chunkio.layers import ChunkLoadFailed
from kvrestore.chunkio.pool import StagingPool
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.kv import KVCache
from kvrestore.core.streams import load_stream as new_load_stream
from kvrestore.core.streams import on_device, upload
from kvrestore.policies.blend import Blend
from kvrestore.stores.base import ChunkStore

if TYPE_CHECKING:
    from kvrestore.backends.hf import HFBackend


@dataclass
class BlendStats:
    n_tokens: int
    n_chunks: int
    n_suffix: int
    n_prefix: int
    ratio: float  # the average recompute ratio used (chosen by the controller when the policy is auto)
    schedule: list[float]  # per-layer ratios of layers 1..L-1
    recomputed: list[int]  # tokens recomputed per layer (layer 0 first), forced ones included
    hkvd: list[int]  # the HKVD tokens: stored ones recomputed per layer 1..L-1
    loaded_chunks: int
    missing_chunks: list[int]  # recomputed instead: not stored, or unusable
    bytes_loaded: int
    seconds: float
    load_seconds: list[float]  # per layer (layer 0 is not loaded: 0.0)
    compute_seconds: list[float]  # per layer
    wait_seconds: float  # the compute lane waiting for a layer to load
    restarts: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class BlendResult:
    kv: KVCache  # all N tokens: the prefix, the chunks at their new positions, then the suffix
    tokens: torch.Tensor  # the N token ids, the prompt to pass to generate() with `kv`
    logits: torch.Tensor  # next-token logits after the last token [vocab], float32
    stats: BlendStats


@dataclass
class _Layout:
    prefix: torch.Tensor
    chunks: list[torch.Tensor]
    suffix: torch.Tensor
    offsets: list[int]
    tokens: torch.Tensor

    @classmethod
    def of(cls, prefix: torch.Tensor, chunks: Sequence[torch.Tensor], suffix: torch.Tensor) -> _Layout:
        offsets, o = [], len(prefix)
        for c in chunks:
            offsets.append(o)
            o += len(c)
        tokens = torch.cat([prefix, *chunks, suffix])
        return cls(prefix, list(chunks), suffix, offsets, tokens)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def forced(self, missing: set[int]) -> torch.Tensor:
        """Which tokens are recomputed on every layer (bool [N]): the prefix, the suffix, the last token
        and the tokens of the `missing` chunks."""
        forced = torch.zeros(self.n, dtype=torch.bool)
        forced[self.n - len(self.suffix) :] = True
        forced[: len(self.prefix)] = True
        forced[self.n - 1] = True
        for j in missing:
            forced[self.offsets[j] : self.offsets[j] + len(self.chunks[j])] = True
        return forced


async def restore_blend(
    backend: HFBackend,
    store: ChunkStore,
    chunks: Sequence[torch.Tensor],
    suffix: torch.Tensor,
    policy: Blend | None = None,
    prefix: torch.Tensor | None = None,
    lane: TransferLane | None = None,
    keys: BlendKeys | None = None,
) -> BlendResult:
    """Blend stored chunk KV (any order, any neighbours) with a recomputed suffix; see the module doc.

    `chunks`, `suffix` and `prefix` are validated 1-D int64 token tensors (suffix and prefix may be
    empty). `prefix` is the shared prefix the chunks were saved after (`save_chunk(..., prefix=)`); it
    starts the prompt and is recomputed on every layer, like the suffix. On CUDA the layers are
    uploaded on `lane`'s stream (a new one if it has none) through pinned buffers from its pool.
    `keys` (default: the model's fingerprint, unsigned) say the chunks' key space and seal.
    """
    t0 = time.perf_counter()
    policy = policy or Blend()
    prefix = torch.zeros(0, dtype=torch.int64) if prefix is None else prefix
    layout = _Layout.of(prefix, chunks, suffix)
    if layout.n == 0:
        raise InvalidInputError("nothing to blend: no chunks and an empty suffix")
    backend.rope_inv_freq()  # an UnsupportedModelError before any work, not half-way
    keys = keys or BlendKeys(backend.spec.fingerprint)
    chunk_keys = [chunk_key(backend, c, prefix, keys.space) for c in layout.chunks]
    lengths = [len(c) for c in layout.chunks]
    device = torch.device(backend.device)
    if device.type == "cuda" and (lane is None or lane.stream is None):
        pool = lane.pool if lane is not None else StagingPool(pinned=True)
        lane = TransferLane(pool, new_load_stream(device))
    source = StoreChunkSource(
        backend, store, chunk_keys, layout.offsets, lengths, stored_at=len(prefix), lane=lane, seal=keys.seal
    )
    available = await source.open()
    missing = {j for j, ok in enumerate(available) if not ok}
    restarts = 0
    while True:
        try:
            result = await _Fusion(backend, layout, source, policy, missing).run()
            await source.verify()  # the device's checks of every layer (on CUDA they are read once, here)
            break
        except ChunkLoadFailed as exc:  # a layer failed part-way: its chunk's tokens are recomputed
            for j in exc.indices:
                missing.add(j)
                source.drop(j)
            restarts += 1
    st = result.stats
    st.missing_chunks = sorted(missing)
    st.loaded_chunks = len(layout.chunks) - len(missing)
    st.bytes_loaded = source.bytes_read
    st.restarts = restarts
    st.errors = list(source.errors)
    st.seconds = time.perf_counter() - t0
    return result


class _Fusion:
    """One attempt at a blend: a loader task on the event loop and the compute lane (one worker-thread
    call for the whole blend) over one KV buffer.

    The loader sets `ready[i]` once layer i is in place; the compute lane waits for it there, so a
    layer's compute never waits for a turn of the event loop. A loader that fails or is cancelled sets
    `halted`, then wakes every waiter. What both sides note (each layer's load time, the loader's
    failure, the compute lane's waits and selections) are attributes, read into `BlendStats` at the end.
    """

    def __init__(
        self, backend: HFBackend, layout: _Layout, source: StoreChunkSource, policy: Blend, missing: set[int]
    ) -> None:
        spec = backend.spec
        self.backend, self.layout, self.source, self.policy = backend, layout, source, policy
        self.n_layers, self.n = spec.num_layers, layout.n
        self.device = torch.device(backend.device)
        n = self.n
        self.kv = KVCache(
            spec,
            torch.zeros(
                (self.n_layers, 2, spec.num_kv_heads, n, spec.head_dim), dtype=spec.dtype, device=self.device
            ),
        )
        forced_host = layout.forced(missing)  # built on the host: its count needs no device sync
        self.n_forced = int(forced_host.sum())
        self.n_reused = n - self.n_forced
        self.forced = upload(forced_host, self.device)
        # the zeros and the flags are queued on the caller's stream: the load stream and the compute lane
        # start behind them (on the device: the host does not wait for whatever else that stream holds)
        self.caller = torch.cuda.current_stream(self.kv.data.device) if self.kv.data.is_cuda else None
        if self.caller is not None and source.stream is not None:
            source.stream.wait_stream(self.caller)
        self.ready = [threading.Event() for _ in range(self.n_layers)]
        self.halted = threading.Event()
        self.load_s = [0.0] * self.n_layers
        self.failure: list[ChunkLoadFailed] = []
        self.timer = LayerTimer(self.device, self.n_layers)
        self.bounds = SelectionBounds(n, self.device)
        self.recomputed = [n]
        self.hkvd: list[int] = []
        self.wait_s = 0.0

    async def run(self) -> BlendResult:
        """Run the loader and the compute lane to the end: the blend, or the loader's failure raised."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._loader)
            outcome = await anyio.to_thread.run_sync(self._compute_lane_on_device)
        if self.failure:
            raise self.failure[0]
        if outcome is None:  # the loader was cancelled: raise that cancellation here
            await anyio.lowlevel.checkpoint()
            raise RuntimeError("the blend's loader stopped with no failure and no cancellation")
        logits, ratio, schedule = outcome
        for i in range(1, self.n_layers):  # the loader's time (fetch, queue) plus the device's, where queued
            self.load_s[i] += self.source.placed_seconds(i) or 0.0
        layout = self.layout
        stats = BlendStats(
            n_tokens=self.n,
            n_chunks=len(layout.chunks),
            n_suffix=len(layout.suffix),
            n_prefix=len(layout.prefix),
            ratio=ratio,
            schedule=schedule,
            recomputed=self.recomputed,
            hkvd=self.hkvd,
            loaded_chunks=0,
            missing_chunks=[],
            bytes_loaded=0,
            seconds=0.0,
            load_seconds=self.load_s,
            compute_seconds=self.timer.seconds,
            wait_seconds=self.wait_s + self.timer.device_wait,
        )
        return BlendResult(self.kv, layout.tokens, logits, stats)

    async def _loader(self) -> None:
        """Read layers 1.. (layer 1 alone, then a few at a time) and mark each ready as it lands."""
        try:
            for layers in self.source.read_plan(1, self.n_layers, self.kv):
                t = time.perf_counter()
                await self.source.read_layers(layers, self.kv)
                share = (time.perf_counter() - t) / len(layers)  # each layer's part of the read
                for i in layers:
                    self.load_s[i] = share
                    self.ready[i].set()
        except ChunkLoadFailed as exc:
            self.failure.append(exc)
        finally:
            if not all(ev.is_set() for ev in self.ready[1:]):
                self.halted.set()
                for ev in self.ready:
                    ev.set()

    def _wait_for(self, i: int) -> bool:
        """Wait until layer i is loaded (on CUDA: queued on the load stream, then the compute stream
        waits for it on the device); False if the blend must stop instead."""
        t = time.perf_counter()
        self.ready[i].wait()
        self.wait_s += time.perf_counter() - t
        if self.halted.is_set():
            return False
        self.timer.before_wait(i)
        self.source.wait_placed(i)
        return True

    def _layer0(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Layer 0 recomputed for every token: (hidden states, the rotary cos and sin)."""
        backend, kv = self.backend, self.kv
        mark = self.timer.start()
        hidden = backend.embed(self.layout.tokens)
        positions = torch.arange(self.n, device=self.device)
        rope = backend.rotary(hidden, positions)
        hidden, k, v = backend.run_layer(0, hidden, None, None, positions, rope=rope)
        kv.data[0, 0].copy_(k)
        kv.data[0, 1].copy_(v)
        self.timer.stop(0, mark, wait=self.policy.auto)  # the controller needs layer 0's time now
        return hidden, rope

    def _layer(
        self, i: int, hidden: torch.Tensor, cand: torch.Tensor, size: int, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selective recompute of layer i; queues its kernels and returns without waiting for them (the
        sizes are known on the host: every candidate set holds all `n_forced` forced tokens). `rope` is
        every token's rotary cos and sin stacked, [2, 1, N, D]."""
        backend, kv, policy, n_forced = self.backend, self.kv, self.policy, self.n_forced
        mark = self.timer.start()
        k_layer, v_layer = kv.data[i, 0], kv.data[i, 1]
        rope_cand = rope.index_select(2, cand)  # cos and sin of the candidates: one gather
        x, k_new, v_new = backend.project_candidates(i, hidden, (rope_cand[0], rope_cand[1]))
        fresh = torch.stack((k_new, v_new))  # [2, H, T, D], as the cache holds them: one op each below
        loaded = kv.data[i].index_select(2, cand)  # their loaded K and V: one gather
        dev = stacked_kv_deviation(fresh, loaded, policy.deviation)
        keep = select_hkvd(dev, self.forced[cand], size, n_forced=n_forced)
        sel = cand[keep]
        rope_sel = rope_cand.index_select(2, keep)
        upper = self.bounds.upper(sel)  # where the kept rows can sit, for the attention's key prefixes
        lower = self.bounds.lower(sel)  # and the keys all rows of a group see, attended without a mask
        self.bounds.record(sel)
        if policy.update_candidates:  # every candidate's fresh K/V replaces its loaded K/V (no compute)
            kv.data[i].index_copy_(2, cand, fresh)
        hidden, _, _ = backend.run_layer_selective(  # the kept rows' K, V and normed inputs, not again
            i,
            hidden[:, keep],
            sel,
            k_layer,
            v_layer,
            rope=(rope_sel[0], rope_sel[1]),
            projected=(x[:, keep], *fresh.index_select(2, keep)),
            upper=upper,
            lower=lower,
        )
        self.timer.stop(i, mark)
        chosen = min(size, cand.numel() - n_forced)
        self.recomputed.append(n_forced + chosen)
        self.hkvd.append(chosen)
        return hidden, sel

    def _compute_lane(self) -> tuple[torch.Tensor, float, list[float]] | None:
        """Layer 0, the ratio, every selective layer as its load lands: (logits, ratio, per-layer
        ratios), or None if halted."""
        policy, n_layers = self.policy, self.n_layers
        hidden, rope = self._layer0()
        if policy.recompute_ratio is not None:
            ratio = policy.recompute_ratio
        elif n_layers > 1:  # the loading controller: measured layer-1 load vs a full layer's compute
            if not self._wait_for(1):
                return None
            layer1 = self.load_s[1] + (self.source.placed_seconds(1) or 0.0)
            ratio = choose_ratio(layer1, self.timer.seconds[0], policy.min_ratio, policy.max_ratio)
        else:
            ratio = policy.min_ratio
        schedule = policy.schedule(ratio, n_layers)
        sizes = selection_sizes(schedule, self.n_reused)
        cand = torch.arange(self.n, device=self.device)
        rope_all = torch.stack(rope)
        for i in range(1, n_layers):
            if not self._wait_for(i):
                return None
            hidden, cand = self._layer(i, hidden, cand, sizes[i - 1], rope_all)
        logits = self.backend.final_logits(hidden)
        self.timer.finish()
        return logits, ratio, schedule

    def _compute_lane_on_device(self) -> tuple[torch.Tensor, float, list[float]] | None:
        with on_device(self.device):  # its events and waits act on the model's device's stream
            if self.caller is not None:
                torch.cuda.current_stream(self.kv.data.device).wait_stream(self.caller)
            return self._compute_lane()


class LayerTimer:
    """Each layer's compute time without waiting for the device after every layer: on CUDA a pair of
    timing events per layer, read once at the end (`finish`); on a CPU the wall clock."""

    def __init__(self, device: torch.device, n_layers: int) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = [0.0] * n_layers
        self.device_wait = 0.0  # the compute stream waiting for loads on the device (CUDA)
        self._events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self._waits: dict[int, torch.cuda.Event] = {}

    def before_wait(self, i: int) -> None:
        """Mark the compute stream before it waits for layer i's load: the wait is the gap from here to
        the layer's start (`finish` adds it to `device_wait`)."""
        if self.cuda:
            event = self._waits[i] = torch.cuda.Event(enable_timing=True)
            event.record()

    def start(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, i: int, mark: float | torch.cuda.Event, wait: bool = False) -> None:
        """Layer i's kernels are queued since `mark`; with `wait`, its time is known on return."""
        if not self.cuda:
            self.seconds[i] = time.perf_counter() - mark  # type: ignore[operator]
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events[i] = (mark, end)  # type: ignore[assignment]
        if wait:
            end.synchronize()
            self.seconds[i] = mark.elapsed_time(end) / 1e3  # type: ignore[union-attr]

    def finish(self) -> None:
        """Wait for the last layer, then read every layer's time."""
        if self._events:
            self._events[max(self._events)][1].synchronize()
        for i, (a, b) in self._events.items():
            self.seconds[i] = a.elapsed_time(b) / 1e3
        self.device_wait = sum(w.elapsed_time(self._events[i][0]) for i, w in self._waits.items()) / 1e3
