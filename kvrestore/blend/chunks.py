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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from kvrestore import codec
from kvrestore.chunkio.dest import CacheRows
from kvrestore.chunkio.layers import LayerReader
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.codec.seal import Seal
from kvrestore.core.keys import ChunkRef, content_key
from kvrestore.core.kv import KVCache
from kvrestore.core.streams import upload
from kvrestore.stores.base import ChunkStore

if TYPE_CHECKING:
    from kvrestore.backends.hf import HFBackend


_NO_PREFIX = torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class BlendKeys:
    """How a blend's chunks are keyed and signed: their key space (the model's fingerprint, with a
    namespace where there is one: `core.keys.namespaced`) and the seal of a restorer with a secret."""

    space: str
    seal: Seal | None = None


def chunk_key(
    backend: HFBackend, tokens: torch.Tensor, prefix: torch.Tensor | None = None, space: str | None = None
) -> str:
    """The content key of a chunk (saved after `prefix`, if any) in key space `space` (default: the
    model's fingerprint, no namespace)."""
    space = backend.spec.fingerprint if space is None else space
    if prefix is None or len(prefix) == 0:
        return content_key(tokens, space)
    # -1 is no token id: (prefix, chunk) pairs that concatenate alike still get different keys
    sep = torch.tensor([-1, len(prefix)], dtype=torch.int64)
    return content_key(torch.cat([prefix.to(torch.int64), sep, tokens.to(torch.int64)]), space)


async def save_chunk(
    backend: HFBackend,
    store: ChunkStore,
    tokens: torch.Tensor,
    *,
    prefix: torch.Tensor | None = None,
    compression: str = "none",
    overwrite: bool = False,
    keys: BlendKeys | None = None,
) -> tuple[str, int]:
    """Prefill `tokens` alone (after `prefix`, if given) and store the chunk's KV under its content key
    (in `keys`' space, signed with its seal).

    Returns (key, bytes written); an already stored chunk is not recomputed (0 bytes) unless `overwrite`.
    """
    prefix = _NO_PREFIX if prefix is None else prefix
    keys = keys or BlendKeys(backend.spec.fingerprint)
    key = chunk_key(backend, tokens, prefix, keys.space)
    if not overwrite and (await store.contains([key]))[0]:
        return key, 0

    def encode() -> bytes:
        p = len(prefix)
        past = backend.prefill_chunk(prefix, None, 0).data if p else None
        chunk = backend.prefill_chunk(tokens, past, p)  # stored with start = p: its positions
        return codec.encode_chunk(chunk, backend.spec, key, compression=compression, seal=keys.seal)

    blob = await anyio.to_thread.run_sync(encode)
    await store.put(key, blob)
    return key, len(blob)


class RotatedRows(CacheRows):
    """A blend's cache rows (`chunkio.dest`), the keys of every chunk placed elsewhere than where it was
    saved (`ChunkRef.start`) re-rotated to where it sits once its sections are in place."""

    def __init__(self, backend: HFBackend) -> None:
        super().__init__()
        self.backend = backend
        self._rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def placed(self, reader: LayerReader, layers: range, chunks: Sequence[int], kv: KVCache) -> None:
        """Re-rotate the keys of `chunks` on `layers` (in place). On the device path (CUDA) one rotation
        covers the layers whole (the identity, exactly, on rows of chunks that did not move; other rows
        are recomputed after this anyway): a few kernels per read instead of a few per chunk and layer.
        The angles are the same for every layer: made once."""
        stored = reader.chunks
        moved = [j for j in chunks if stored[j].offset != stored[j].start]
        if not moved:
            return
        keys = kv.data[layers.start : layers.stop, 0]  # [n, H, N, D]
        if reader.defers(kv):  # the device path (on a CPU cache in tests: the same ops)
            rotation = self._rotations.get(-1)
            if rotation is None or rotation[0].device != keys.device or rotation[0].shape[0] != keys.shape[2]:
                old = torch.arange(keys.shape[2], dtype=torch.int64)
                new = old.clone()
                for c in stored:
                    old[c.offset : c.offset + c.n_tokens] = torch.arange(c.start, c.end)
                old, new = upload(old, keys.device), upload(new, keys.device)
                rotation = self._rotations[-1] = self.backend.rerotation(keys, old, new)
            keys.copy_(self.backend.rerotate_keys(keys, 0, 0, rotation))
            return
        for j in moved:
            chunk = stored[j]
            k = keys[:, :, chunk.offset : chunk.offset + chunk.n_tokens]
            rotation = self._rotations.get(j)
            if rotation is None:
                rotation = self._rotations[j] = self.backend.rerotation(k, chunk.start, chunk.offset)
            k.copy_(self.backend.rerotate_keys(k, chunk.start, chunk.offset, rotation))


class StoreChunkSource(LayerReader):
    """Loads the chunks of one blend from a store, layer by layer, into a KVCache at their offsets,
    re-rotating the keys of every chunk placed elsewhere than where it was saved (`stored_at`, the
    shared prefix's length: `RotatedRows`). Into a CUDA cache the layers' checks are deferred
    (`chunkio.deferred`): the blend's cache is its own until it returns, so the fusor reads the checks
    once, at the end (`verify`), and a damaged chunk restarts the blend with its tokens recomputed."""

    def __init__(
        self,
        backend: HFBackend,
        store: ChunkStore,
        keys: Sequence[str],
        offsets: Sequence[int],
        lengths: Sequence[int],
        stored_at: int = 0,
        lane: TransferLane | None = None,
        defer_checks: bool | None = None,
        **options: Any,
    ) -> None:
        """`options`: the rest of `LayerReader`'s (`ahead`, `layers_per_read`), passed on as they are."""
        chunks = [
            ChunkRef(j, stored_at, stored_at + n, k, at=o)
            for j, (k, o, n) in enumerate(zip(keys, offsets, lengths, strict=True))
        ]
        dest = RotatedRows(backend)
        super().__init__(
            backend.spec, store, chunks, lane=lane, defer_checks=defer_checks, dest=dest, **options
        )

    async def load_layer(self, layer: int, kv: KVCache) -> int:
        """Place layer `layer` of every open chunk into `kv` (keys re-rotated); returns bytes read."""
        return await self.read_layer(layer, kv)
