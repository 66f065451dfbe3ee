"""ModelSpec: what a KV cache's shape and identity depend on.

The fingerprint covers the model config, the weights and the KV dtype, so two models (or the same
model in two dtypes) never read each other's chunks: every chunk key and every chunk header carries it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from kvrestore.core.errors import InvalidInputError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Elements hashed per weight tensor. Hashing every byte of a 7B model would take tens of seconds at
# start-up; a strided sample of each tensor (plus its name, shape and dtype) tells apart any two
# checkpoints that differ in training (fine-tunes change almost every weight).
_SAMPLE_ELEMENTS = 1 << 16

# Config entries that say where or with what a model was loaded, not what it computes: a model copied
# to another directory, or loaded by another transformers release, still shares its cache.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "quantization_config"}


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

    @staticmethod
    def compute_fingerprint(
        config: dict[str, Any], named_tensors: Any, dtype: torch.dtype, extra: str = ""
    ) -> str:
        """blake2b over the canonical config JSON, a strided sample of every weight tensor, and dtype."""
        h = hashlib.blake2b(digest_size=16)
        h.update(b"kvrestore-spec-v1\0")
        identity = {
            k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
        }
        h.update(json.dumps(identity, sort_keys=True, default=str).encode())
        h.update(dtype_name(dtype).encode())
        h.update(extra.encode())
        for name, tensor in named_tensors:
            t = tensor.detach()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
            flat = t.reshape(-1)
            step = max(1, flat.numel() // _SAMPLE_ELEMENTS)
            sample = flat[::step].to(device="cpu", dtype=torch.float32).contiguous()
            h.update(sample.numpy().tobytes())
        return h.hexdigest()
