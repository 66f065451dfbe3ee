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

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import torch

from .. import codec
from ..engine import LOAD_FAULTS
from ..errors import ChunkDecodeError, KVRestoreError, MissingChunkError
from ..keys import content_key
from ..kv import KVCache
from ..stores.base import ChunkStore

if TYPE_CHECKING:
    from ..backends.hf import HFBackend


class ChunkLoadFailed(KVRestoreError):
    """A chunk's layer could not be loaded after the blend started; the fusor restarts without it."""

    def __init__(self, indices: Sequence[int], error: str) -> None:
        super().__init__(f"chunks {list(indices)}: {error}")
        self.indices = list(indices)
        self.error = error


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


@dataclass
class _Opened:
    header: codec.ChunkHeader
    offset: int  # the chunk's first position in the blended prompt
    n_tokens: int


class StoreChunkSource:
    """Loads the chunks of one blend from a store, layer by layer, into a KVCache at their offsets."""

    def __init__(
        self,
        backend: HFBackend,
        store: ChunkStore,
        keys: Sequence[str],
        offsets: Sequence[int],
        lengths: Sequence[int],
        stored_at: int = 0,
    ) -> None:
        self.backend = backend
        self.stored_at = stored_at  # the position every chunk was saved at (the shared prefix's length)
        self.spec = backend.spec
        self.store = store
        self.keys = list(keys)
        self.offsets = list(offsets)
        self.lengths = list(lengths)
        self._opened: dict[int, _Opened] = {}
        self.errors: list[str] = []
        self.bytes_loaded = 0

    async def open(self) -> list[bool]:
        """Fetch and check every chunk's header concurrently; which chunks can be loaded."""

        async def one(j: int) -> None:
            key = self.keys[j]
            try:
                prefix = await self.store.get_range(key, 0, codec.HEADER_PROBE)
                if prefix is None:
                    raise MissingChunkError("not in the store")
                if len(prefix) >= codec.PREFIX_SIZE and codec.header_length(prefix) > len(prefix):
                    prefix = await self.store.get_range(key, 0, codec.header_length(prefix))
                    if prefix is None:
                        raise MissingChunkError("disappeared from the store")
                header, _ = codec.read_header(prefix)
                codec.check_header(header, self.spec, key, self.stored_at, self.lengths[j])
                self.bytes_loaded += len(prefix)
                self._opened[j] = _Opened(header, self.offsets[j], self.lengths[j])
            except LOAD_FAULTS as exc:
                if not isinstance(exc, MissingChunkError):
                    self.errors.append(f"chunk {j}: {type(exc).__name__}: {exc}")
                if isinstance(exc, ChunkDecodeError) and not isinstance(exc, MissingChunkError):
                    await self._forget(key)

        async with anyio.create_task_group() as tg:
            for j in range(len(self.keys)):
                tg.start_soon(one, j)
        return [j in self._opened for j in range(len(self.keys))]

    def drop(self, j: int) -> None:
        """Stop loading chunk j (it failed; its tokens are recomputed)."""
        self._opened.pop(j, None)

    async def load_layer(self, layer: int, kv: KVCache) -> int:
        """Place layer `layer` of every open chunk into `kv` (keys re-rotated); returns bytes read."""
        total = 0
        failed: list[int] = []

        async def one(j: int, opened: _Opened) -> None:
            nonlocal total
            key = self.keys[j]
            try:
                (a, b) = codec.layer_ranges(opened.header, [layer])[0]
                data = await self.store.get_range(key, a, b)
                if data is None:
                    raise MissingChunkError("disappeared from the store")
                await anyio.to_thread.run_sync(self._place, layer, opened, data, kv)
                total += len(data)
            except LOAD_FAULTS as exc:
                self.errors.append(f"chunk {j} layer {layer}: {type(exc).__name__}: {exc}")
                if isinstance(exc, ChunkDecodeError) and not isinstance(exc, MissingChunkError):
                    await self._forget(key)
                failed.append(j)

        async with anyio.create_task_group() as tg:
            for j, opened in list(self._opened.items()):
                tg.start_soon(one, j, opened)
        self.bytes_loaded += total
        if failed:
            raise ChunkLoadFailed(sorted(failed), self.errors[-1])
        return total

    def _place(self, layer: int, opened: _Opened, data: bytes, kv: KVCache) -> None:
        o, n = opened.offset, opened.n_tokens
        dest = kv.data[layer : layer + 1, :, :, o : o + n]
        if dest.device.type == "cpu":
            codec.decode_layers(opened.header, {layer: data}, self.spec, [layer], out=dest)
        else:
            dest.copy_(codec.decode_layers(opened.header, {layer: data}, self.spec, [layer]))
        if o != self.stored_at:
            k = kv.data[layer, 0, :, o : o + n]
            k.copy_(self.backend.rerotate_keys(k, self.stored_at, o))

    async def _forget(self, key: str) -> None:
        """A damaged object is never served again (best effort; the miss is what matters)."""
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.store.delete(key)
