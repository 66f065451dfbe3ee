"""The vLLM connector's configuration and its context (what the scheduler and worker sides share),
without vLLM. The split is `planning.split`'s; the learned costs `costs.learned`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrestore.chunkio.parts import Layout, engine_layout, tp_sizes
from kvrestore.codec.header import spec_encoding
from kvrestore.codec.quant import ENCODINGS, key_space
from kvrestore.codec.seal import SECRET_ENV, Seal, seal_of, secret_from_env
from kvrestore.core.errors import InvalidInputError, UnsupportedModelError
from kvrestore.core.paths import cache_root
from kvrestore.core.settings import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_path,
    check_seconds,
    check_text,
)
from kvrestore.core.spec import ModelSpec
from kvrestore.costs.learned import CostLearner, learned_dir
from kvrestore.costs.links import LinkCost
from kvrestore.integrations.vllm.layouts import LAYOUTS
from kvrestore.planning.split import SPLITS
from kvrestore.stores import MemoryStore, ThrottledStore, check_store_url, open_store
from kvrestore.stores.base import ChunkStore

# -- configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorConfig:
    """`kv_connector_extra_config`, checked. Only `store_url` is required."""

    store_url: str
    chunk_size: int = 256
    compression: str = "none"
    split: str = "planned"  # "planned" | "load_all" | "compute_all" (never load)
    #: CacheFlow's batch rule: a split counts the loads queued on the link ahead of it, and the link
    #: serves first the load that saves the most compute per byte (False: each split as if alone)
    batch: bool = True
    #: under the batch rule, on an idle engine, a new request is answered "ask again" for up to this long,
    #: so the requests arriving with it are planned together (`planning.split.choose_split_ahead`); 0:
    #: not. Off by default: on a 2-core CPU it measured no better (docs/benchmarks.md)
    gather_s: float = 0.0
    store_options: Mapping[str, Any] = field(default_factory=dict)  # passed to open_store
    save: bool = True
    load: bool = True
    lookup_timeout_s: float = 2.0  # a store that does not answer a lookup in time is down: 0 tokens
    load_timeout_s: float = 30.0  # a layer not loaded in time: its blocks are load errors
    save_queue_bytes: int = 1 << 30  # KV waiting to be written; a save that does not fit is dropped
    retry_after_s: float = 10.0  # after a store fault, lookups answer 0 for this long
    on_load_error: str = "recompute"  # vLLM's kv_load_failure_policy the connector sets
    throttle_bytes_per_s: float | None = None  # read the store through a ThrottledStore (benchmarks)
    throttle_latency_s: float = 0.0
    #: priors for the link until loads have measured it: what one rank's reads get (a rank's link), and
    #: what the ranks on one host share (its NIC or disk); a rank plans with the smaller of the two
    link_bytes_per_s: float | None = None
    host_link_bytes_per_s: float | None = None
    fingerprint: str | None = None  # default: computed from the checkpoint's weights and dtype
    cost_dir: str | None = None  # where learned costs persist (default: the kvrestore cache dir)
    layout: str | None = None  # vLLM's paged layout (`layouts.LAYOUTS`); default: from the device
    kv_encoding: str = "native"  # how saved chunks hold the KV (`codec.quant.ENCODINGS`), as a Restorer's
    #: signs every chunk saved and checks every chunk loaded (`codec.seal`); default: $KVRESTORE_SECRET.
    #: vLLM logs its config at start-up, so the environment variable is the place for a real secret.
    secret: str | None = field(default=None, repr=False)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known, key=str)
        if unknown:
            raise InvalidInputError(
                f"unknown kv_connector_extra_config keys {unknown}; KVRestoreConnector takes {sorted(known)}"
            )
        url = extra.get("store_url")
        if url is None or (isinstance(url, str) and not url.strip()):
            raise InvalidInputError(
                "kv_connector_extra_config needs store_url, e.g. {'store_url': '/var/cache/kv'} or 's3://bucket/kv'"
            )
        check_text("store_url", url)  # (what a URL may be is open_store's to say)
        cfg = cls(**extra)
        check_int("chunk_size", cfg.chunk_size)
        check_int("save_queue_bytes", cfg.save_queue_bytes)
        for name in ("batch", "save", "load"):
            check_bool(name, getattr(cfg, name))
        for name in ("lookup_timeout_s", "load_timeout_s"):
            check_seconds(name, getattr(cfg, name))
        check_number("retry_after_s", cfg.retry_after_s, positive=True, finite=True)
        for name in ("throttle_bytes_per_s", "link_bytes_per_s", "host_link_bytes_per_s"):
            if getattr(cfg, name) is not None:
                check_number(name, getattr(cfg, name), positive=True, finite=True)
        check_number("throttle_latency_s", cfg.throttle_latency_s, 0, finite=True)
        check_number("gather_s", cfg.gather_s, 0, 10)
        choices = {
            "compression": ("none", "zstd"),
            "split": SPLITS,
            "on_load_error": ("recompute", "fail"),
            "kv_encoding": ENCODINGS,
            "layout": (None, *LAYOUTS),
        }
        for name, allowed in choices.items():
            check_choice(name, getattr(cfg, name), allowed)
        if not isinstance(cfg.store_options, Mapping):
            raise InvalidInputError(f"store_options must be a dict, got {type(cfg.store_options).__name__}")
        if cfg.fingerprint is not None:
            check_text("fingerprint", cfg.fingerprint)
        if cfg.cost_dir is not None:
            check_path("cost_dir", cfg.cost_dir)
        if cfg.secret is not None and not isinstance(cfg.secret, str):
            raise InvalidInputError(f"secret must be a string, got {type(cfg.secret).__name__}")
        check_environment(cfg.secret)
        return cfg


def check_environment(secret: str | None) -> None:
    """Refuse, by name, the environment variables the connector reads that it could not use: a
    `KVRESTORE_SECRET` (unless `secret` is given) that is too short or not UTF-8, a
    `KVRESTORE_CACHE_DIR` or `KVRESTORE_LEARNED_DIR` that is no usable path."""
    if secret is None and (env := secret_from_env()) is not None:
        try:
            seal_of(env)
        except InvalidInputError as e:
            raise InvalidInputError(f"{SECRET_ENV}: {e}") from None
    else:
        seal_of(secret)  # a weak secret: refused now
    cache_root()
    learned_dir()


@dataclass(frozen=True)
class ConnectorContext:
    """What the scheduler and worker sides share: the checked config, the model, vLLM's block size, the
    learned costs, and the most tokens one engine step computes where vLLM chunks long prompts across
    steps (None where it does not). Each side opens its own store (`open_store`)."""

    config: ConnectorConfig
    spec: ModelSpec
    block_size: int
    costs: CostLearner
    step_tokens: int | None = None
    #: vLLM's tensor-parallel size and pipeline-parallel size: each rank saves and loads its part
    tp: int = 1
    pp: int = 1
    #: the engine's ranks on one host: they load at once, over the host's link (`prior_link`)
    host_ranks: int = 1

    @classmethod
    def make(
        cls,
        config: ConnectorConfig,
        spec: ModelSpec,
        block_size: int,
        step_tokens: int | None = None,
        tp: int = 1,
        pp: int = 1,
        host_ranks: int = 1,
    ) -> ConnectorContext:
        costs = CostLearner.shared(spec, config.cost_dir)
        return cls(config, spec, block_size, costs, step_tokens, tp, pp, host_ranks)

    @functools.cached_property
    def layout(self) -> Layout:
        """The parts this engine's ranks write (`chunkio.parts.engine_layout`)."""
        return engine_layout(self.spec, self.tp, self.pp)

    @functools.cached_property
    def layouts(self) -> list[Layout]:
        """The layouts a lookup finds chunks in: this engine's first, then every tensor-parallel split of
        the heads over the same stages, then (for a pipeline-parallel engine) over no stages: whole chunks
        first. Each rank reads the parts over its heads and layers (`part_loads.share_loads`). An engine
        without stages does not look for the parts of a pipeline split."""
        stages = [self.pp] if self.pp == 1 else [self.pp, 1]
        tps = tp_sizes(self.spec.num_kv_heads)
        others = [engine_layout(self.spec, tp, pp) for pp in stages for tp in tps]
        return [self.layout] + [lo for lo in others if lo != self.layout]

    @property
    def key_space(self) -> str:
        """What chunk keys are hashed under before a request's namespace (`keys`): as a `Restorer`
        with the same `kv_encoding` keys them (`quant.key_space`)."""
        return key_space(self.spec.fingerprint, self.config.kv_encoding)

    @functools.cached_property
    def seal(self) -> Seal | None:
        """What signs saved chunks and checks loaded ones: the config's `secret`, else
        `$KVRESTORE_SECRET`, else None (chunks neither signed nor checked)."""
        c = self.config
        return seal_of(c.secret if c.secret is not None else secret_from_env())

    @property
    def stored_bytes_per_token(self) -> float:
        """Bytes one rank's load reads per token, as stored (scales and padding included), in the
        encoding chunks are saved in and the only one loaded: a whole chunk's over the parts of this
        engine's layout, which its ranks read at once (the link's cost is learned per rank)."""
        encoding = spec_encoding(self.spec, self.config.kv_encoding)
        return encoding.bytes_per_token(self.config.chunk_size, self.spec.num_layers) / len(self.layout)

    @property
    def link_key(self) -> str:
        """The store's link as the costs know it: its URL, the throttle if one is set, and how many ranks
        of a host load at once (a rank's share of the host's link is learned apart for each)."""
        c = self.config
        t = c.throttle_bytes_per_s
        key = c.store_url + (f"@{t:.0f}B/s+{c.throttle_latency_s}s" if t else "")
        return key + (f"|{self.host_ranks} ranks" if self.host_ranks > 1 else "")

    def open_store(self) -> ChunkStore:
        """The store (through a `ThrottledStore` if `throttle_bytes_per_s` is set); read-only, never even
        probed, with ``"save": false``. A ``memory://`` store is one per process and options, which are
        `MemoryStore`'s (``pinned=True``: page-locked, for uploads to a GPU): the scheduler side finds
        what the worker side saved in the same process (`check_shared_memory`)."""
        c = self.config
        store: ChunkStore
        if c.store_url == "memory://":
            store = MemoryStore.shared(**dict(c.store_options))
        else:
            store = open_store(c.store_url, **{"read_only": not c.save, **dict(c.store_options)})
        if c.throttle_bytes_per_s is not None:
            store = ThrottledStore(store, c.throttle_bytes_per_s, latency_s=c.throttle_latency_s)
        return store

    def prior_link(self) -> LinkCost | None:
        """A rank's link as configured, until loads have measured it: its own (`link_bytes_per_s`, or
        the throttle, which each rank's reads go through), or its share of the host's
        (`host_link_bytes_per_s` over the host's ranks, which load at once), whichever is smaller."""
        c = self.config
        own = c.link_bytes_per_s or c.throttle_bytes_per_s
        host = c.host_link_bytes_per_s / self.host_ranks if c.host_link_bytes_per_s else None
        bws = [bw for bw in (own, host) if bw]
        return LinkCost(min(bws), c.throttle_latency_s) if bws else None


def parallel_sizes(parallel_config: Any, spec: ModelSpec) -> tuple[int, int, int]:
    """vLLM's tensor- and pipeline-parallel sizes and its ranks on one host, checked against what the
    connector supports: each rank saves and loads its own KV heads of its stage's layers
    (`chunkio.parts`). Data parallel engines (several schedulers) are refused by name, as are sizes that
    do not split the model's KV heads or layers."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    dp = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    if dp > 1:
        raise UnsupportedModelError(
            f"kvrestore's connector does not support data parallel engines (data_parallel_size={dp}); "
            "tensor and pipeline parallel are supported"
        )
    try:
        engine_layout(spec, tp, pp)  # the parts its ranks write: vLLM's split of heads and layers
    except InvalidInputError as exc:
        raise UnsupportedModelError(
            f"kvrestore's connector does not support tensor_parallel_size={tp} with "
            f"pipeline_parallel_size={pp} for this model: {exc}"
        ) from exc
    nodes = int(getattr(parallel_config, "nnodes", 1) or 1)
    return tp, pp, max(1, tp * pp // nodes)


def check_shared_memory(config: ConnectorConfig, executor_backend: str | None, world_size: int = 1) -> None:
    """Refuse a ``memory://`` store where vLLM's scheduler and worker run in two processes (the scheduler
    would never find what the worker saved). They share one with ``distributed_executor_backend`` "uni"
    and one worker: on a GPU by default, on a CPU with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``."""
    if config.store_url != "memory://":
        return
    if executor_backend not in ("uni", None) or world_size > 1:
        raise InvalidInputError(
            f"store_url 'memory://' is a store per process, and this vLLM runs its scheduler and its "
            f"worker{'s' if world_size > 1 else ''} in separate processes (distributed_executor_backend="
            f"{executor_backend!r}, {world_size} worker{'s' if world_size > 1 else ''}): nothing saved "
            "would ever be found. Use a directory (store_url='/var/cache/kv') or another shared store; on "
            "a CPU, VLLM_ENABLE_V1_MULTIPROCESSING=0 runs both in one process"
        )


def preflight(config: ConnectorConfig) -> None:
    """Check the store URL (a typo, an unknown scheme: a typed error naming the known ones) and open a
    local directory store as the connector will (probed for writing, or read-only with ``"save":
    false``), so a store that cannot be used stops the server before vLLM loads the model. Other stores
    are opened when the connector starts (an S3 bucket is first asked at the first lookup)."""
    if check_store_url(config.store_url) == "file":
        open_store(config.store_url, **{"read_only": not config.save, **dict(config.store_options)})
