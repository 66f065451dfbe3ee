"""Bad input and store faults surface as typed `KVRestoreError`s with a message naming the problem."""

from __future__ import annotations

import errno
import math
import threading

import anyio
import pytest
import torch

from kvrestore import (
    Auto,
    BatchEngine,
    Blend,
    ComputeOnly,
    InvalidInputError,
    KVCache,
    KVRestoreError,
    LayerTwoPointer,
    LoadOnly,
    Restorer,
    StoreError,
    SyncRestorer,
    TokenTwoPointer,
    UsageError,
)
from kvrestore.backends.hf import HFBackend
from kvrestore.core.errors import SaveError
from kvrestore.core.keys import chunk_keys
from kvrestore.policies.batch import BatchAware, FifoLanes
from kvrestore.runtime.engine import Engine
from kvrestore.stores.memory import MemoryStore

from .conftest import random_tokens, tiny_model


class RefusingStore(MemoryStore):
    """A store that refuses to write the keys in `refused` with `error` (a full disk, a bug)."""

    def __init__(self, refused: set[str], error: Exception) -> None:
        super().__init__()
        self.refused, self.error = refused, error

    async def put(self, key, data):
        if key in self.refused:
            raise self.error
        await super().put(key, data)


def refusing(backend, tokens, chunks: list[int], error: Exception) -> RefusingStore:
    keys = [r.key for r in chunk_keys(tokens, backend.spec.fingerprint, 16)]
    return RefusingStore({keys[i] for i in chunks}, error)


# -- 1. store faults during save -------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [StoreError("No space left on device"), OSError(errno.ENOSPC, "No space left on device")]
)
def test_save_store_faults_raise_one_store_error_and_keep_the_written_chunks(llama_backend, error):
    tokens = random_tokens(96, llama_backend.spec.vocab_size, seed=1)  # 6 chunks of 16
    store = refusing(llama_backend, tokens, [1, 3, 4], error)

    async def main():
        r = Restorer(llama_backend, store, chunk_size=16)
        with pytest.raises(StoreError) as info:  # one StoreError, not an ExceptionGroup
            await r.save(tokens)
        e = info.value
        assert isinstance(e, SaveError)
        assert "3 of 6 chunks could not be written" in str(e) and "No space left on device" in str(e)
        assert set(e.failed) == store.refused and all(exc is error for exc in e.failed.values())
        assert e.__cause__ is error
        assert len(e.written) == 3 and all(await store.contains(list(e.written)))
        assert not any(await store.contains(sorted(store.refused)))
        store.refused = set()  # space freed: the next save writes only what is missing
        again = await r.save(tokens)
        assert again.written_chunks == 3 and again.skipped_chunks == 3

    anyio.run(main)


@pytest.mark.parametrize("n_bugs", [1, 3])
def test_save_bug_propagates_as_itself(llama_backend, n_bugs):
    tokens = random_tokens(96, llama_backend.spec.vocab_size, seed=2)
    store = refusing(llama_backend, tokens, list(range(n_bugs)), RuntimeError("bug in put"))

    async def main():
        with pytest.raises(RuntimeError, match="bug in put"):
            await Restorer(llama_backend, store, chunk_size=16).save(tokens)

    anyio.run(main)


# -- 2. bad arguments at construction --------------------------------------------------------------

BAD_COUNTS = [0, -1, 1.5, "4", True, None]


@pytest.mark.parametrize("lanes", BAD_COUNTS)
def test_bad_load_lanes_refused(llama_backend, lanes):
    for make in (
        lambda: Restorer(llama_backend, MemoryStore(), load_lanes=lanes),
        lambda: Engine(lanes),
        lambda: BatchEngine(load_lanes=lanes),
    ):
        with pytest.raises(InvalidInputError, match=f"load_lanes must be a positive integer, got {lanes!r}"):
            make()


@pytest.mark.parametrize("timeout", [0, -1, 0.0, math.nan, "30", True])
def test_bad_load_timeout_refused(llama_backend, timeout):
    with pytest.raises(InvalidInputError, match="load_timeout_s must be a positive number of seconds"):
        Restorer(llama_backend, MemoryStore(), load_timeout_s=timeout)


def test_load_timeout_none_means_no_limit(llama_backend):
    assert Restorer(llama_backend, MemoryStore(), load_timeout_s=None).load_timeout_s is None
    assert Restorer(llama_backend, MemoryStore(), load_timeout_s=2).load_timeout_s == 2.0


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda v: TokenTwoPointer(v), "compute_chunks"),
        (lambda v: LayerTwoPointer(v), "compute_layers"),
        (lambda v: ComputeOnly(unit_chunks=v), "unit_chunks"),
        (lambda v: BatchAware(token_budget=v), "token_budget"),
        (lambda v: FifoLanes(token_budget=v), "token_budget"),
    ],
)
@pytest.mark.parametrize("value", [0, -2, 2.0, "2"])
def test_bad_policy_arguments_refused(make, name, value):
    with pytest.raises(InvalidInputError, match=f"{name} must be a positive integer") as info:
        make(value)
    assert isinstance(info.value, ValueError)  # old `except ValueError` code still catches it


def test_other_policy_arguments_refused():
    with pytest.raises(InvalidInputError, match="max_skipped_steps must be an integer >= 0"):
        BatchAware(max_skipped_steps=-1)
    with pytest.raises(InvalidInputError, match="candidates must be restore policies"):
        Auto(["two-pointer"])
    with pytest.raises(InvalidInputError, match="candidates must be restore policies"):
        Auto([Auto()])
    assert ComputeOnly(None).unit_chunks is None and BatchAware(max_skipped_steps=0).max_skipped_steps == 0


def test_bad_restorer_arguments_refused(llama_backend):
    b, store = llama_backend, MemoryStore()
    cases = [
        (lambda: Restorer(b, store, chunk_size=0), "chunk_size must be a positive integer"),
        (lambda: Restorer(b, store, chunk_size="256"), "chunk_size must be a positive integer"),
        (lambda: Restorer(b, store, compression="bogus"), r"compression must be one of \('none', 'zstd'\)"),
        (lambda: Restorer(b, "memory://"), "store must be a ChunkStore"),
        (lambda: Restorer(b.model, store), "backend must be a ComputeBackend"),
        (lambda: Restorer(b, store, engine=4), "engine must be an Engine"),
        (lambda: SyncRestorer(b, store, load_lanes=0), "load_lanes"),
    ]
    for make, match in cases:
        with pytest.raises(InvalidInputError, match=match):
            make()
    with pytest.raises(TypeError, match="unexpected keyword"):
        Restorer(b, store, lanes=4)


def test_plain_tensors_refused_where_a_kv_cache_is_expected(llama_backend):
    b = llama_backend
    tokens = random_tokens(40, b.spec.vocab_size, seed=3)
    shaped = KVCache.empty(b.spec, 40).data  # the right shape, but not a KVCache

    async def main():
        store = MemoryStore()
        r = Restorer(b, store, chunk_size=16)
        with pytest.raises(InvalidInputError, match="out must be a KVCache"):
            await r.restore(tokens, out=shaped)
        with pytest.raises(InvalidInputError, match="kv must be a KVCache"):
            await r.save(tokens, kv=shaped)
        with pytest.raises(InvalidInputError, match="kv .* cannot hold 40 tokens"):
            await r.save(tokens, kv=KVCache.empty(b.spec, 39))
        other = KVCache(b.spec, shaped.to(torch.float64))
        with pytest.raises(InvalidInputError, match="cannot hold"):
            await r.save(tokens, kv=other)
        assert len(store) == 0  # refused before anything was written

    anyio.run(main)


def test_wrong_policy_types_refused(llama_backend):
    b = llama_backend
    tokens = random_tokens(40, b.spec.vocab_size, seed=4)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=16)
        with pytest.raises(InvalidInputError, match="policy must be a Policy"):
            await r.restore(tokens, "two-pointer")
        with pytest.raises(InvalidInputError, match="restore_blend"):
            await r.restore(tokens, Blend())
        with pytest.raises(InvalidInputError, match="policy must be a Blend"):
            await r.restore_blend([tokens[:16]], tokens[16:], policy=LoadOnly())
        with pytest.raises(InvalidInputError, match="1-D"):
            await r.restore_blend([tokens[:16]], suffix=5)

    anyio.run(main)


# -- 3. prompts longer than the model's context ----------------------------------------------------


class Counting:
    """Wraps a backend and counts every call that does model work."""

    WORK = ("prefill_chunk", "prefill_into", "embed", "run_layer")

    def __init__(self, inner: HFBackend) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.WORK:
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def contains(self, keys):
        self.calls += 1
        return await super().contains(keys)

    async def put(self, key, data):
        self.calls += 1
        await super().put(key, data)


def backend_with_context(n: int) -> Counting:
    model = tiny_model("llama")
    model.config.max_position_embeddings = n
    return Counting(HFBackend(model, name="tiny-llama"))


def test_prompt_longer_than_the_context_refused_before_any_work():
    b, store = backend_with_context(70_000), CountingStore()
    too_long = random_tokens(70_001, b.spec.vocab_size, seed=5)

    async def main():
        r = Restorer(b, store)
        for call in (
            lambda: r.restore(too_long),
            lambda: r.save(too_long),
            lambda: r.lookup(too_long),
            lambda: r.save_chunk(too_long),
            lambda: r.save_chunk(too_long[:40_000], prefix=too_long[40_000:]),
            lambda: r.restore_blend([too_long[:30_000], too_long[30_000:60_000]], too_long[60_000:]),
            lambda: r.restore_blend([too_long[:30_000]], too_long[30_000:60_000], prefix=too_long[60_000:]),
        ):
            with pytest.raises(InvalidInputError, match="70001 tokens.*context is 70000 tokens"):
                await call()
        assert b.calls == 0 and store.calls == 0  # no model work and no store call

    anyio.run(main)


def test_a_prompt_of_exactly_the_context_restores():
    b = backend_with_context(48)
    tokens = random_tokens(48, b.spec.vocab_size, seed=6)

    async def main():
        r = Restorer(b, MemoryStore(), chunk_size=16)
        res = await r.restore(tokens, ComputeOnly())
        assert res.kv.n_tokens == 48 and b.calls > 0
        with pytest.raises(InvalidInputError, match="49 tokens"):
            await r.restore(random_tokens(49, b.spec.vocab_size))

    anyio.run(main)


def test_every_error_is_a_kvrestore_error():
    for cls in (InvalidInputError, StoreError, SaveError):
        assert issubclass(cls, KVRestoreError)
    assert issubclass(SaveError, StoreError)


def test_no_public_error_is_a_bare_value_error():
    """Every ValueError kvrestore raises on purpose is an InvalidInputError (a KVRestoreError)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "kvrestore"
    bare = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"raise ValueError\(", line)
    ]
    assert not bare, bare


def test_misuse_of_the_public_api_is_a_usage_error(llama_backend):
    """A BatchEngine never entered, a SyncRestorer used after close() and a blocking call from an on_event
    callback each raise a `UsageError` (a KVRestoreError) saying what to do, not anyio's RuntimeError."""
    b = llama_backend
    tokens = random_tokens(40, b.spec.vocab_size, seed=9)

    async def not_entered():
        await Restorer(b, MemoryStore(), chunk_size=16, engine=BatchEngine()).restore(tokens)

    with pytest.raises(UsageError, match="async with"):
        anyio.run(not_entered)

    r = SyncRestorer(b, MemoryStore(), chunk_size=16)
    seen: list[BaseException] = []

    def reenter(event):
        try:
            r.lookup(tokens)
        except BaseException as exc:  # noqa: BLE001 - what the callback met is the test's subject
            seen.append(exc)

    r.restore(tokens, ComputeOnly(), on_event=reenter)
    assert seen and all(isinstance(e, UsageError) for e in seen)
    assert "callback" in str(seen[0]) and "another thread" in str(seen[0])
    with pytest.raises(UsageError, match="callback"):
        r.restore(tokens, ComputeOnly(), on_event=lambda event: r.lookup(tokens))
    assert r.lookup(tokens) == 0  # the restorer is still usable after both
    r.close()
    r.close()  # a second close does nothing
    with pytest.raises(UsageError, match=r"lookup after close\(\).*make a new SyncRestorer"):
        r.lookup(tokens)


def test_a_sync_restorer_closed_by_another_thread_refuses_later_calls(llama_backend):
    """Calls racing a close() from another thread end in results or UsageError, never anyio's error."""
    b = llama_backend
    tokens = random_tokens(40, b.spec.vocab_size, seed=10)
    r = SyncRestorer(b, MemoryStore(), chunk_size=16)
    errors: list[BaseException] = []
    calls = threading.Event()

    def hammer():
        while True:
            try:
                r.lookup(tokens)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return
            calls.set()

    worker = threading.Thread(target=hammer)
    worker.start()
    assert calls.wait(60)  # it is calling
    r.close()
    worker.join(60)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], UsageError), errors
