"""What the vLLM connector did, for an operator and for tests, without vLLM: counters and records.

`Counters` are reported through vLLM's KV connector stats (`vllm.KVRestoreStats`: summed across workers
and intervals, logged with vLLM's metrics, exported to Prometheus as ``vllm:kvrestore_*``). A record
(`emit`) is one dict per event (a failed lookup, a split, a load done or failed, a chunk not saved),
logged on the ``kvrestore.vllm`` logger (``extra={"kvrestore": record}``) and kept, the last
`MAX_RECORDS`, for `records()`: a script or a test reads what happened as data, not log text.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

log = logging.getLogger("kvrestore.vllm")

#: name -> what it counts (every counter is a sum: across workers, across steps)
COUNTERS: dict[str, str] = {
    "lookups": "prompts looked up in the store",
    "lookup_failures": "lookups the store did not answer in time (served without it)",
    "hit_tokens": "prompt tokens found stored that a load can take (whole blocks, less the last token)",
    "planned_tokens": "prompt tokens the split chose to load",
    "partial_splits": "requests where the split loads part of what is stored and computes the rest",
    "waited_requests": "requests that waited a step: joining a full one was predicted later",
    "gathered_requests": 'requests answered "ask again" to be planned with those arriving beside them',
    "loads": "requests whose stored tokens were loaded",
    "loaded_tokens": "tokens loaded into vLLM's pages",
    "loaded_bytes": "bytes read from the store by loads",
    "load_failures": "requests whose load failed in part or whole",
    "failed_chunks": "chunks that did not load (missing, damaged, another model's, or late)",
    "recomputed_tokens": "tokens vLLM recomputed because their load failed",
    "saved_chunks": "chunks written to the store",
    "saved_bytes": "bytes written to the store",
    "dropped_chunks": "chunks not saved: the save queue was full",
    "failed_saves": "chunks whose write failed",
    "unkeyed_requests": "requests neither loaded nor saved: their KV depends on what no key names",
}

MAX_RECORDS = 1000
_records: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)
_records_lock = threading.Lock()


class Counters:
    """The connector's counters since they were last taken (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._data[name] += n

    def take(self) -> dict[str, int]:
        """The counts since the last `take`, and start again from zero."""
        with self._lock:
            data, self._data = self._data, dict.fromkeys(COUNTERS, 0)
        return data


def sum_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two counters' dicts added (vLLM aggregates workers' and the scheduler's stats this way)."""
    return {name: a.get(name, 0) + b.get(name, 0) for name in {*a, *b}}


def emit(level: int, event: str, message: str, **fields: Any) -> dict[str, Any]:
    """Keep a record of `event` with `fields` and log `message` (formatted with the fields) at `level`."""
    record = {"event": event, **fields}
    with _records_lock:
        _records.append(record)
    log.log(level, "kvrestore: " + message, fields, extra={"kvrestore": record})
    return record


def log_through(
    vllm: logging.Logger, *, logger: logging.Logger | None = None, root: logging.Logger | None = None
) -> bool:
    """Send the ``kvrestore`` logger's records (`logger`) to vLLM's logger's handlers (`vllm`), at INFO
    unless a level was set, where the application configured no logging (no handler on `logger` or the
    root logger): under ``vllm serve`` they would otherwise reach no handler, vLLM configuring only its
    own logger. True if it attached them."""
    logger = logger if logger is not None else logging.getLogger("kvrestore")
    root = root if root is not None else logging.getLogger()
    if logger.handlers or root.handlers or not vllm.handlers:
        return False
    for handler in vllm.handlers:
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return True


def records(event: str | None = None) -> list[dict[str, Any]]:
    """The records kept in this process, oldest first (those of one `event` if given). The worker's are
    kept where it runs: on a GPU, in vLLM's engine core process unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`
    (the serving process sees them only as log lines and vLLM's KV connector stats)."""
    with _records_lock:
        return [dict(r) for r in _records if event is None or r["event"] == event]
