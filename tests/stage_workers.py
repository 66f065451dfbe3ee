"""What each stage process runs in the stage-parallel tests (module level: `spawn` pickles it by name)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial

import anyio

from kvrestore import ComputeOnly, LoadOnly, TokenTwoPointer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import StoreError
from kvrestore.distributed import StageLayout, StageRestorer, gather_kv
from kvrestore.stores.wrapper import WrapperStore
from tests.conftest import random_tokens, tiny_model

LAYERS = 4
CHUNK = 16
POLICIES = {"two-pointer": TokenTwoPointer, "compute-only": ComputeOnly, "load-only": LoadOnly}


def backend() -> HFBackend:
    return HFBackend(tiny_model("llama", layers=LAYERS), name="tiny-llama")


def tokens(n: int = 100):
    return random_tokens(n, 256, seed=7)


class FailingReads(WrapperStore):
    """Reads of some objects fail with a store error (`ranges`: KV range reads; `gets`: whole-object gets,
    which are the boundary activations'; `lookup`: `contains`) or kill the process (`die`)."""

    def __init__(
        self, inner, ranges: bool = False, gets: bool = False, die: bool = False, lookup: bool = False
    ) -> None:
        super().__init__(inner)
        self.ranges, self.gets, self.die, self.lookup = ranges, gets, die, lookup

    async def contains(self, keys):
        if self.lookup:
            raise StoreError("lookup failed")
        return await self.inner.contains(keys)

    async def get(self, key: str):
        if self.die:
            os._exit(3)
        if self.gets:
            raise StoreError("boundary store link down")
        return await self.inner.get(key)

    async def read_into(self, key: str, buffer: memoryview):
        return await self.inner.read_into(key, buffer)

    async def get_range(self, key: str, start: int, end: int):
        if self.ranges:
            raise StoreError("KV store link down")
        return await self.inner.get_range(key, start, end)

    async def get_ranges(self, key: str, ranges):
        return [await self.get_range(key, a, b) for a, b in ranges]


def restore_runs(rank: int, world: int, runs: Sequence[tuple[str, str, str, int]]) -> list[dict]:
    """Each run: (store dir, policy, fault on the last rank, sequential); rank 0 returns the gathered KV."""
    b = backend()
    layout = StageLayout.even(LAYERS, world)
    out = []
    for store_dir, policy, fault, sequential in runs:
        store = open_store(f"file://{store_dir}")
        if fault and rank == (0 if fault == "lookup" else world - 1):
            store = FailingReads(store, **{fault: True})
        stage = StageRestorer(b, store, layout, CHUNK, timeout_s=20.0)
        try:
            result = anyio.run(
                partial(stage.restore, tokens(), POLICIES[policy](), sequential=bool(sequential))
            )
        except Exception as exc:  # noqa: BLE001 - the test checks which error every rank got
            out.append(
                {"error": type(exc).__name__, "message": str(exc), "failures": getattr(exc, "failures", {})}
            )
            continue
        kv = gather_kv(result, b.spec)
        out.append(
            {
                "stats": result.stats,
                "kv": None if kv is None else kv.data,
                "pipelined": result.plan.pipelined(rank),
            }
        )
    return out
