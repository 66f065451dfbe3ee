"""One capacity for every process that shares a local directory: a lock file and reservations in it.

A `BoundedStore` over a local directory makes room for a write while it holds an exclusive `flock` on
`<root>/.kvrestore.lock`, and takes the directory itself as the account: the reservations of writes in
flight (empty files `.kvrestore-reserve-<host>-<pid>-<id>-<bytes>` in the root), then the objects. It
evicts until the new object fits beside both, leaves a reservation of its own and lets go of the lock;
the write runs unlocked, and its reservation is removed only once the object is in place. So the
objects plus the temp files of the writes in flight never exceed the capacity, whichever process wrote
them. Reservations are listed before objects: a write that ends between the two listings is seen as
its reservation or as its object (or both, which only over-counts), never as neither.

A process killed mid-write leaves its reservation behind, and the partial temp file of its write; a
reservation of a process of this host that has exited, or any older than `STALE_TMP_SECONDS`, is
removed by the next process that takes the lock, with that writer's temp files (a dead process of this
host: every one of them; an old reservation: those as old), so the directory holds no more than its
capacity once the reservation's room is given back. The kernel drops the lock itself when its holder
dies. Local, POSIX filesystems only (`flock`); other stores keep a per-process limit (see `BoundedStore`).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
from contextlib import suppress

from kvrestore.core.errors import StoreError
from kvrestore.stores.local import _HOST, STALE_TMP_SECONDS, _pid_alive, sweep_temp, temp_prefix

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".kvrestore.lock"
RESERVE_PREFIX = ".kvrestore-reserve-"
_RESERVATION = re.compile(rf"^{re.escape(RESERVE_PREFIX)}([A-Za-z0-9]+)-(\d+)-[0-9a-f]+-(\d+)$")


class SharedDir:
    """The lock and the reservations of one local directory. Every method blocks (call it in a thread,
    except `reserve` and `release`: one small file each)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.lock_path = os.path.join(root, LOCK_NAME)

    @staticmethod
    def available() -> bool:
        """Whether this platform has `flock`."""
        return fcntl is not None

    def lock(self) -> int:
        """Wait for the directory's exclusive lock; returns the descriptor that holds it (`unlock`). A
        directory deleted meanwhile is made again, with its lock file (as a write to it would make it)."""
        try:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                os.makedirs(self.root, exist_ok=True)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot lock {self.lock_path}: {type(e).__name__}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError):
                raise StoreError(f"cannot lock {self.lock_path}: {type(e).__name__}: {e}") from e
            raise
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        os.close(fd)  # closing the only descriptor of this open file releases its flock

    def reserved(self) -> int:
        """Bytes reserved by writes in flight, with the lock held; stale reservations are removed."""
        total, cutoff = 0, time.time() - STALE_TMP_SECONDS
        dead: list[tuple[str, int, bool]] = []
        try:
            entries = list(os.scandir(self.root))
        except OSError as e:
            raise StoreError(f"cannot list {self.root}: {type(e).__name__}: {e}") from e
        for entry in entries:
            m = _RESERVATION.match(entry.name)
            if m is None:
                continue
            host, pid, size = m.group(1), int(m.group(2)), int(m.group(3))
            try:
                old = entry.stat(follow_symlinks=False).st_mtime < cutoff
            except FileNotFoundError:
                continue  # its write ended meanwhile
            if old or (host == _HOST and pid != os.getpid() and not _pid_alive(pid)):
                with suppress(OSError):
                    os.remove(entry.path)
                dead.append((host, pid, old))
            else:
                total += size
        for host, pid, old in dead:  # the writes those reservations held room for will never end
            sweep_temp(self.root, _temp_files_of(temp_prefix(host, pid), cutoff if old else None))
        return total

    def reserve(self, size: int) -> str:
        """Reserve `size` bytes (with the lock held); returns what `release` takes."""
        path = os.path.join(self.root, f"{RESERVE_PREFIX}{_HOST}-{os.getpid()}-{uuid.uuid4().hex}-{size}")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except OSError as e:
            raise StoreError(f"cannot reserve room in {self.root}: {type(e).__name__}: {e}") from e
        return path

    @staticmethod
    def release(path: str) -> None:
        """End a reservation (no lock needed: it only gives room back). Best effort: one left behind
        only holds room until its process ends."""
        with suppress(OSError):
            os.remove(path)


def _temp_files_of(prefix: str, older_than: float | None) -> Callable[[os.DirEntry[str]], bool]:
    """Picks the temp files named with `prefix` (a writer's), only those last written before
    `older_than` (epoch seconds) if given."""

    def doomed(entry: os.DirEntry[str]) -> bool:
        if not entry.name.startswith(prefix):
            return False
        return older_than is None or entry.stat(follow_symlinks=False).st_mtime < older_than

    return doomed


__all__ = ["LOCK_NAME", "RESERVE_PREFIX", "SharedDir"]
