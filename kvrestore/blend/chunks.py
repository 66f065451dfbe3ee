"""Position-independent chunk KV: saved under a content key, loaded one layer at a time, re-rotated.

A chunk is prefilled on its own -- positions 0..n-1, or, with a shared `prefix` (a system prompt every
blended prompt starts with), right after that prefix -- and only the chunk's own rows are stored, with
the ordinary chunk wire format (`codec`), under `keys.content_key` of (prefix, chunk): it depends on the
chunk's tokens, not on what else precedes it in a prompt. At restore time the chunk may sit anywhere
after the prefix: each loaded layer's keys are rotated from their stored positions to their new ones
(`HFBackend.rerotate_keys`). A shared prefix gives every chunk the same attention sink (the first
token) it will have in the blended prompt, instead of its own first token, which brings the reused KV
much closer to a full prefill. A chunk that is missing, foreign, truncated or corrupt is never
used: `open` reports it unavailable (and deletes a damaged object), or `load_layer` raises
`ChunkLoadFailed` naming it, and the fusor recomputes its tokens instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import torch

from .. import codec
from ..keys import content_key
from ..kv import KVCache
from ..layers import LayerReader, StoredChunk
from ..stores.base import ChunkStore

if TYPE_CHECKING:
    from ..backends.hf import HFBackend


_NO_PREFIX = torch.zeros(0, dtype=torch.int64)


def chunk_key(backend: HFBackend, tokens: torch.Tensor, prefix: torch.Tensor | None = None) -> str:
    """The content key of a chunk (saved after `prefix`, if any)."""
    if prefix is None or len(prefix) == 0:
        return content_key(tokens, backend.spec.fingerprint)
    # -1 is no token id: (prefix, chunk) pairs that concatenate alike still get different keys
    sep = torch.tensor([-1, len(prefix)], dtype=torch.int64)
    return content_key(
        torch.cat([prefix.to(torch.int64), sep, tokens.to(torch.int64)]), backend.spec.fingerprint
    )


async def save_chunk(
    backend: HFBackend,
    store: ChunkStore,
    tokens: torch.Tensor,
    *,
    prefix: torch.Tensor | None = None,
    compression: str = "none",
    overwrite: bool = False,
) -> tuple[str, int]:
    """Prefill `tokens` alone (after `prefix`, if given) and store the chunk's KV under its content key.

    Returns (key, bytes written); an already stored chunk is not recomputed (0 bytes) unless `overwrite`.
    """
    prefix = _NO_PREFIX if prefix is None else prefix
    key = chunk_key(backend, tokens, prefix)
    if not overwrite and (await store.contains([key]))[0]:
        return key, 0

    def encode() -> bytes:
        p = len(prefix)
        past = backend.prefill_chunk(prefix, None, 0).data if p else None
        chunk = backend.prefill_chunk(tokens, past, p)  # stored with start = p: its positions
        return codec.encode_chunk(chunk, backend.spec, key, compression=compression)

    blob = await anyio.to_thread.run_sync(encode)
    await store.put(key, blob)
    return key, len(blob)


class StoreChunkSource(LayerReader):
    """Loads the chunks of one blend from a store, layer by layer, into a KVCache at their offsets,
    re-rotating the keys of every chunk placed elsewhere than where it was saved (`stored_at`, the
    shared prefix's length)."""

    def __init__(
        self,
        backend: HFBackend,
        store: ChunkStore,
        keys: Sequence[str],
        offsets: Sequence[int],
        lengths: Sequence[int],
        stored_at: int = 0,
    ) -> None:
        chunks = [StoredChunk(k, stored_at, o, n) for k, o, n in zip(keys, offsets, lengths, strict=True)]
        super().__init__(backend.spec, store, chunks)
        self.backend = backend

    @property
    def bytes_loaded(self) -> int:
        return self.bytes_read

    async def load_layer(self, layer: int, kv: KVCache) -> int:
        """Place layer `layer` of every open chunk into `kv` (keys re-rotated); returns bytes read."""
        return await self.read_layer(layer, kv)

    def place(self, layer: int, j: int, data: bytes, kv: KVCache) -> None:
        super().place(layer, j, data, kv)
        chunk = self.chunks[j]
        if chunk.offset != chunk.stored_at:
            o, n = chunk.offset, chunk.n_tokens
            k = kv.data[layer, 0, :, o : o + n]
            k.copy_(self.backend.rerotate_keys(k, chunk.stored_at, o))
