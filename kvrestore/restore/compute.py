"""The compute lane's units: tokens on top of a cache (token-wise) and layers over a prefix (layer-wise).

Each runs blocking on the engine's compute lane, on its own CUDA stream so load copies overlap it, and
is done when its kernels are, not when they are queued.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrestore.backends.base import ComputeBackend
from kvrestore.core.kv import KVCache
from kvrestore.core.streams import on_stream
from kvrestore.runtime.engine import Engine


def prefill_into(
    engine: Engine, backend: ComputeBackend, kv: KVCache, tokens: torch.Tensor, start: int, end: int
) -> None:
    """Compute tokens [start, end) on top of the KV of [0, start) (blocking, on the compute lane)."""
    stream = engine.cuda_stream("compute", kv.data.device)
    into = getattr(backend, "prefill_into", None)
    try:
        with on_stream(stream):  # its own CUDA stream, so load copies overlap it
            if into is not None:  # into the cache, attending over it: no copy of the past
                into(tokens[start:end], kv.data, start)
            else:
                past = kv.prefix(start) if start else None
                kv.write(backend.prefill_chunk(tokens[start:end], past, start))
    finally:  # a unit is done when its kernels are, not when they are queued (also when cancelled)
        if stream is not None:
            stream.synchronize()


def prefill_apart(
    engine: Engine, backend: ComputeBackend, kv: KVCache, tokens: torch.Tensor, start: int, end: int
) -> Callable[[], None]:
    """Compute tokens [start, end) on top of the KV of [0, start) without writing them into `kv`
    (a compute unit racing a fetch of the same rows); returns what writes them (on the lane)."""
    stream = engine.cuda_stream("compute", kv.data.device)
    try:
        with on_stream(stream):
            chunk = backend.prefill_chunk(tokens[start:end], kv.prefix(start) if start else None, start)
    finally:
        if stream is not None:
            stream.synchronize()

    def commit() -> None:
        with on_stream(stream):
            kv.write(chunk)
        if stream is not None:
            stream.synchronize()

    return commit


class LayerCompute:
    """The compute lane of a layer-axis restore: layers [a, b) over every token of the prefix.

    It keeps the hidden states between units, so a unit continues where the last one stopped. Should a
    unit start above layers that were loaded (after a failed read lower down), it runs through them
    too: only computing gives the hidden states a higher layer needs.
    """

    def __init__(
        self, backend: ComputeBackend, tokens: torch.Tensor, kv: KVCache, stream: torch.cuda.Stream | None
    ) -> None:
        self.backend, self.tokens, self.kv, self.stream = backend, tokens, kv, stream
        self.positions: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.layer = 0

    def __call__(self, a: int, b: int) -> None:
        n = len(self.tokens)
        with on_stream(self.stream):
            if self.hidden is None or self.positions is None:
                self.hidden = self.backend.embed(self.tokens)
                # made on the cache's device, on this stream (so in order with the layers that read them):
                # host positions would be copied from pageable memory on every layer, which makes the
                # host wait for the compute stream to drain each time
                self.positions = torch.arange(n, device=self.kv.data.device)
            for layer in range(self.layer, b):
                self.hidden, k, v = self.backend.run_layer(layer, self.hidden, None, None, self.positions)
                self.kv.data[layer, 0, :, :n].copy_(k)
                self.kv.data[layer, 1, :, :n].copy_(v)
            self.layer = b
        if self.stream is not None:
            self.stream.synchronize()
