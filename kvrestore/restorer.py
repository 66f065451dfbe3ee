"""Restorer: the object a serving process imports. save / lookup / restore, async and sync.

A thin facade: it checks its arguments and chunks the prompt, then hands the work down -- restores and
saves to `kvrestore.restore`, chunk writes and reads to `kvrestore.chunkio`, planning and learned costs
to `kvrestore.planning.Planner`, CacheBlend to `kvrestore.blend`. `SyncRestorer`'s blocking methods are
generated from `Restorer`'s async ones (`kvrestore.core.sync`), so the two cannot drift apart.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.from_thread
import torch

from kvrestore.backends.base import ComputeBackend
from kvrestore.blend.chunks import BlendKeys
from kvrestore.blend.entry import blend_prompt, save_prompt_chunk
from kvrestore.chunkio import ChunkLoader
from kvrestore.chunkio.save import SaveStats
from kvrestore.codec.quant import Encoding
from kvrestore.codec.seal import seal_of
from kvrestore.core.errors import InvalidInputError, KVRestoreError, UsageError
from kvrestore.core.keys import (
    DEFAULT_CHUNK_SIZE,
    ChunkRef,
    check_namespace,
    chunk_keys,
    key_space,
    namespaced,
)
from kvrestore.core.kv import KVCache
from kvrestore.core.settings import check_choice, check_int, check_seconds
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread, mirror_sync_methods
from kvrestore.core.tokens import TokenIds, as_token_tensor, check_length
from kvrestore.core.trace import TraceEvent
from kvrestore.costs.learned import store_name
from kvrestore.costs.profile import Profile
from kvrestore.planning.auto import Auto, Plan
from kvrestore.planning.planner import Planner
from kvrestore.policies import Blend, Policy
from kvrestore.restore import run
from kvrestore.restore.results import Parts, RestoreResult
from kvrestore.runtime.engine import Engine
from kvrestore.stores.base import ChunkStore
from kvrestore.stores.deadline import LOOKUP_TIMEOUT_S, SAVE_TIMEOUT_S, Deadlines, bound_store

if TYPE_CHECKING:
    from kvrestore.blend import BlendResult, StoreCandidate, StorePlacement

__all__ = ["Restorer", "SyncRestorer"]


def _check_parts(backend: object, store: object, engine: object, compression: str) -> None:
    """Refuse what a Restorer cannot be made of, before anything is built."""
    if not isinstance(getattr(backend, "spec", None), ModelSpec):  # (wrappers forward attributes)
        raise InvalidInputError(
            f"backend must be a ComputeBackend with a ModelSpec (e.g. HFBackend(model)), got {backend!r}"
        )
    if not isinstance(store, ChunkStore):
        raise InvalidInputError(f"store must be a ChunkStore (e.g. open_store(url)), got {store!r}")
    if engine is not None and not isinstance(engine, Engine):
        raise InvalidInputError(f"engine must be an Engine or None, got {engine!r}")
    check_choice("compression", compression, ("none", "zstd"))


def _on_device(t: torch.Tensor, device: torch.device | str) -> bool:
    """Whether `t` lives on `device` ("cuda" matches any CUDA device's tensor, "cuda:1" only its own)."""
    want = torch.device(device)
    return t.device.type == want.type and (want.index is None or t.device.index == want.index)


def check_saved_kv(backend: ComputeBackend, kv: KVCache, n_tokens: int) -> None:
    """Refuse KV given to `save` that this model cannot have made: another shape or device, or any NaN
    or infinity (stored, it would be served to every later restore of the prompt)."""
    spec, data = backend.spec, kv.data
    want = (spec.num_layers, 2, spec.num_kv_heads, spec.head_dim)
    if data.dim() != 5 or (*data.shape[:3], data.shape[4]) != want:
        raise InvalidInputError(
            f"kv has shape {tuple(data.shape)}; {spec.name} makes [L={want[0]}, 2, H={want[2]}, T, D={want[3]}]"
        )
    if not _on_device(data, backend.device):
        raise InvalidInputError(f"kv is on {data.device}; the model runs on {backend.device}")
    if not bool(torch.isfinite(data[:, :, :, :n_tokens]).all()):
        raise InvalidInputError("kv holds NaN or infinite values: no model's KV does, so it is not stored")


class Restorer:
    """Saves a prompt's KV cache chunk by chunk and restores it, computing part and loading the rest.

    Parameters
    ----------
    backend: ComputeBackend
        The model, e.g. `HFBackend(model)`.
    store: ChunkStore
        Where chunks live, e.g. `open_store("file:///var/cache/kv")`.
    chunk_size: int
        Tokens per stored chunk (default 256). Restorers that share a store must agree on it.
    load_lanes: int
        Concurrent chunk loads (default 4); unused when `engine` is given.
    compression: "none" | "zstd"
        How written chunks are compressed.
    kv_encoding: "native" | "int8" | "fp8" | "int4"
        How written chunks hold the KV (`codec.quant`), and the only encoding this restorer reads.
    engine: Engine | BatchEngine | None
        The lanes restores run on; restorers may share one. None makes a private `Engine`.
    lookup_timeout_s, load_timeout_s, save_timeout_s: float | None
        Deadlines of the store calls (`kvrestore.stores.deadline`; None lifts one): a lookup (2 s), a
        chunk's read (30 s; its chunk is then computed instead), a chunk's write or a flush (30 s).
    profile: Profile | path | None | False
        The measured cost model `Auto` predicts with: a `Profile`, a path to one, None for the one
        `kvrestore profile` saved for this machine and model (if any), False for none.
    learn: bool | path
        Where the costs learned from this restorer's own saves and restores are kept for the next
        restorer of this machine, model and store: True under the cache directory, a path, or False
        (in memory only).
    namespace: str | None
        Whose chunks these are (a tenant, a LoRA adapter): chunk keys are hashed under it, so two
        namespaces never see each other's chunks, and a vLLM request whose `cache_salt` is the same
        string sees this restorer's (`kvrestore.core.keys.namespaced`). Each call may name another.
    secret: bytes | str | None
        A secret of at least 16 bytes: every chunk written is signed with a keyed MAC, and a chunk
        read without a valid one is a miss, never KV, and is not deleted (`kvrestore.codec.seal`).
        None: chunks are neither signed nor checked.

    Attributes
    ----------
    planner: Planner
        The one view of what this restorer knows about costs: `planner.profile` (measured, or None),
        `planner.costs` (learned from its own work), `planner.link` (the store link, followed through
        every restore's loads), `planner.calibration` (measured against predicted time per strategy)
        and `planner.cost_model` (what `Auto` predicts with: the profile, else the learned costs).

    Raises
    ------
    InvalidInputError
        A backend without a `ModelSpec`, a store that is not a `ChunkStore`, or a bad number.
    """

    def __init__(
        self,
        backend: ComputeBackend,
        store: ChunkStore,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        load_lanes: int = 4,
        compression: str = "none",
        kv_encoding: str = "native",
        engine: Engine | None = None,
        load_timeout_s: float | None = 30.0,
        lookup_timeout_s: float | None = LOOKUP_TIMEOUT_S,
        save_timeout_s: float | None = SAVE_TIMEOUT_S,
        profile: Profile | str | os.PathLike | Literal[False] | None = None,
        learn: bool | str | os.PathLike = True,
        namespace: str | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        _check_parts(backend, store, engine, compression)
        self.namespace = check_namespace(namespace)
        self.backend, self.store, self.compression = backend, store, compression
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.engine, self._own_engine = engine or Engine(load_lanes), engine is None  # own: closed here
        check_int("load_lanes", load_lanes)  # also where a given engine makes it unused
        #: the one owner of the store calls' deadlines: the bounded store and each restore read them here
        self.deadlines = Deadlines(lookup_timeout_s, load_timeout_s, save_timeout_s)
        self.bounded_store = bound_store(store, self.deadlines)  # the store as restores reach it
        self.loader = ChunkLoader(
            self.spec,
            self.bounded_store,
            partial(self.engine.cuda_stream, "load"),
            kv_encoding,
            seal_of(secret),
        )
        stored = round(self.kv_encoding.bytes_per_token(self.chunk_size, self.spec.num_layers))
        self.planner = Planner(
            backend, self.engine, self.chunk_size, store_name(store), profile, learn, stored
        )
        #: what runs this restorer's restores
        self._parts = Parts(
            self.backend, self.bounded_store, self.engine, self.loader, self.planner, self.deadlines
        )

    @property
    def spec(self) -> ModelSpec:
        return self.backend.spec

    @property
    def kv_encoding(self) -> Encoding:
        """How this restorer's chunks hold the KV (`codec.quant`): what it writes, and all it reads."""
        return self.loader.encoding

    @property
    def load_timeout_s(self) -> float | None:
        """Seconds a chunk's load may take (`Deadlines.load_s`; None: no limit); a caller may change it
        between restores."""
        return self.deadlines.load_s

    @load_timeout_s.setter
    def load_timeout_s(self, seconds: float | None) -> None:
        self.deadlines.load_s = check_seconds("load_timeout_s", seconds)

    def plan(self, token_ids: TokenIds, stored: Sequence[bool], policy: Auto | None = None) -> Plan:
        """What `Auto` would choose for `token_ids` given which chunks are `stored` (see `Plan.explain`)."""
        _, refs = self.chunks(token_ids)  # (the keys do not matter here: any namespace plans alike)
        if len(stored) != len(refs):
            raise InvalidInputError(f"stored has {len(stored)} flags for {len(refs)} chunks")
        return self.planner.plan(refs, stored, policy)

    def key_space(self, namespace: str | None = None) -> str:
        """What this restorer's chunk keys are hashed under for `namespace` (None: the restorer's own):
        the model, its KV encoding and the namespace."""
        ns = check_namespace(namespace) or self.namespace
        return namespaced(key_space(self.spec.fingerprint, self.kv_encoding.name), ns)

    def chunks(
        self, token_ids: TokenIds, namespace: str | None = None
    ) -> tuple[torch.Tensor, list[ChunkRef]]:
        """Validated tokens and their chunks, with their store keys in `namespace` (None: the
        restorer's own)."""
        space = self.key_space(namespace)  # a bad namespace is refused before the tokens are read
        tokens = as_token_tensor(token_ids)
        check_length(self.backend, len(tokens))
        self.backend.validate_tokens(tokens)
        return tokens, chunk_keys(tokens, space, self.chunk_size)

    async def lookup(self, token_ids: TokenIds, namespace: str | None = None) -> int:
        """Number of leading tokens covered by stored chunks (the longest stored prefix) in `namespace`
        (None: the restorer's own); a store fault raises `StoreError` (`StoreTimeoutError` past
        `lookup_timeout_s`)."""
        _, refs = self.chunks(token_ids, namespace)
        present = await self.bounded_store.contains([r.key for r in refs])
        covered = 0
        for ref, ok in zip(refs, present, strict=False):
            if not ok:
                break
            covered = ref.end
        return covered

    async def save(
        self, token_ids: TokenIds, kv: KVCache | None = None, namespace: str | None = None
    ) -> SaveStats:
        """Write every chunk of the prompt the store lacks, in `namespace` (None: the restorer's own).

        Without `kv`, the KV comes from a restore: chunks already stored are loaded, not recomputed, so
        saving a conversation that grew by one turn computes only the new tokens (a stored chunk that
        turns out unusable is recomputed and written again).

        Store faults on writing fail only their chunks: once every write has ended, they raise one
        `SaveError` (a `StoreError`) whose `written` are the keys stored (they stay stored) and `failed` the
        keys that were not, with their errors. Any other error propagates as itself.
        """
        tokens, refs = self.chunks(token_ids, namespace)
        if kv is not None:
            run.check_kv(self.spec, "kv", kv, len(tokens))
            await anyio.to_thread.run_sync(check_saved_kv, self.backend, kv, len(tokens))
        return await run.save(self._parts, tokens, refs, kv, self.compression)

    async def restore(
        self,
        token_ids: TokenIds,
        policy: Policy | Auto | None = None,
        on_event: Callable[[TraceEvent], None] | None = None,
        out: KVCache | None = None,
        namespace: str | None = None,
    ) -> RestoreResult:
        """The KV cache of `token_ids`, assembled by `policy` from compute and loads.

        Parameters
        ----------
        token_ids: sequence of int or 1-D tensor
            The prompt.
        policy: Policy | Auto | None
            How to split the work between computing and loading. None picks the engine's default
            (`Engine.plans_by_default`): `Auto` on a plain `Engine`, which predicts every strategy and
            runs the fastest; the token-wise two-pointer on a `BatchEngine`, whose scheduler shares the
            lanes out.
        on_event: callable, optional
            Called with each `TraceEvent` as units start and finish.
        out: KVCache, optional
            A buffer to restore into, on the model's device; the result's `kv` shares it (a serving
            process reuses its KV memory instead of allocating a new buffer per request).
        namespace: str, optional
            Whose chunks to load (a tenant, an adapter); None: the restorer's own (`Restorer`).

        Returns
        -------
        RestoreResult
            `kv` (all layers, all tokens), `stats` (what was computed, loaded, failed), `trace`, and
            `plan` where `Auto` chose (`plan.explain()` says what it predicted and why).

        Raises
        ------
        InvalidInputError
            Empty or out-of-vocabulary tokens, a prompt longer than the model's context, a bad `out`.
            A missing or damaged chunk raises nothing: it is recomputed and counted in `stats`.
        """
        started = time.perf_counter()  # `stats.seconds` counts from here: what the caller waits
        tokens, refs = self.chunks(token_ids, namespace)
        run.check_policy(policy)
        if out is not None:
            run.check_kv(self.spec, "out", out, len(tokens), in_place=True)
            if not _on_device(out.data, self.backend.device):
                raise InvalidInputError(
                    f"out is on {out.data.device}; the model runs on {self.backend.device}"
                )
        return await run.restore(self._parts, tokens, refs, policy, on_event, out, started)

    async def save_chunk(
        self, token_ids: TokenIds, prefix: TokenIds | None = None, namespace: str | None = None
    ) -> str:
        """Prefill a chunk on its own and store its KV under a content key, for `restore_blend`.

        The key depends on the chunk's tokens (and the optional shared `prefix`, e.g. a system prompt,
        that it is prefilled after) and the `namespace` (None: the restorer's own), not on its
        neighbours, so the chunk is found again in any prompt, at any position. Returns the key; a
        stored chunk is not recomputed.
        """
        keys = self._blend_keys(namespace)
        store, compression = self.bounded_store, self.compression
        return await save_prompt_chunk(self.backend, store, token_ids, prefix, compression, keys)

    async def restore_blend(
        self,
        chunks: Sequence[TokenIds],
        suffix: TokenIds | None = None,
        policy: Blend | None = None,
        prefix: TokenIds | None = None,
        namespace: str | None = None,
    ) -> BlendResult:
        """CacheBlend: the KV of `prefix` + `chunks` (saved with `save_chunk`, in any order) + `suffix`,
        reusing the chunks' KV with selective recompute (`kvrestore.policies.Blend`); the chunks of
        `namespace` only (None: the restorer's own). Returns a `kvrestore.blend.BlendResult`: `kv`
        and `tokens` go straight into `backend.generate()`."""
        keys = self._blend_keys(namespace)
        lane = self.loader.lane(torch.device(self.backend.device))  # pinned buffers for a GPU, its stream
        store = self.bounded_store
        return await blend_prompt(self.backend, store, chunks, suffix, policy, prefix, lane, keys)

    def _blend_keys(self, namespace: str | None) -> BlendKeys:
        """How CacheBlend's chunks are keyed and signed for `namespace` (their key space has no KV
        encoding: they are always native)."""
        ns = check_namespace(namespace) or self.namespace
        return BlendKeys(namespaced(self.spec.fingerprint, ns), self.loader.seal)

    async def choose_blend_store(
        self, candidates: Sequence[StoreCandidate], n_tokens: int, ratio: float = 0.15
    ) -> StorePlacement:
        """Where to `save_chunk` for blends of about `n_tokens` tokens at `ratio`: the cheapest of the
        `candidates` whose per-layer load hides behind the recompute (CacheBlend §5.1), measured on the
        stores themselves and on this restorer's profile (or the model, timed, without one); see
        `kvrestore.blend.placement`."""
        from kvrestore.blend.entry import blend_backend
        from kvrestore.blend.placement import choose_blend_store

        profile = self.planner.profile
        layer_cost = profile.layer if profile is not None else None
        return await choose_blend_store(
            blend_backend(self.backend), candidates, n_tokens=n_tokens, ratio=ratio, layer_cost=layer_cost
        )

    async def close(self) -> None:
        """Keep what was learned; free the staging memory, the lanes of an engine made here, the store."""
        await self.planner.keep(settle=True)  # logs a failure to write, never raises one
        self.loader.close()
        if self._own_engine:
            self.engine.close()
        await self.store.close()

    async def __aenter__(self) -> Restorer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_CLOSED = "SyncRestorer.{} after close(): the restorer and its event loop are gone; make a new SyncRestorer"


@mirror_sync_methods(Restorer, via="restorer")
class SyncRestorer:
    """The same Restorer for callers without an event loop.

    Every call runs on one private event loop in a background thread (`core.sync.LoopThread`), so
    stores that hold connections bound to a loop (s3fs) keep working across calls. Each public async
    method of `Restorer` has a blocking face here of the same name, signature and docstring, generated
    (`kvrestore.core.sync.mirror_sync_methods`); only `close`, which also stops the loop, is written out.

    On CUDA a restore orders its streams behind the current stream of the thread it runs on, and here
    that is the portal's (the default stream), not the caller's: a caller that queues work on a stream
    of its own, and passes `out=` a cache that work still reads, synchronizes that stream first.
    """

    restorer: Restorer

    def __init__(
        self, backend: ComputeBackend, store: ChunkStore, chunk_size: int = DEFAULT_CHUNK_SIZE, **kwargs: Any
    ):
        self.restorer = Restorer(backend, store, chunk_size, **kwargs)
        self._loop = LoopThread()
        self._closed = False
        self._closing = threading.Lock()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._check_usable(getattr(fn, "__name__", "a call"))
        try:
            return self._loop.call(partial(fn, *args, **kwargs))
        except RuntimeError as exc:
            if self._closed and not isinstance(exc, KVRestoreError):  # closed by another thread meanwhile
                raise UsageError(_CLOSED.format(getattr(fn, "__name__", "a call"))) from exc
            raise

    def _check_usable(self, name: str) -> None:
        """UsageError for a call that cannot run: after `close()`, or from the restorer's own loop (an
        `on_event` callback), where it would wait for itself."""
        if self._closed:
            raise UsageError(_CLOSED.format(name))
        if self._loop.on_loop:
            raise UsageError(
                f"SyncRestorer.{name} was called from inside a callback (on_event) that runs on the "
                "restorer's own event loop, which cannot wait for itself: hand the call to another thread, "
                "or use the async Restorer there"
            )

    def close(self) -> None:
        if self._loop.on_loop:
            self._check_usable("close")
        with self._closing:
            if self._loop.closed:
                return
            self._closed = True  # calls from now on are refused; those running finish first
            try:
                self._loop.call(self.restorer.close)
            finally:
                self._loop.close()

    def __enter__(self) -> SyncRestorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
