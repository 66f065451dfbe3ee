"""ModelSpec: what a KV cache's shape and identity depend on.

The fingerprint (`core.fingerprint`) covers the model config, every weight and the KV dtype, so two
models (or the same model in two dtypes) never read each other's chunks: every chunk key and every chunk
header carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrestore.core.errors import InvalidInputError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise InvalidInputError(f"unsupported KV dtype {dtype}; use one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class ModelSpec:
    """Shape and identity of a model's KV cache."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    fingerprint: str  # hex digest: config + weights + dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
