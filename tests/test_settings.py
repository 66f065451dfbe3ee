"""Every setting is checked where it is given: every public constructor's arguments, every key of the
vLLM connector's `kv_connector_extra_config` and the environment variables it reads refuse a value of
the wrong type (or one UTF-8 or the file system cannot encode, or a path with whitespace around it)
with a `KVRestoreError` that names the setting.

One table (`TABLE`): a row per setting, with the kind of value it takes, whether None is one, and a
value it accepts. The test hands each row the wrong values every setting of its kind must refuse, then
values hypothesis draws of every other type, and counts what was accepted and what raised untyped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrestore import (
    Auto,
    BatchEngine,
    Blend,
    ComputeOnly,
    HFBackend,
    KVRestoreError,
    LayerTwoPointer,
    LoadOnly,
    Restorer,
    SyncRestorer,
    TokenTwoPointer,
    open_store,
)
from kvrestore.codec.seal import SECRET_ENV, Seal
from kvrestore.core.bandwidth import BandwidthTrace
from kvrestore.distributed import StageLayout, StageRestorer
from kvrestore.integrations.vllm.config import ConnectorConfig
from kvrestore.policies.batch import BatchAware, FifoLanes
from kvrestore.runtime.batch_engine import DEFAULT_COST
from kvrestore.runtime.engine import Engine
from kvrestore.stores import (
    LRU,
    BoundedStore,
    FsspecStore,
    LocalStore,
    MemoryStore,
    PrefetchStore,
    ReadOnlyStore,
    ThrottledStore,
    TieredStore,
)
from kvrestore.stores.mooncake_store import MooncakeStore
from kvrestore.stores.redis_store import RedisStore

from .conftest import tiny_model

MODEL = tiny_model("llama")
BACKEND = HFBackend(MODEL, name="tiny-llama")
SECRET = "s" * 32
QUIET = {"learn": False, "profile": False}  # a restorer that reads and writes no cost files
NOT_GIVEN = object()  # a row whose accepted value cannot be built here (it needs a process group)


class Path2(os.PathLike):
    """A PathLike whose path is `path` (a str with whitespace around it, or unencodable)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"Path2({self.path!r})"


# -- the wrong values of each kind ----------------------------------------------------------------

UNENCODABLE = ["\ud800", "tenant-\udfff", "\udc80" * 16]  # lone surrogates: no UTF-8 for them
OTHER_TYPES = [object(), [1], {"a": 1}, b"bytes", 1j]
KINDS: dict[str, list[Any]] = {
    "bool": ["false", "true", "False", 0, 1, 0.0, "yes", [], *OTHER_TYPES],
    "int": [True, False, 1.5, 2.0, "4", "1e3", float("nan"), float("inf"), *OTHER_TYPES],
    "number": [True, False, "0.5", "1", float("nan"), *OTHER_TYPES],
    "text": [5, 1.5, True, *UNENCODABLE, *OTHER_TYPES],
    "path": [5, True, " /srv/kv", "/srv/kv ", "\t/x", "", "\ud800", Path2(" /x "), *OTHER_TYPES],
    "bool_or_path": [5, "false", "True", " x ", "\ud800", "", *OTHER_TYPES],
    "url": [5, True, *OTHER_TYPES],  # what a URL may be is `open_store`'s (its scheme, its whitespace)
    "choice": [True, 1, 0, 1.5, "NONE ", *UNENCODABLE, *OTHER_TYPES],
    "instance": [5, "x", True, 1.5, *OTHER_TYPES],
    "policies": [TokenTwoPointer(), "two-pointer", [Auto()], ["x"], [], 5, True, *OTHER_TYPES[:1]],
    "secret": [5, True, 1.5, "\ud800" * 16, "short", [b"x" * 16], *OTHER_TYPES[:3]],
    "profile": [True, 5, 1.5, " /p.json", "\ud800", *OTHER_TYPES],
    "dtype": ["float32", "bfloat16", 5, True, torch.int64, *OTHER_TYPES],
    "device": [5, True, 1.5, "gpu", "cuda:x", " cpu", *UNENCODABLE, *OTHER_TYPES],
    "mapping": [5, "x", [("a", 1)], True, *OTHER_TYPES[:1]],
}


def drawn(kind: str, optional: bool) -> st.SearchStrategy[Any]:
    """Values hypothesis draws of other types than `kind` takes (None included unless `optional`)."""
    others: dict[str, st.SearchStrategy[Any]] = {
        "bool": st.integers(),
        "int": st.floats(),
        "number": st.text(max_size=8),
        "none": st.none(),
        "list": st.lists(st.integers(), max_size=3),
        "bytes": st.binary(max_size=8),
        "unencodable": st.builds(
            lambda a, s, b: a + s + b,
            st.text(max_size=4),
            st.characters(min_codepoint=0xD800, max_codepoint=0xDBFF),
            st.text(max_size=4),
        ),
        "padded": st.builds(
            lambda w, s: w + s, st.sampled_from([" ", "\t", "\n"]), st.text(min_size=1, max_size=6)
        ),
        "bools": st.booleans(),
    }
    skip = {
        "bool": {"bools"},
        "int": {"bool"},  # integers are ints (the range is the row's business, not the type's)
        "number": {"bool", "int"},
        "text": {"number", "padded"},  # (plain text is text, spaces and all)
        "path": {"number"},
        "bool_or_path": {"number", "bools"},
        "url": {"number", "padded", "unencodable"},
        "choice": {"number"},  # (a drawn word could be one of the choices)
        "secret": {"bytes", "number", "padded"},
        "profile": {"number", "bools"},  # (False: no profile)
        "device": {"number"},
    }.get(kind, set())
    if optional:
        skip = skip | {"none"}
    return st.one_of(*(s for name, s in others.items() if name not in skip))


@dataclass(frozen=True)
class Row:
    """One setting: `make(value)` gives it `value` (the others at values they accept)."""

    where: str
    name: str
    kind: str
    make: Callable[[Any], Any]
    ok: Any  # a value it accepts (NOT_GIVEN: none can be built here)
    optional: bool = False  # None is a value it takes
    extra: tuple[Any, ...] = ()  # more wrong values of its own (out of range, unknown names)

    @property
    def id(self) -> str:
        return f"{self.where}.{self.name}"


def restorer(**kw: Any) -> Any:
    return Restorer(BACKEND, MemoryStore(), **{**QUIET, **kw})


def sync_restorer(**kw: Any) -> Any:
    r = SyncRestorer(BACKEND, MemoryStore(), **{**QUIET, **kw})
    r.close()
    return r


def connector(**kw: Any) -> Any:
    return ConnectorConfig.from_extra({"store_url": "/srv/kv", **kw})


REDIS, MOONCAKE = "redis://127.0.0.1:6379/0/kv", "mooncake://127.0.0.1:50051/kv"  # (never reached)


def redis_store(**kw: Any) -> Any:
    return RedisStore(REDIS, **kw)


def mooncake_store(**kw: Any) -> Any:
    return MooncakeStore(MOONCAKE, **kw)


def fsspec_store(**kw: Any) -> Any:
    return FsspecStore("memory://kvrestore-settings", **kw)


def local_store(tmp: Path, **kw: Any) -> Any:
    return LocalStore(str(tmp), **kw)


def table(tmp: Path) -> list[Row]:
    def checkpoint_dir() -> Path:
        """A checkpoint saved under `tmp` on first use (only rows that load one need it)."""
        from .test_fingerprint import save_checkpoint

        if not (tmp / "ckpt" / "config.json").exists():
            save_checkpoint(tmp / "ckpt", MODEL)
        return tmp / "ckpt"

    m = MemoryStore
    r = Row
    # fmt: off
    rows = [
        # Restorer and SyncRestorer
        r("Restorer", "backend", "instance", lambda v: Restorer(v, m(), **QUIET), BACKEND, extra=(MODEL,)),
        r("Restorer", "store", "instance", lambda v: Restorer(BACKEND, v, **QUIET), m(), extra=("memory://",)),
        r("Restorer", "chunk_size", "int", lambda v: restorer(chunk_size=v), 16, extra=(0, -1)),
        r("Restorer", "load_lanes", "int", lambda v: restorer(load_lanes=v), 2, extra=(0,)),
        r("Restorer", "compression", "choice", lambda v: restorer(compression=v), "zstd", extra=("lz4",)),
        r("Restorer", "kv_encoding", "choice", lambda v: restorer(kv_encoding=v), "int8", extra=("int3",)),
        r("Restorer", "engine", "instance", lambda v: restorer(engine=v), Engine(2), optional=True),
        *(r("Restorer", n, "number", lambda v, n=n: restorer(**{n: v}), 1.5, optional=True, extra=(0, -1)) for n in ("load_timeout_s", "lookup_timeout_s", "save_timeout_s")),
        r("Restorer", "profile", "profile", lambda v: restorer(profile=v), False, optional=True),
        r("Restorer", "learn", "bool_or_path", lambda v: restorer(learn=v), False),
        r("Restorer", "namespace", "text", lambda v: restorer(namespace=v), "tenant", optional=True, extra=("",)),
        r("Restorer", "secret", "secret", lambda v: restorer(secret=v), SECRET, optional=True),
        r("SyncRestorer", "chunk_size", "int", lambda v: sync_restorer(chunk_size=v), 16),
        r("SyncRestorer", "namespace", "text", lambda v: sync_restorer(namespace=v), "t", optional=True),
        r("SyncRestorer", "secret", "secret", lambda v: sync_restorer(secret=v), SECRET, optional=True),
        r("SyncRestorer", "learn", "bool_or_path", lambda v: sync_restorer(learn=v), False),
        r("StageRestorer", "timeout_s", "number", lambda v: StageRestorer(BACKEND, m(), StageLayout(((0, 3),)), timeout_s=v), NOT_GIVEN, extra=(0, -1)),
        r("StageRestorer", "layout", "instance", lambda v: StageRestorer(BACKEND, m(), v), NOT_GIVEN),
        # HFBackend
        r("HFBackend", "model", "instance", lambda v: HFBackend(v), MODEL, extra=(BACKEND,)),
        r("HFBackend", "dtype", "dtype", lambda v: HFBackend(MODEL, dtype=v), torch.float32, optional=True),
        r("HFBackend", "device", "device", lambda v: HFBackend(MODEL, device=v), "cpu", optional=True),
        r("HFBackend", "name", "text", lambda v: HFBackend(MODEL, name=v), "tiny", optional=True),
        r("HFBackend", "fingerprint", "text", lambda v: HFBackend(MODEL, fingerprint=v), "ab" * 16, optional=True),
        r("HFBackend.from_pretrained", "path", "path", lambda v: HFBackend.from_pretrained(v), NOT_GIVEN),
        r("HFBackend.from_pretrained", "cache_dir", "path", lambda v: HFBackend.from_pretrained(checkpoint_dir(), cache_dir=v), tmp / "c", optional=True),
        r("HFBackend.from_pretrained", "dtype", "dtype", lambda v: HFBackend.from_pretrained(checkpoint_dir(), dtype=v), torch.float32),
        r("HFBackend.from_smollm2", "dtype", "dtype", lambda v: HFBackend.from_smollm2(dtype=v), NOT_GIVEN),
        r("HFBackend.from_smollm2", "device", "device", lambda v: HFBackend.from_smollm2(device=v), NOT_GIVEN, optional=True),
        r("HFBackend.from_smollm2", "cache_dir", "path", lambda v: HFBackend.from_smollm2(cache_dir=v), NOT_GIVEN, optional=True),
        # stores
        r("MemoryStore", "capacity_bytes", "int", lambda v: m(capacity_bytes=v), 0, optional=True, extra=(-1,)),
        r("MemoryStore", "eviction", "choice", lambda v: m(1 << 20, eviction=v), "fifo", optional=True, extra=("mru",)),
        r("MemoryStore", "pinned", "bool", lambda v: m(pinned=v), False),
        r("LocalStore", "url", "url", lambda v: LocalStore(v), str(tmp / "local")),
        r("LocalStore", "fsync", "bool", lambda v: local_store(tmp, fsync=v), True),
        r("LocalStore", "read_only", "bool", lambda v: local_store(tmp, read_only=v), False),
        r("FsspecStore", "url", "url", lambda v: FsspecStore(v), "memory://kvrestore-settings"),
        r("FsspecStore", "fsync", "bool", lambda v: fsspec_store(fsync=v), True),
        r("FsspecStore", "create_bucket", "bool", lambda v: fsspec_store(create_bucket=v), True),
        r("open_store", "url", "url", lambda v: open_store(v), "memory://"),
        r("open_store", "read_only", "bool", lambda v: open_store(str(tmp), read_only=v), True),
        r("open_store", "capacity_bytes", "int", lambda v: open_store(str(tmp), capacity_bytes=v), 1 << 20, optional=True, extra=(0,)),
        r("open_store", "eviction", "choice", lambda v: open_store("memory://", capacity_bytes=1, eviction=v), "lru", optional=True),
        r("open_store", "fsync", "bool", lambda v: open_store(str(tmp), fsync=v), True),
        r("TieredStore", "tiers", "instance", lambda v: TieredStore(v), [m()], extra=([], [5], [m(), "memory://"])),
        r("TieredStore", "write", "choice", lambda v: TieredStore([m()], write=v), "through", extra=("sideways",)),
        r("TieredStore", "promote", "bool", lambda v: TieredStore([m()], promote=v), False),
        *(r("TieredStore", n, "int", lambda v, n=n: TieredStore([m()], **{n: v}), 2, extra=(0,)) for n in ("max_dirty_bytes", "max_promote_bytes", "flush_concurrency", "flush_retries")),
        r("BoundedStore", "inner", "instance", lambda v: BoundedStore(v, 10), m()),
        r("BoundedStore", "capacity_bytes", "int", lambda v: BoundedStore(m(), v), 10, extra=(0,)),
        r("BoundedStore", "eviction", "choice", lambda v: BoundedStore(m(), 10, eviction=v), LRU(), optional=True),
        r("PrefetchStore", "inner", "instance", lambda v: PrefetchStore(v), m()),
        r("PrefetchStore", "max_bytes", "int", lambda v: PrefetchStore(m(), max_bytes=v), 10, extra=(0,)),
        r("PrefetchStore", "depth", "int", lambda v: PrefetchStore(m(), depth=v), 2, extra=(0,)),
        r("PrefetchStore", "readahead", "bool", lambda v: PrefetchStore(m(), readahead=v), False),
        r("PrefetchStore", "max_age_s", "number", lambda v: PrefetchStore(m(), max_age_s=v), 1, extra=(0, -1)),
        r("ThrottledStore", "inner", "instance", lambda v: ThrottledStore(v, 1e6), m()),
        r("ThrottledStore", "bytes_per_s", "number", lambda v: ThrottledStore(m(), v), 1e6, extra=(0, -1, float("inf"))),
        r("ThrottledStore", "latency_s", "number", lambda v: ThrottledStore(m(), 1e6, latency_s=v), 0.0, extra=(-1,)),
        r("ThrottledStore", "trace", "instance", lambda v: ThrottledStore(m(), trace=v), BandwidthTrace.constant(1e6)),
        r("ReadOnlyStore", "inner", "instance", lambda v: ReadOnlyStore(v), m()),
        r("RedisStore", "url", "url", lambda v: RedisStore(v), REDIS),
        r("RedisStore", "password", "text", lambda v: redis_store(password=v), "pw", optional=True),
        r("RedisStore", "username", "text", lambda v: redis_store(username=v), "kv", optional=True),
        r("RedisStore", "db", "int", lambda v: redis_store(db=v), 2, optional=True, extra=(-1,)),
        r("RedisStore", "prefix", "text", lambda v: redis_store(prefix=v), "kv", optional=True, extra=("/",)),
        r("RedisStore", "max_connections", "int", lambda v: redis_store(max_connections=v), 4, extra=(0,)),
        r("RedisStore", "unreachable_cooloff_s", "number", lambda v: redis_store(unreachable_cooloff_s=v), 1, extra=(-1,)),
        r("MooncakeStore", "url", "url", lambda v: MooncakeStore(v), MOONCAKE),
        *(r("MooncakeStore", n, "text", lambda v, n=n: mooncake_store(**{n: v}), ok, optional=True) for n, ok in (("metadata_server", "http://127.0.0.1:8080/metadata"), ("local_hostname", "127.0.0.1"), ("prefix", "kv"))),
        r("MooncakeStore", "rdma_devices", "text", lambda v: mooncake_store(rdma_devices=v), "mlx5_0"),
        r("MooncakeStore", "protocol", "choice", lambda v: mooncake_store(protocol=v), "rdma", extra=("udp",)),
        r("MooncakeStore", "global_segment_size", "int", lambda v: mooncake_store(global_segment_size=v), 0, extra=(-1,)),
        r("MooncakeStore", "local_buffer_size", "int", lambda v: mooncake_store(local_buffer_size=v), 1 << 20, extra=(0,)),
        r("MooncakeStore", "unreachable_cooloff_s", "number", lambda v: mooncake_store(unreachable_cooloff_s=v), 0, extra=(-1,)),
        # policies and engines
        r("Auto", "candidates", "policies", lambda v: Auto(v), [LoadOnly(), ComputeOnly()], optional=True),
        r("TokenTwoPointer", "compute_chunks", "int", lambda v: TokenTwoPointer(v), 3, extra=(0,)),
        r("LayerTwoPointer", "compute_layers", "int", lambda v: LayerTwoPointer(v), 3, extra=(0,)),
        r("ComputeOnly", "unit_chunks", "int", lambda v: ComputeOnly(v), 3, optional=True, extra=(0,)),
        r("Blend", "recompute_ratio", "number", lambda v: Blend(recompute_ratio=v), 0.5, optional=True, extra=(-0.1, 1.5)),
        r("Blend", "min_ratio", "number", lambda v: Blend(min_ratio=v), 0.1, extra=(-0.1, 1.5)),
        r("Blend", "max_ratio", "number", lambda v: Blend(max_ratio=v), 0.9, extra=(0.1, 1.5)),
        r("Blend", "spread", "number", lambda v: Blend(spread=v), 0.2, extra=(-1, 2)),
        r("Blend", "deviation", "choice", lambda v: Blend(deviation=v), "k", extra=("q",)),
        r("Blend", "update_candidates", "bool", lambda v: Blend(update_candidates=v), True),
        r("BatchAware", "token_budget", "int", lambda v: BatchAware(token_budget=v), 512, extra=(0,)),
        r("BatchAware", "max_skipped_steps", "int", lambda v: BatchAware(max_skipped_steps=v), 0, extra=(-1,)),
        r("FifoLanes", "token_budget", "int", lambda v: FifoLanes(token_budget=v), 512, extra=(0,)),
        r("BatchEngine", "scheduler", "instance", lambda v: BatchEngine(scheduler=v), FifoLanes(), optional=True),
        r("BatchEngine", "load_lanes", "int", lambda v: BatchEngine(load_lanes=v), 2, extra=(0,)),
        r("BatchEngine", "cost", "instance", lambda v: BatchEngine(cost=v), DEFAULT_COST, optional=True),
        r("Engine", "load_lanes", "int", lambda v: Engine(v), 2, extra=(0,)),
        r("Seal", "secret", "secret", lambda v: Seal(v), SECRET),
        # the vLLM connector's kv_connector_extra_config
        r("connector", "store_url", "url", lambda v: ConnectorConfig.from_extra({"store_url": v}), "/srv/kv", extra=("", " ")),
        r("connector", "chunk_size", "int", lambda v: connector(chunk_size=v), 16, extra=(0,)),
        r("connector", "compression", "choice", lambda v: connector(compression=v), "zstd", extra=("lz4",)),
        r("connector", "split", "choice", lambda v: connector(split=v), "load_all", extra=("half",)),
        r("connector", "batch", "bool", lambda v: connector(batch=v), False),
        r("connector", "gather_s", "number", lambda v: connector(gather_s=v), 0.5, extra=(-1, 11)),
        r("connector", "store_options", "mapping", lambda v: connector(store_options=v), {"capacity_bytes": 10}),
        r("connector", "save", "bool", lambda v: connector(save=v), False),
        r("connector", "load", "bool", lambda v: connector(load=v), False),
        r("connector", "lookup_timeout_s", "number", lambda v: connector(lookup_timeout_s=v), 1, optional=True, extra=(0,)),
        r("connector", "load_timeout_s", "number", lambda v: connector(load_timeout_s=v), 1, optional=True, extra=(0,)),
        r("connector", "save_queue_bytes", "int", lambda v: connector(save_queue_bytes=v), 1 << 20, extra=(0,)),
        r("connector", "retry_after_s", "number", lambda v: connector(retry_after_s=v), 1, extra=(0,)),
        r("connector", "on_load_error", "choice", lambda v: connector(on_load_error=v), "fail", extra=("ignore",)),
        r("connector", "throttle_bytes_per_s", "number", lambda v: connector(throttle_bytes_per_s=v), 1e6, optional=True, extra=(0,)),
        r("connector", "throttle_latency_s", "number", lambda v: connector(throttle_latency_s=v), 0.01, extra=(-1,)),
        r("connector", "link_bytes_per_s", "number", lambda v: connector(link_bytes_per_s=v), 1e9, optional=True, extra=(0,)),
        r("connector", "fingerprint", "text", lambda v: connector(fingerprint=v), "ab" * 16, optional=True, extra=("",)),
        r("connector", "cost_dir", "path", lambda v: connector(cost_dir=v), str(tmp / "costs"), optional=True),
        r("connector", "layout", "choice", lambda v: connector(layout=v), "cpu", optional=True, extra=("ABC",)),
        r("connector", "kv_encoding", "choice", lambda v: connector(kv_encoding=v), "fp8", extra=("int3",)),
        r("connector", "secret", "secret", lambda v: connector(secret=v), SECRET, optional=True),
    ]
    # fmt: on
    return rows


ENV_ROWS = {  # the environment variables the connector reads: values it must refuse
    SECRET_ENV: [b"\xff" * 32, b"\x80abcdefghijklmnopq", b"short"],
    "KVRESTORE_CACHE_DIR": [b" /srv/cache", b"/srv/cache\n"],
    "KVRESTORE_LEARNED_DIR": [b"\t/srv/learned", b"/srv/learned "],
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[Row]:
    return table(tmp_path_factory.mktemp("settings"))


def outcome(row: Row, value: Any) -> str | None:
    """None where `value` is refused as it must be; else what went wrong."""
    try:
        made = row.make(value)
    except KVRestoreError as exc:
        if row.name.lower() not in str(exc).lower():
            return f"refused without naming {row.name}: {exc}"
        return None
    except Exception as exc:  # noqa: BLE001 - an untyped error is what this test counts
        return f"untyped {type(exc).__name__}: {exc}"
    _close(made)
    return "accepted"


def _close(made: Any) -> None:
    if isinstance(made, Restorer):
        made.engine.close()


N_ROWS = len(table(Path("/nonexistent")))


@pytest.mark.parametrize("index", range(N_ROWS))
def test_every_setting_refuses_wrong_types_by_name(rows, index):
    row = rows[index]
    if row.ok is not NOT_GIVEN:  # the row's other arguments are right: only the value decides
        _close(row.make(row.ok))
    failures = {}
    for value in [*KINDS[row.kind], *row.extra, *([] if row.optional else [None])]:
        if (problem := outcome(row, value)) is not None:
            failures[repr(value)] = problem

    @settings(max_examples=25, suppress_health_check=list(HealthCheck), database=None)
    @given(drawn(row.kind, row.optional))
    def drawn_values(value):
        if (problem := outcome(row, value)) is not None:
            failures[repr(value)] = problem

    drawn_values()
    assert not failures, f"{row.id}: {failures}"


@pytest.mark.parametrize("var", sorted(ENV_ROWS))
def test_the_connectors_environment_variables_are_checked_at_start(var, monkeypatch, tmp_path):
    """Read when the config is checked (before vLLM loads a model), refused by name."""
    for raw in ENV_ROWS[var]:
        monkeypatch.setitem(os.environb, var.encode(), raw)
        with pytest.raises(KVRestoreError, match=var):
            ConnectorConfig.from_extra({"store_url": str(tmp_path)})
        monkeypatch.delitem(os.environb, var.encode())
    ConnectorConfig.from_extra({"store_url": str(tmp_path)})
