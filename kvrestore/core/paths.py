"""Where kvrestore keeps files of its own (converted model weights, the demo's store)."""

from __future__ import annotations

import os
from pathlib import Path

from kvrestore.core.settings import check_path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` if given, else $KVRESTORE_CACHE_DIR, else the user cache dir (~/.cache/kvrestore)."""
    if cache_dir is not None:
        return Path(check_path("cache_dir", cache_dir))
    env = os.environ.get("KVRESTORE_CACHE_DIR")
    if env:
        return Path(check_path("KVRESTORE_CACHE_DIR", env))
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvrestore"))
