"""Loading stored chunks into vLLM's CUDA pages, checked on the GPU (`DeviceLayerLoad`: any store, any
encoding but an fp8 cache's).

A few layers of every chunk are read at a time through `LayerReader`'s device path (`chunkio.uploads`):
a pinned `MemoryStore`'s objects go up as they lie, other bytes through one shared pinned staging buffer,
one copy per read. One `segment_checksums` call checks every section there against the chunk header's
checksums before anything is placed. The good chunks land in a device buffer of the read's layers (runs
of chunks of one length in one copy); each layer goes into the request's pages with one indexed copy for
K and one for V (`scatter_tokens`) on the connector's load stream, which vLLM's stream waits on (an
event per layer): the host never waits for a layer. A few host calls per read whatever the number of
chunks: no per-layer pinned allocation, no host checksum, no copy out of a pinned store. A chunk that
fails its checks is failed as in every load: vLLM recomputes from its first token, the object is deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvrestore.chunkio.dest import CacheRows
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.codec.seal import Seal
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.core.streams import on_stream
from kvrestore.integrations.vllm.io import LoadChunk
from kvrestore.integrations.vllm.load import BackgroundLoad
from kvrestore.stores.base import ChunkStore


class DeviceLayerLoad(BackgroundLoad):
    """Loads tokens [0, k) of one request into a device's pages (module doc): each read of
    `layers_per_read` layers lands checked in a device buffer of those layers, and `place(layer, rows)`
    writes each layer's ``[2, H, T, D]`` rows (T = k, or the start of the first failed chunk) into the
    pages, on the I/O thread, under the load's lock (nothing is placed once `cancel` returns). `lane`
    holds the pinned staging pool (shared by the worker's loads) and the stream `place` writes the pages
    on, so a read's buffer is reused only once the layers placed from it are written."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ChunkStore,
        chunks: Sequence[LoadChunk],
        k: int,
        place: Callable[[int, torch.Tensor], None],
        lane: TransferLane,
        device: torch.device,
        layers_per_read: int = 2,
        encoding: str = "native",
        device_path: bool = False,
        seal: Seal | None = None,
    ) -> None:
        n = max(1, layers_per_read)
        shape = (n, 2, spec.num_kv_heads, chunks[-1].end if chunks else 0, spec.head_dim)
        with on_stream(lane.stream, device):  # freed once the stream's copies out of it are done
            rows = KVCache(spec, torch.empty(shape, dtype=spec.dtype, device=device))
        super().__init__(
            spec,
            store,
            chunks,
            k,
            seal,
            dest=CacheRows(per_read=True),
            rows=rows,
            place_layer=lambda i, layer, upto: place(layer, rows.data[i, :, :, :upto]),
            layers_per_read=n,
            lane=lane,
            defer_checks=False,
            encoding=encoding,
            device_path=device_path,  # on a host buffer too (`LayerReader.device_path`: tests)
        )
