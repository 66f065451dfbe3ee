"""kvrestore inside vLLM: a KV connector (V1 API) over kvrestore's stores, chunk keys and chunk reader.

vLLM finds it by module path and class name::

    KVTransferConfig(kv_connector="KVRestoreConnector", kv_connector_module_path="kvrestore.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"store_url": "/var/cache/kv"})

The package, by side: `connector` (the class vLLM makes, one per process and role: the glue to vLLM),
`scheduler` (lookups, splits, what each step loads and saves), `worker` (vLLM's pages as destinations of
chunkio's reader, the saves), `meta` (what the two sides tell each other), `config` (the checked
`kv_connector_extra_config` and what both sides share), `keys` (a request's key space), `layouts` (vLLM's
paged layouts as K and V views), `stats` (counters and records). Only `connector` and `meta` import vLLM:
the names below are loaded on first use, so the vLLM-free modules import without vLLM installed.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the connector's public names, each in the module that defines it
_NAMES = {
    "KVRestoreConnector": "connector",
    "KVRestoreStats": "connector",
    "flush_saves": "connector",
    "step_tokens": "connector",
    "KVRestoreConnectorMetadata": "meta",
    "records": "stats",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
