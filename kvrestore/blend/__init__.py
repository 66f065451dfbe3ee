"""CacheBlend (EuroSys 2025): reuse the KV of chunks that are not a prefix, with selective recompute.

    key = await restorer.save_chunk(chunk_tokens)        # prefilled alone, stored under a content key
    result = await restorer.restore_blend([c2, c0, c1], question, Blend(recompute_ratio=0.15))
    backend.generate(result.tokens, result.kv)

Parts: `chunks` (content-keyed save, per-layer loading and re-rotation), `select` (KV deviation,
HKVD selection), `controller` (the loading controller's pure choices), `placement` (those choices
measured on real stores: `restorer.choose_blend_store`), `fuse` (the pipelined fusor).
"""

from kvrestore.blend.chunks import StoreChunkSource, chunk_key, save_chunk
from kvrestore.blend.controller import (
    StoreOption,
    choose_ratio,
    choose_store,
    load_seconds_per_layer,
    recompute_seconds_per_layer,
)
from kvrestore.blend.fuse import BlendResult, BlendStats, restore_blend
from kvrestore.blend.placement import StoreCandidate, StorePlacement, choose_blend_store, measure_store
from kvrestore.blend.select import kv_deviation, select_hkvd, selection_sizes
from kvrestore.chunkio.layers import ChunkLoadFailed
from kvrestore.policies.blend import Blend, ratio_schedule

__all__ = [
    "Blend",
    "BlendResult",
    "BlendStats",
    "ChunkLoadFailed",
    "StoreChunkSource",
    "StoreCandidate",
    "StoreOption",
    "StorePlacement",
    "choose_blend_store",
    "chunk_key",
    "choose_ratio",
    "choose_store",
    "kv_deviation",
    "load_seconds_per_layer",
    "measure_store",
    "ratio_schedule",
    "recompute_seconds_per_layer",
    "restore_blend",
    "save_chunk",
    "select_hkvd",
    "selection_sizes",
]
