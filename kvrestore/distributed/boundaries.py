"""Boundary activations: saving them with a prompt's chunks, and reading them back on a stage."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread
import torch
from anyio.abc import TaskGroup

from kvrestore import codec
from kvrestore.backends.base import ComputeBackend
from kvrestore.codec.seal import Seal
from kvrestore.core.errors import LOAD_FAULTS, STORE_FAULTS, MissingChunkError, SaveError, StageFailedError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.distributed.layout import StageLayout
from kvrestore.distributed.stage_backend import StageBackend
from kvrestore.restorer import Restorer
from kvrestore.stores.base import ChunkStore

log = logging.getLogger("kvrestore.distributed")


@dataclass
class BoundarySaveStats:
    n_chunks: int
    boundaries: list[int]
    kv_written_chunks: int  # KV chunks written (the others were stored already)
    boundary_objects: int  # boundary activations written
    boundary_bytes: int
    kv_bytes: int  # bytes of the KV chunks this save wrote


def prefill_with_boundaries(
    backend: ComputeBackend, tokens: torch.Tensor, layout: StageLayout
) -> tuple[KVCache, dict[int, torch.Tensor]]:
    """A full prefill of `tokens` stage by stage: the KV cache and the hidden state entering each stage
    boundary layer ([N, hidden] per boundary; for chunk c its rows are chunk c's boundary activation, the
    hidden state of its tokens given the whole prefix before them)."""
    kv = KVCache.empty(backend.spec, len(tokens), device=backend.device)
    hidden: torch.Tensor | None = None
    acts: dict[int, torch.Tensor] = {}
    for a, b in layout.stages:
        stage = StageBackend(backend, a, b)
        if hidden is None:
            hidden = stage.input_of(tokens)
        else:
            acts[a] = hidden[0].to("cpu")
        hidden = stage.forward_into(hidden, kv.data[a:b], 0)
    return kv, acts


async def save_with_boundaries(
    restorer: Restorer, token_ids: Sequence[int] | torch.Tensor, layout: StageLayout
) -> BoundarySaveStats:
    """Store the prompt's KV chunks (those the store lacks) and every chunk's boundary activations for
    `layout`'s boundaries, for a stage-parallel restore (`StageRestorer`). One full prefill computes both.

    Store faults on writing fail only their objects: `SaveError` once every write has ended.
    """
    tokens, refs = restorer.chunks(token_ids)
    layout.check(restorer.spec.num_layers)
    kv, acts = await anyio.to_thread.run_sync(prefill_with_boundaries, restorer.backend, tokens, layout)
    saved = await restorer.save(tokens, kv)
    written, nbytes = await write_boundaries(
        restorer.store, restorer.spec, refs, acts, restorer.engine.load_lanes, restorer.loader.seal
    )
    return BoundarySaveStats(
        len(refs), layout.boundaries, saved.written_chunks, written, nbytes, saved.bytes_written
    )


async def write_boundaries(
    store: ChunkStore,
    spec: ModelSpec,
    refs: Sequence[ChunkRef],
    acts: dict[int, torch.Tensor],
    lanes: int = 4,
    seal: Seal | None = None,
) -> tuple[int, int]:
    """Write each chunk's boundary activation at each layer of `acts` ([N, hidden] each), signed with
    `seal` where given; returns (objects written, bytes). Faults: `SaveError` naming the objects not
    written, after every write."""
    limiter = anyio.CapacityLimiter(lanes)
    written: list[str] = []
    failed: dict[str, Exception] = {}
    nbytes = 0

    async def write(ref: ChunkRef, layer: int, hidden: torch.Tensor) -> None:
        nonlocal nbytes
        key = codec.boundary_key(ref.key, layer)
        async with limiter:
            blob = codec.encode_boundary(
                hidden[ref.start : ref.end].contiguous(), spec, ref.key, ref.start, layer, seal
            )
            try:
                await store.put(key, blob)
            except STORE_FAULTS as exc:
                failed[key] = exc
                return
        written.append(key)
        nbytes += len(blob)

    async with anyio.create_task_group() as tg:
        for layer, hidden in acts.items():
            for ref in refs:
                tg.start_soon(write, ref, layer, hidden)
    if failed:
        first = next(iter(failed.values()))
        raise SaveError(
            f"{len(failed)} boundary activations could not be written; first error: {type(first).__name__}: {first}",
            written,
            failed,
        ) from first
    return len(written), nbytes


class BoundaryReader:
    """One stage's boundary activations, fetched ahead of the compute lane.

    `start()` requests every activation the stage may need, front to back, before the stage's first KV
    load: a link serves requests in order (`ThrottledStore`), and an activation asked for when the compute
    lane reaches its chunk would wait behind every KV load in flight (measured on SmolLM2 at 0.5x balance:
    a stage restore took 2x eq. 2's time). The link pays the activations of chunks that end up loaded
    (a boundary is 5-6% of a chunk's KV, see benchmarks/stages.py), never a stalled compute lane.
    `get(c)` (on the event loop) returns chunk c's activation [1, T, hidden] on `device`. Any fault
    (missing, damaged, store error) is a `StageFailedError`: the plan promised the activation, so the stage
    has no other input for that chunk (its peers are told, see `StageRestorer`).
    """

    def __init__(
        self,
        store: ChunkStore,
        spec: ModelSpec,
        refs: Sequence[ChunkRef],
        layer: int,
        hidden_size: int,
        wanted: Sequence[bool],
        device: torch.device | str = "cpu",
        seal: Seal | None = None,
    ) -> None:
        self.store, self.spec, self.refs, self.layer = store, spec, refs, layer
        self.seal = seal  # where set, an activation without its valid MAC and tag is unusable
        self.hidden_size, self.wanted, self.device = hidden_size, wanted, device
        self._done: dict[int, anyio.Event] = {}
        self._got: dict[int, torch.Tensor | BaseException] = {}
        self.bytes_read = 0
        self.tg: TaskGroup | None = None

    def start(self, tg: TaskGroup) -> None:
        """Request every wanted activation, in chunk order, as tasks of `tg` (`get` alone fetches on
        demand, for a policy that computes only the chunks whose load failed)."""
        self.tg = tg
        for c, wanted in enumerate(self.wanted):
            if wanted:
                self._request(c)

    def _request(self, c: int) -> None:
        if c not in self._done:
            assert self.tg is not None, "BoundaryReader used before start()"
            self._done[c] = anyio.Event()
            self.tg.start_soon(self._fetch, c)

    async def get(self, c: int) -> torch.Tensor:
        self._request(c)
        await self._done[c].wait()
        got = self._got[c]
        if isinstance(got, BaseException):
            ref = self.refs[c]
            raise StageFailedError(
                f"the boundary activation of chunk {c} (tokens [{ref.start}, {ref.end})) at layer {self.layer} "
                f"is unusable: {type(got).__name__}: {got}"
            ) from got
        return got.to(self.device)[None]

    async def _fetch(self, c: int) -> None:
        ref = self.refs[c]
        try:
            data = await self.store.get(codec.boundary_key(ref.key, self.layer))
            if data is None:
                raise MissingChunkError("not in the store")
            self.bytes_read += len(data)
            self._got[c] = await anyio.to_thread.run_sync(
                lambda: codec.decode_boundary(
                    data, self.spec, ref.key, ref.start, ref.n_tokens, self.layer, self.hidden_size, self.seal
                )
            )
        except LOAD_FAULTS as exc:
            log.warning(
                "boundary activation of chunk %d at layer %d: %s: %s", c, self.layer, type(exc).__name__, exc
            )
            self._got[c] = exc
        finally:
            self._done[c].set()
