"""ReadOnlyStore: a store that is read and never written (a replica with read-only credentials)."""

from __future__ import annotations

from kvrestore.core.errors import StoreError
from kvrestore.stores.wrapper import WrapperStore


class ReadOnlyStore(WrapperStore):
    """`inner`, read as it is; a put or a delete is a `StoreError` and never reaches it.

    `open_store(url, read_only=True)` makes one for every scheme but a local directory, which opens
    read-only itself (`LocalStore(read_only=True)`: no write probe, and its blocking reads kept)."""

    read_only = True

    async def put(self, key: str, data: bytes) -> None:
        raise StoreError(f"chunk store {self.name!r} is read-only: cannot write {key[:12]}")

    async def delete(self, key: str) -> None:
        raise StoreError(f"chunk store {self.name!r} is read-only: cannot delete {key[:12]}")

    def __repr__(self) -> str:
        return f"ReadOnlyStore({self.inner!r})"
