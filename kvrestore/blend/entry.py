"""CacheBlend as `Restorer` offers it: token ids in, checked the way every restore checks them.

`save_chunk`, `restore_blend` and `choose_blend_store` (chunks, fuse, placement) take validated token
tensors; these take what a caller has (lists, [1, n] tensors, None for no prefix or suffix), refuse
bad input with `InvalidInputError` before any work, and hold a blend to the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrestore.backends.base import ComputeBackend
from kvrestore.backends.hf import HFBackend
from kvrestore.blend.chunks import BlendKeys, save_chunk
from kvrestore.blend.fuse import BlendResult, restore_blend
from kvrestore.chunkio.transfer import TransferLane
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.tokens import TokenIds, check_length, model_tokens, optional_tokens
from kvrestore.policies.blend import Blend
from kvrestore.stores.base import ChunkStore


def blend_backend(backend: ComputeBackend) -> HFBackend:
    """`backend` as CacheBlend needs it: one that re-rotates stored keys and recomputes selected tokens
    layer by layer (`HFBackend`); anything else is refused before any work."""
    if not isinstance(backend, HFBackend):
        raise InvalidInputError(
            f"CacheBlend needs a backend that re-rotates keys and recomputes selected tokens (HFBackend), "
            f"got {type(backend).__name__}"
        )
    return backend


async def save_prompt_chunk(
    backend: ComputeBackend,
    store: ChunkStore,
    token_ids: TokenIds,
    prefix: TokenIds | None,
    compression: str,
    keys: BlendKeys | None = None,
) -> str:
    """`Restorer.save_chunk`: the chunk's content key, after storing it unless it is stored already."""
    tokens = model_tokens(backend, token_ids)
    head = optional_tokens(backend, prefix)
    check_length(backend, len(head) + len(tokens), "the prefix and chunk")
    key, _ = await save_chunk(
        blend_backend(backend), store, tokens, prefix=head, compression=compression, keys=keys
    )
    return key


async def blend_prompt(
    backend: ComputeBackend,
    store: ChunkStore,
    chunks: Sequence[TokenIds],
    suffix: TokenIds | None,
    policy: Blend | None,
    prefix: TokenIds | None,
    lane: TransferLane,
    keys: BlendKeys | None = None,
) -> BlendResult:
    """`Restorer.restore_blend`: checks the parts, then blends them (`fuse.restore_blend`)."""
    if isinstance(chunks, (str, bytes, torch.Tensor)) or not isinstance(chunks, Sequence):
        raise InvalidInputError("chunks must be a list of token-id sequences, one per chunk")
    if policy is not None and not isinstance(policy, Blend):
        raise InvalidInputError(f"policy must be a Blend (or None), got {policy!r}")
    parts = [model_tokens(backend, c) for c in chunks]
    tail, head = optional_tokens(backend, suffix), optional_tokens(backend, prefix)
    total = len(head) + sum(len(t) for t in parts) + len(tail)
    check_length(backend, total, "the blend (prefix, chunks and suffix)")
    return await restore_blend(
        blend_backend(backend), store, parts, tail, policy, prefix=head, lane=lane, keys=keys
    )
