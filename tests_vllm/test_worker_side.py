"""The connector's worker side, driven step by step without an engine (vLLM's classes are real)."""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from kvrestore import codec
from kvrestore.core.keys import chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.streams import HostEvent
from kvrestore.integrations.vllm_io import IOThread, LoadChunk
from kvrestore.integrations.vllm_worker import KVRestoreConnectorMetadata, LoadSpec, SaveSpec, WorkerSide
from kvrestore.stores import MemoryStore

L, H, D, BLOCK, N_BLOCKS, CHUNK = 2, 2, 4, 8, 16, 16
SPEC = ModelSpec("m", L, H, D, 100, torch.float32, "f" * 32)


class Saver:
    def __init__(self) -> None:
        self.submitted: list[int] = []

    def reserve(self, key: str, nbytes: int) -> bool:
        return True

    def submit_reserved(self, key: str, chunk: KVChunk, ready: object = None) -> None:
        self.submitted.append(chunk.start)


class Costs:
    def __init__(self) -> None:
        self.compute: list[tuple[int, int, float]] = []

    def add_compute(self, n_new: int, past: int, seconds: float) -> None:
        self.compute.append((n_new, past, seconds))

    def add_load(self, *args: object) -> None:
        pass


class Config:
    load_timeout_s = 5.0


class Worker(WorkerSide):
    """The state `KVRestoreConnector.__init__` and `register_kv_caches` set, over flash-attn pages."""

    def __init__(self, store: MemoryStore) -> None:
        self.spec, self.store, self.io, self.config = SPEC, store, IOThread(), Config()
        self.saver, self.costs = Saver(), Costs()
        self.link_key, self.block_size = "link", BLOCK
        self._caches = [torch.zeros(2, N_BLOCKS, BLOCK, H, D) for _ in range(L)]
        self._layer_of = {f"model.layers.{i}.self_attn.attn": i for i in range(L)}
        self._layout = "flash_attn"
        self._load_stream, self._layer_placed = None, {}
        self._step_start, self._timed_steps = HostEvent(), deque()
        self._loads, self._load_errors, self._failed_chunks = [], set(), {}
        self._errors_lock, self._bound_at, self._waited_s = threading.Lock(), time.perf_counter(), 0.0
        self.meta: KVRestoreConnectorMetadata | None = None

    def _get_connector_metadata(self) -> KVRestoreConnectorMetadata | None:
        return self.meta

    def has_connector_metadata(self) -> bool:
        return self.meta is not None

    def step(self, meta: KVRestoreConnectorMetadata) -> None:
        self.meta = meta
        self.start_load_kv(None)  # type: ignore[arg-type]
        for name in self._layer_of:
            self.wait_for_layer_load(name)
        self.wait_for_save()


def test_chunks_computed_over_a_failed_load_are_not_saved():
    """A step loads [0, 16) and computes [16, 32) on top of it. The load fails (the chunk is gone), so
    vLLM's [16, 32) attended over KV that never arrived: saving it would store a wrong chunk under a
    valid key. It is saved once recomputed instead (the scheduler side moves its next save back)."""
    refs = chunk_keys(list(range(48)), SPEC.fingerprint, CHUNK)
    blocks = list(range(4))

    def step(req: str) -> KVRestoreConnectorMetadata:
        meta = KVRestoreConnectorMetadata()
        meta.loads.append(LoadSpec(req, [LoadChunk(refs[0].key, 0, 16)], 16, blocks))
        meta.saves.append(SaveSpec(req, [LoadChunk(refs[1].key, 16, 32)], blocks))
        meta.steps.append((req, 16, 16))
        return meta

    store = MemoryStore()  # empty: the chunk the lookup found is gone
    worker = Worker(store)
    try:
        worker.step(step("a"))
        assert worker.get_block_ids_with_load_errors() == {0, 1}
        assert worker.saver.submitted == [] and worker.costs.compute == []  # nor learned from
        assert worker.build_connector_worker_meta().failed == {"a": {0}}  # type: ignore[union-attr]
        # the same step with the chunk in the store: loaded, and the computed chunk saved
        blob = codec.encode_chunk(KVChunk(0, torch.randn(L, 2, H, 16, D)), SPEC, refs[0].key)
        worker.io.call(store.put, refs[0].key, blob)
        worker.step(step("b"))
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker.saver.submitted == [16]
        ((n_new, past, seconds),) = worker.costs.compute  # the step's compute, timed on the host here
        assert (n_new, past) == (16, 16) and seconds >= 0
    finally:
        worker.io.close()


def test_loading_asks_vllm_for_piecewise_cuda_graphs():
    """A full graph's replay would skip the per-layer waits for loads."""
    from kvrestore.integrations.vllm import KVRestoreConnector

    assert KVRestoreConnector.requires_piecewise_for_cudagraph({"store_url": "/kv"}) is True
    assert KVRestoreConnector.requires_piecewise_for_cudagraph({"store_url": "/kv", "load": False}) is False
