"""What the vLLM connector's two sides tell each other: each step's loads and saves (scheduler ->
worker, `KVRestoreConnectorMetadata`) and the loads that finished and the chunks that did not load
(worker -> scheduler, `KVRestoreWorkerMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvrestore.chunkio.parts import Layout
from kvrestore.core.keys import ChunkRef


@dataclass
class LoadSpec:
    """Load tokens [first, k) of `req_id` (`first`: where vLLM's own prefix cache ends) from `chunks`,
    the stored chunks that hold them, into its pages `block_ids`. `layout`: the parts the chunks are
    stored as (`chunkio.parts`; None: whole chunks)."""

    req_id: str
    chunks: list[ChunkRef]
    k: int
    block_ids: list[int]
    first: int = 0
    layout: Layout | None = None


@dataclass
class SaveSpec:
    req_id: str
    chunks: list[ChunkRef]
    block_ids: list[int]


@dataclass
class KVRestoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: (req_id, new tokens, tokens already computed) of every request in the step: what compute costs
    steps: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class KVRestoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per request, the chunks that did not load (vLLM recomputes them; the
    scheduler side then saves them again), and the requests whose loads are over (off the link)."""

    failed: dict[str, set[int]] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVRestoreWorkerMetadata):
            for req_id, chunks in other.failed.items():
                self.failed.setdefault(req_id, set()).update(chunks)
            self.loaded |= other.loaded
        return self
