"""Chunk stores and `open_store(url)`.

Like fsspec's protocol registry: a URL's scheme picks a factory `factory(url, **options) -> ChunkStore`
(the built-in ones: `open_store`; `register_store` adds more). Wrappers compose: `TieredStore([memory,
disk, s3])`, `PrefetchStore(s3)`, `BoundedStore(any, n)`; every call a wrapper does not change reaches
the store inside it (`WrapperStore`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.stores.base import ChunkStore, StoredObject, check_key
from kvrestore.stores.bounded import BoundedStore
from kvrestore.stores.eviction import FIFO, LRU, EvictionPolicy
from kvrestore.stores.local import LocalStore
from kvrestore.stores.memory import MemoryStore
from kvrestore.stores.prefetch import PrefetchStore
from kvrestore.stores.readonly import ReadOnlyStore
from kvrestore.stores.remote import FsspecStore
from kvrestore.stores.throttled import ThrottledStore
from kvrestore.stores.tiered import TieredStore, TierStats
from kvrestore.stores.urls import SCHEME, split_store_url
from kvrestore.stores.wrapper import WrapperStore

StoreFactory = Callable[..., ChunkStore]

_REGISTRY: dict[str, StoreFactory] = {}


def register_store(scheme: str, factory: StoreFactory, *, clobber: bool = False) -> None:
    """Make `open_store("<scheme>://...")` call `factory(url, **options)`; the scheme joins the known
    ones every refused URL names."""
    if not isinstance(scheme, str) or SCHEME.fullmatch(scheme) is None:
        raise InvalidInputError(
            f"a store scheme is a letter then letters, digits, '+', '-' or '.' (as 'redis'), got {scheme!r}"
        )
    scheme = scheme.lower()
    if scheme in _REGISTRY and _REGISTRY[scheme] is not factory and not clobber:
        raise InvalidInputError(
            f"a store is already registered for {scheme}://; pass clobber=True to replace it"
        )
    _REGISTRY[scheme] = factory


def known_schemes() -> list[str]:
    """The schemes `open_store` opens: the built-in ones and every one `register_store` added."""
    return sorted(_REGISTRY)


def check_store_url(url: str | os.PathLike[str]) -> str:
    """The scheme `open_store(url)` would open (``"file"`` for a plain path), opening nothing; raises as
    `open_store` does for a URL no store takes (`kvrestore.stores.urls`)."""
    return split_store_url(url, _REGISTRY)[0]


def open_store(url: str | os.PathLike[str], **options: Any) -> ChunkStore:
    """Open the store a URL names.

    Parameters
    ----------
    url: str or os.PathLike
        `"memory://"` (a `MemoryStore`), `"file:///var/cache/kv"` (an absolute path) or a plain path (a
        `LocalStore`; made by its first write), `"s3://bucket/prefix"` (an `FsspecStore` over s3fs, the
        `s3` extra), `"redis://host:port/db"` (and `rediss://`, `redis+cluster://`: a `RedisStore`, the
        `redis` extra), `"mooncake://master_host:port"` (a `MooncakeStore`, the `mooncake` extra), or a
        scheme added with `register_store`. Anything else is refused, never guessed at: an unknown
        scheme, a scheme without "://" (`"memory:/"`), whitespace around the URL,
        `"file://relative/dir"` (`kvrestore.stores.urls`).
    **options
        `read_only=True` for every scheme: the store is read and never written (a put or a delete is a
        `StoreError`; a local directory must exist, and nothing is created in it, not even a probe or
        a lock file; `capacity_bytes` is refused: a store that never writes never evicts). Then the store's
        own: `capacity_bytes` and `eviction` (default LRU) for every built-in store but Mooncake's, a
        store that really evicts (a local directory, S3 or Redis with a capacity is wrapped in a
        `BoundedStore`), s3fs's options (`endpoint_url`, `key`, `secret`, `config_kwargs`, ...) for S3,
        `RedisStore`'s and `MooncakeStore`'s for theirs.

    Returns
    -------
    ChunkStore

    Raises
    ------
    InvalidInputError
        An empty URL, one with no path ("file://"), a malformed one (see `url`), or an option the store
        would silently ignore.
    UnsupportedURLError
        A scheme no store is registered for (the message names the known ones).
    StoreError
        A directory that cannot be created or written.
    """
    scheme, url = split_store_url(url, _REGISTRY)
    factory = _REGISTRY[scheme]
    read_only = options.pop("read_only", False)
    if not isinstance(read_only, bool):
        raise InvalidInputError(f"read_only must be True or False, got {read_only!r}")
    if read_only and (options.get("capacity_bytes") is not None or options.get("eviction") is not None):
        raise InvalidInputError(
            "read_only=True takes no capacity_bytes or eviction: a store that is never written never "
            "evicts (the processes that write it keep its capacity)"
        )
    if read_only and factory is _local:  # opens read-only itself, keeping its blocking reads
        return factory(url, read_only=True, **options)
    store = factory(url, **options)
    return ReadOnlyStore(store) if read_only else store


def _memory(url: str, capacity_bytes: int | None = None, eviction: Any = None, **unknown: Any) -> ChunkStore:
    if url.partition("://")[2]:
        raise InvalidInputError(
            f"memory:// takes no name or path, got {url!r}: each open_store('memory://') is a new, empty "
            "store of this process (share one by passing the store object)"
        )
    if unknown:
        raise InvalidInputError(
            f"memory:// takes capacity_bytes and eviction, not {', '.join(sorted(unknown))}"
        )
    return MemoryStore(capacity_bytes=capacity_bytes, eviction=eviction)


def _bounded(store: ChunkStore, capacity_bytes: int | None, eviction: Any) -> ChunkStore:
    if capacity_bytes is None:
        if eviction is not None:
            raise InvalidInputError("eviction needs capacity_bytes (a store without a capacity never evicts)")
        return store
    return BoundedStore(store, capacity_bytes, eviction=eviction)


def _local(url: str, capacity_bytes: int | None = None, eviction: Any = None, **options: Any) -> ChunkStore:
    return _bounded(LocalStore(url, **options), capacity_bytes, eviction)


def _s3(url: str, capacity_bytes: int | None = None, eviction: Any = None, **options: Any) -> ChunkStore:
    """s3fs options pass through: key/secret, endpoint_url, client_kwargs, config_kwargs, ...

    Unless given, botocore's connect timeout is 5 s, its read timeout 20 s, and it tries a request
    twice (not 60 s, 60 s, 5 times): a restore against an unreachable server falls back to compute
    within seconds. (A `Restorer` bounds every call by its own deadlines besides.) A bucket that does
    not exist is a `StoreError` on writing and a miss on reading; `create_bucket=True` creates it on
    the first write instead.
    """
    if importlib.util.find_spec("s3fs") is None:
        raise StoreError(f"{url!r} needs s3fs, which is not installed: pip install kvrestore[s3]")
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 5)
    config.setdefault("read_timeout", 20)
    config.setdefault("retries", {"max_attempts": 2})
    options["config_kwargs"] = config
    return _bounded(FsspecStore(url, **options), capacity_bytes, eviction)


def _redis(url: str, capacity_bytes: int | None = None, eviction: Any = None, **options: Any) -> ChunkStore:
    """`RedisStore` options pass through (password, username, db, prefix, TLS, timeouts). Without a
    capacity the server's own `maxmemory` policy evicts; with one, a `BoundedStore` keeps it."""
    from kvrestore.stores.redis_store import RedisStore

    return _bounded(RedisStore(url, **options), capacity_bytes, eviction)


def _mooncake(
    url: str, capacity_bytes: int | None = None, eviction: Any = None, **options: Any
) -> ChunkStore:
    """`MooncakeStore` options pass through (metadata_server, protocol, segment and buffer sizes).
    Mooncake evicts within the memory its storage nodes lend; it lists no objects, so kvrestore's own
    capacity (which is rebuilt from a listing) is refused."""
    from kvrestore.stores.mooncake_store import MooncakeStore

    if capacity_bytes is not None or eviction is not None:
        raise InvalidInputError(
            "mooncake:// takes no capacity_bytes or eviction: Mooncake evicts within the memory its "
            "storage nodes lend (mooncake_client --global_segment_size), and lists no objects from which "
            "a capacity of kvrestore's own could be rebuilt"
        )
    return MooncakeStore(url, **options)


register_store("memory", _memory)
register_store("file", _local)
register_store("s3", _s3)
for _scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
    register_store(_scheme, _redis)
register_store("mooncake", _mooncake)

__all__ = [
    "FIFO",
    "LRU",
    "BoundedStore",
    "ChunkStore",
    "EvictionPolicy",
    "FsspecStore",
    "LocalStore",
    "MemoryStore",
    "PrefetchStore",
    "ReadOnlyStore",
    "StoreFactory",
    "StoredObject",
    "TierStats",
    "TieredStore",
    "ThrottledStore",
    "WrapperStore",
    "check_key",
    "check_store_url",
    "known_schemes",
    "open_store",
    "register_store",
]
