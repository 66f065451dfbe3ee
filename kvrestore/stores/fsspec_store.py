"""Where the file stores used to live, as one class: now `kvrestore.stores.local` (`LocalStore`, a local
directory) and `kvrestore.stores.remote` (`FsspecStore`, any other fsspec filesystem). Names kept for
code that imports them from here."""

from kvrestore.stores.files import SUFFIX, TMP_PREFIX
from kvrestore.stores.local import STALE_TMP_SECONDS, LocalStore
from kvrestore.stores.remote import REMOTE_CONCURRENCY, FsspecStore

__all__ = ["REMOTE_CONCURRENCY", "STALE_TMP_SECONDS", "SUFFIX", "TMP_PREFIX", "FsspecStore", "LocalStore"]
