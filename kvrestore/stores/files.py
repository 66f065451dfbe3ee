"""What the local-directory store (`LocalStore`) and the fsspec-remote store (`FsspecStore`) share.

Both keep one object a file, at `<root>/<key[:2]>/<key>.kvc`: 256 shard directories keep listings short
on disk, and a listing can tell an object from a foreign file by its name alone. Both take a URL whose
scheme picks an fsspec filesystem class; a local one makes a `LocalStore`, any other an `FsspecStore`.
"""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.settings import check_text
from kvrestore.stores.base import is_key

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"


def filesystem_class(url: str) -> type[fsspec.AbstractFileSystem]:
    """The fsspec filesystem class `url` names; refuses a URL with no directory or bucket in it."""
    protocol, path = fsspec.core.split_protocol(check_text("url", url))
    if not path.strip():  # "file://" would be the current directory, "s3://" no bucket
        raise InvalidInputError(f"store URL {url!r} names no directory or bucket")
    try:
        return fsspec.get_filesystem_class(protocol or "file")
    except (ImportError, ValueError) as e:
        raise StoreError(f"cannot open {url!r}: {e}") from e


def is_local(fs_cls: type[Any]) -> bool:
    """Whether a filesystem class is the local disk (served by `LocalStore`, not through fsspec)."""
    return issubclass(fs_cls, LocalFileSystem)


def stored_key(name: str, shard: str) -> str | None:
    """The key a file named `name` in shard directory `shard` holds, or None for anything else (temp
    files, foreign names, an object in the wrong shard)."""
    key = name[: -len(SUFFIX)]
    return key if name.endswith(SUFFIX) and is_key(key) and key[:2] == shard else None


def check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise InvalidInputError(f"invalid byte range [{start}, {end})")
