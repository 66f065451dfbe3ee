"""A model's fingerprint: the identity its chunk keys and chunk headers carry.

It names every weight, so two models that differ in one element never share a chunk:

* `of_tensors` hashes every byte of every tensor it is given (`HFBackend(model)` gives every parameter
  and buffer of the model), each with its name, shape and dtype, plus the model's config and KV dtype.
* `of_checkpoint` hashes a local checkpoint directory's files instead: the content of every weight file
  at its top level (``*.safetensors``, ``*.bin``), its ``config.json`` and the KV dtype. It needs no
  model in memory, so `HFBackend.from_pretrained` and the vLLM connector compute it alike, without
  loading anything, and two processes on one checkpoint share their chunks.

Each weight file is read once: its digest is cached under kvrestore's cache directory, keyed by the
file's real path, size, modification and change times, inode and device, so a restart pays a `stat` per
file. A file changed less than `RACY_S` seconds ago is hashed but not cached (a file rewritten within
one tick of the file system's clock keeps its times), and a cached entry is used only if the key it
stores is the file's key now.

The content hash is xxh3-128: fast (it runs at memory speed), and a name, not a signature. Chunk keys
and fingerprints are public: anyone who writes a store can compute any model's keys without a
collision, so the fingerprint keeps honest models apart, and the secret (`codec.seal`) is what keeps
a store's other writers from planting KV.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.paths import cache_root
from kvrestore.core.spec import dtype_name

#: the files of a checkpoint directory hashed as its weights (transformers loads these)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
#: a file modified or changed less than this many seconds ago is hashed every time, never cached
RACY_S = 2.0
_STEP_BYTES = 64 << 20
_TENSORS = b"kvrestore-fingerprint-v2|tensors\0"
_CHECKPOINT = b"kvrestore-fingerprint-v2|checkpoint\0"

# Config entries that say where or with what a model was loaded, not what it computes: a model copied
# to another directory, or loaded by another transformers release, still shares its cache.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "quantization_config"}


def of_tensors(
    config: Mapping[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> str:
    """The fingerprint of a model in memory: its config, KV dtype, and every byte of `named_tensors`."""
    h = _start(_TENSORS, config, dtype)
    for name, tensor in named_tensors:
        t = tensor.detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\0".encode())
        raw = t.reshape(-1).contiguous().view(torch.uint8).cpu()
        h.update(xxhash.xxh3_128_digest(raw.numpy().data))
    return h.hexdigest()


def of_checkpoint(
    path: str | os.PathLike[str], dtype: torch.dtype, cache_dir: str | os.PathLike[str] | None = None
) -> str:
    """The fingerprint of the local checkpoint directory `path` loaded in `dtype`: its config.json and
    the content of every top-level weight file (digests cached under `cache_dir`'s ``fingerprints``,
    default kvrestore's cache directory).

    Raises
    ------
    InvalidInputError
        Not a directory, no weight file in it, or no readable config.json.
    """
    root = Path(path)
    if not root.is_dir():
        raise InvalidInputError(f"{str(path)!r} is not a local checkpoint directory")
    files = sorted(f for f in root.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    if not files:
        raise InvalidInputError(
            f"{str(path)!r} holds no weight file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})"
        )
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"{str(path)!r} has no readable config.json: {e}") from None
    if not isinstance(config, dict):
        raise InvalidInputError(f"{str(root / 'config.json')!r} is not a JSON object")
    h = _start(_CHECKPOINT, config, dtype)
    digests = DigestCache(cache_root(cache_dir) / "fingerprints")
    for f in files:
        h.update(f"{f.name}\0".encode("utf-8", "surrogateescape"))
        h.update(digests.digest(f))
    return h.hexdigest()


def _start(domain: bytes, config: Mapping[str, Any], dtype: torch.dtype) -> Any:
    identity = {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.blake2b(domain, digest_size=16)
    h.update(json.dumps(identity, sort_keys=True, default=str).encode())
    h.update(f"\0{dtype_name(dtype)}\0".encode())
    return h


def file_digest(path: str | os.PathLike[str]) -> bytes:
    """xxh3-128 of a file's content, hashed from a read-only mapping in 64 MiB steps (no copy: twice
    the rate of reading into a buffer here). Like loading safetensors, which maps them too, it expects
    the file not to be truncated while it reads."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for start in range(0, size, _STEP_BYTES):
                        h.update(view[start : start + _STEP_BYTES])
                finally:
                    view.release()
    return h.digest()


class DigestCache:
    """Files' content digests, one small JSON file per file under `root`, written atomically (a temp file
    renamed over the entry), each holding the key it was computed for."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def key(path: Path) -> list[Any]:
        """What a cached digest stands for: the file's real path, size, times, inode and device."""
        st = os.stat(path)
        real = os.path.realpath(path)
        return [real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]

    def _entry(self, key: list[Any]) -> Path:
        name = hashlib.blake2b(json.dumps(key).encode(), digest_size=16).hexdigest()
        return self.root / f"{name}.json"

    def lookup(self, key: list[Any]) -> bytes | None:
        """The digest cached for `key`, if one is (a damaged or foreign entry counts as none)."""
        try:
            saved = json.loads(self._entry(key).read_text())
            if saved["key"] == key and len(saved["xxh3_128"]) == 32:
                return bytes.fromhex(saved["xxh3_128"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def digest(self, path: Path) -> bytes:
        """`path`'s content digest: cached, or read (and cached unless the file changed meanwhile or
        very recently)."""
        key = self.key(path)
        cached = self.lookup(key)
        if cached is not None:
            return cached
        digest = file_digest(key[0])
        if self.key(path) == key and time.time_ns() - max(key[2], key[3]) > RACY_S * 1e9:
            self._store(key, digest)
        return digest

    def _store(self, key: list[Any], digest: bytes) -> None:
        """Write an entry atomically; a cache that cannot be written is no cache (nothing fails)."""
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"key": key, "xxh3_128": digest.hex()}, f)
                os.replace(tmp, self._entry(key))
            except OSError:
                os.unlink(tmp)
                raise


__all__ = ["RACY_S", "WEIGHT_SUFFIXES", "DigestCache", "file_digest", "of_checkpoint", "of_tensors"]
