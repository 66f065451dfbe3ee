"""The keys of a vLLM request's chunks: everything its KV depends on, or no keys at all.

As vLLM's own prefix cache (`kv_cache_utils.generate_block_hash_extra_keys`), the connector keys more
than the token ids:

* **the tenant's `cache_salt`**: the request's namespace (`core.keys.namespaced`), so a `Restorer` of
  `namespace=` the same string shares its chunks, and no other salt (nor none) does;
* **a LoRA adapter**: a digest of its files, weights and config (`AdapterIdentities`: the same on every
  machine and after a restart; never vLLM's per-process id), hashed into the key space after the salt;
* **multimodal items**: each item's hash (`identifier`, as vLLM's prefix cache uses it) and placeholder
  range are folded into the chunk where the item starts (`chunk_keys`' extras), so that chunk and every
  later one differ per image.

What it cannot key is neither saved nor loaded (`Unkeyable`): prompt embeddings, a multimodal item
without a hash, an adapter whose files are not readable here. Each such request is counted
(`unkeyed_requests`), and each reason logged once per process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrestore.core.errors import InvalidInputError
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


def adapter_files(path: Path) -> list[Path]:
    """The files of a LoRA adapter directory (or the one file), in a stable order."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


class AdapterIdentities:
    """`adapter_identity` per adapter path, hashed once per version of its files (a file's size and
    modification time change: hashed again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}

    def of(self, lora_path: str) -> str:
        """A digest of the adapter's files (names and bytes): the same adapter gives the same identity on
        every machine; Unkeyable where the path is no readable local file or directory."""
        path = Path(lora_path)
        try:
            files = adapter_files(path) if path.exists() else []
            stamp = tuple((str(f.relative_to(path)) if f != path else f.name, *_stat(f)) for f in files)
            if not files:
                raise Unkeyable(f"the LoRA adapter at {lora_path!r} is no local file or directory")
            with self._lock:
                known = self._known.get((lora_path, stamp))
            if known is not None:
                return known
            h = hashlib.blake2b(digest_size=20, person=b"kvr-lora")
            for f, (name, _, _) in zip(files, stamp, strict=True):
                h.update(name.encode() + b"\0")
                with open(f, "rb") as fh:
                    while block := fh.read(1 << 20):
                        h.update(block)
                h.update(b"\0")
        except OSError as exc:
            raise Unkeyable(f"the LoRA adapter at {lora_path!r} cannot be read here ({exc})") from exc
        identity = h.hexdigest()
        with self._lock:
            self._known[(lora_path, stamp)] = identity
        return identity


def _stat(f: Path) -> tuple[int, int]:
    st = os.stat(f)
    return st.st_size, st.st_mtime_ns


class RequestKeys:
    """The key space of each request, from the connector's base key space (model, dtype, encoding)."""

    def __init__(self, base_space: str) -> None:
        self.base_space = base_space
        self.adapters = AdapterIdentities()
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
            space = namespaced(space, self.adapters.of(path), kind="adapter")
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


__all__ = ["AdapterIdentities", "RequestKeys", "RequestSpace", "Unkeyable", "adapter_files"]
