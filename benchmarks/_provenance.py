"""Which code a benchmark measured: the git commit and whether the library had uncommitted changes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def code_version() -> dict[str, Any]:
    """{"commit": HEAD or None, "library_dirty": bool or None} (None where git or .git is missing)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "kvrestore") if commit else None
    return {"commit": commit, "library_dirty": bool(status) if status is not None else None}
