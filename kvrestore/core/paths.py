"""Where kvrestore keeps files of its own (converted model weights, the demo's store)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` if given, else $KVRESTORE_CACHE_DIR, else the user cache dir (~/.cache/kvrestore)."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("KVRESTORE_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvrestore"))
