"""The keys of a vLLM request's chunks: everything its KV depends on, or no keys at all.

As vLLM's own prefix cache (`kv_cache_utils.generate_block_hash_extra_keys`), the connector keys more
than the token ids:

* **the tenant's `cache_salt`**: the request's namespace (`core.keys.namespaced`), so a `Restorer` of
  `namespace=` the same string shares its chunks, and no other salt (nor none) does;
* **a LoRA adapter**: a digest of its files, weights and config (`core.fingerprint.of_adapter`: the same
  on every machine and after a restart; never vLLM's per-process id), hashed into the key space after the
  salt;
* **multimodal items**: each item's hash (`identifier`, as vLLM's prefix cache uses it) and placeholder
  range are folded into the chunk where the item starts (`chunk_keys`' extras), so that chunk and every
  later one differ per image.

What it cannot key is neither saved nor loaded (`Unkeyable`): prompt embeddings, a multimodal item
without a hash, an adapter whose files are not readable here. Each such request is counted
(`unkeyed_requests`), and each reason logged once per process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.fingerprint import of_adapter
from kvrestore.core.keys import ChunkRef, Extra, chunk_keys, namespaced
from kvrestore.integrations.vllm.stats import emit


class Unkeyable(Exception):
    """The request's KV depends on something the connector cannot name in a key (the message says what)."""


@dataclass(frozen=True)
class RequestSpace:
    """What a request's chunk keys are hashed under: the key space, and the per-position extras."""

    space: str
    extras: tuple[Extra, ...] = ()

    def refs(self, tokens: Sequence[int], chunk_size: int) -> list[ChunkRef]:
        return chunk_keys(tokens, self.space, chunk_size, self.extras)


class RequestKeys:
    """The key space of each request, from the connector's base key space (model, dtype, encoding)."""

    def __init__(self, base_space: str) -> None:
        self.base_space = base_space
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def space_of(self, request: Any) -> RequestSpace:
        """The request's `RequestSpace`; Unkeyable where its KV depends on what no key names."""
        if getattr(request, "prompt_embeds", None) is not None:
            raise Unkeyable("its prompt is embeddings, which no token id names")
        if getattr(request, "prompt_token_ids", None) is None:
            raise Unkeyable("it has no prompt token ids")
        try:
            space = namespaced(self.base_space, getattr(request, "cache_salt", None) or None)
        except InvalidInputError:  # (the salt is a tenant's: not logged)
            raise Unkeyable("its cache_salt is not a string UTF-8 can encode") from None
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            path = getattr(lora, "lora_path", "") or getattr(lora, "path", "")
            if not path:
                raise Unkeyable(f"the LoRA adapter {getattr(lora, 'lora_name', '?')!r} has no path")
            try:
                identity = of_adapter(path)
            except (OSError, InvalidInputError) as exc:
                raise Unkeyable(f"the LoRA adapter at {path!r} cannot be read here ({exc})") from exc
            space = namespaced(space, identity, kind="adapter")
        extras = []
        for feature in getattr(request, "mm_features", None) or ():
            identifier = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
            position = getattr(feature, "mm_position", None)
            if not identifier or position is None:
                raise Unkeyable("a multimodal input has no hash or no position")
            modality = getattr(feature, "modality", "")
            blob = f"{modality}\0{identifier}\0{int(position.length)}".encode()
            extras.append((int(position.offset), blob))
        return RequestSpace(space, tuple(extras))

    def refs(self, request: Any, tokens: Sequence[int], chunk_size: int) -> list[ChunkRef] | None:
        """The request's chunks with their keys, or None (logged once per reason) where it is unkeyable."""
        try:
            return self.space_of(request).refs(tokens, chunk_size)
        except Unkeyable as exc:
            reason = str(exc)
            with self._lock:
                first = reason not in self._logged
                self._logged.add(reason)
            if first:
                emit(
                    logging.WARNING,
                    "unkeyed",
                    "request %(request)s is neither loaded nor saved: %(reason)s (logged once per reason)",
                    request=getattr(request, "request_id", "?"),
                    reason=reason,
                )
            return None


__all__ = ["RequestKeys", "RequestSpace", "Unkeyable"]
