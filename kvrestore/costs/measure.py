"""Measuring one machine, model and store into a `Profile`: `profile(backend, store)` (or `kvrestore
profile` on the command line) measures

* the compute time of a prefill of n tokens after p tokens of past KV, at every chunk index of a long
  prompt and for whole prompts of several lengths, fitted to
  ``fixed + n * (per_token + per_token_past * (p + n / 2))`` (attention makes a token's cost grow with
  its position: Cake's "chunk prefill time grows linearly with chunk index");
* the compute time of one decoder layer over N tokens at once, fitted to ``fixed + a N + b N^2``;
* the store's bandwidth and per-request latency, from reads of a few sizes, fitted to
  ``latency + bytes / bandwidth``.
"""

from __future__ import annotations

import functools
import os
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import torch

from kvrestore.core.errors import InvalidInputError, StoreError
from kvrestore.core.spec import dtype_name
from kvrestore.costs.compute import fit_chunk_cost, fit_layer_cost
from kvrestore.costs.links import fit_link
from kvrestore.costs.profile import Profile, machine_id
from kvrestore.stores.base import ChunkStore


def _timed(fn: Callable[[], Any], repeats: int, device: torch.device | str) -> float:
    """The median wall time of `repeats` calls (on CUDA, to the end of the kernels queued on `device`)."""
    device = torch.device(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sample_tokens(backend: Any, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, backend.spec.vocab_size, (n,), generator=g)


MeasureProgress = Callable[[int, int], None]
"""Told (measurements done, measurements in all) after each measurement: how a long step reports."""


def _quiet(_done: int, _total: int) -> None:
    pass


def measure_chunks(
    backend: Any, max_tokens: int, chunk_size: int, repeats: int = 2, progress: MeasureProgress = _quiet
) -> list[list[float]]:
    """[n, past, seconds] of prefills: the chunks (of one and two `chunk_size`s) of a `max_tokens`
    prompt after their past, and whole prompts of doubling lengths (compute-only's one unit)."""
    starts = range(0, max_tokens, chunk_size)
    doublings = _doublings(chunk_size // 2, max_tokens // 2)
    total = 1 + sum(2 if (s // chunk_size) % 2 else 1 for s in starts) + len(doublings)
    tokens = _sample_tokens(backend, max_tokens)
    backend.prefill_chunk(tokens[:chunk_size], None, 0)  # warm-up
    t0 = time.perf_counter()
    full = backend.prefill_chunk(tokens, None, 0).data  # the past every chunk below is computed after
    prefill_into = getattr(backend, "prefill_into", None)
    samples = [[max_tokens, 0, time.perf_counter() - t0]]
    progress(len(samples), total)
    for start in starts:
        sizes = (chunk_size, 2 * chunk_size) if (start // chunk_size) % 2 else (chunk_size,)
        for n in sizes:
            end = min(start + n, max_tokens)
            past = full[:, :, :, :start] if start else None

            def unit(start: int = start, end: int = end, past: torch.Tensor | None = past) -> None:
                if prefill_into is not None:  # what a restore runs: into the cache, over its past
                    prefill_into(tokens[start:end], full, start)  # rewrites [start, end) with its own KV
                else:
                    backend.prefill_chunk(tokens[start:end], past, start)

            samples.append([end - start, start, _timed(unit, repeats, backend.device)])
            progress(len(samples), total)
    for n in doublings:
        prefill = functools.partial(backend.prefill_chunk, tokens[:n], None, 0)
        samples.append([n, 0, _timed(prefill, repeats, backend.device)])
        progress(len(samples), total)
    return samples


def measure_layers(
    backend: Any, lengths: Sequence[int], repeats: int = 2, progress: MeasureProgress = _quiet
) -> list[list[float]]:
    """[n, seconds per layer] of running every decoder layer, one at a time, over n tokens at once.

    All of them, not a few: a few layers' weights stay in the CPU's caches, the whole stack's do not,
    and the per-layer time of the whole stack is what a layer-wise restore pays (by 20% on SmolLM2)."""
    num_layers = backend.spec.num_layers
    samples = []
    for i, n in enumerate(lengths):
        tokens = _sample_tokens(backend, n)
        positions = torch.arange(n)

        def stack(tokens: torch.Tensor = tokens, positions: torch.Tensor = positions) -> None:
            hidden = backend.embed(tokens)
            for layer in range(num_layers):
                hidden, _, _ = backend.run_layer(layer, hidden, None, None, positions)

        if i == 0:
            stack()  # warm-up
        samples.append([n, _timed(stack, repeats, backend.device) / num_layers])
        progress(len(samples), len(lengths))
    return samples


async def measure_link(
    store: ChunkStore, sizes: Sequence[int] = (4096, 256 << 10, 4 << 20), repeats: int = 3
) -> list[list[float]]:
    """[bytes, seconds] of reads from `store` of objects it is given for the purpose (then deleted)."""
    samples = []
    keys = []
    try:
        for size in sizes:
            key = "ff" + secrets.token_hex(19)  # a valid store key nobody else uses
            keys.append(key)
            await store.put(key, os.urandom(size))
            await store.get(key)  # warm-up (and connection setup)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                data = await store.get(key)
                times.append(time.perf_counter() - t0)
                if data is None or len(data) != size:
                    raise StoreError(f"the store lost a {size}-byte test object while being profiled")
            samples.append([float(size), statistics.median(times)])
    finally:
        with anyio.CancelScope(shield=True):
            for key in keys:
                await store.delete(key)
    return samples


async def profile(
    backend: Any,
    store: ChunkStore | None = None,
    *,
    max_tokens: int = 2048,
    chunk_size: int = 256,
    layer_lengths: Sequence[int] | None = None,
    repeats: int = 2,
    log: Callable[[str], None] | None = None,
    tick: Callable[[str], None] | None = None,
) -> Profile:
    """Measure `backend` (and `store`, if given) on this machine; see the module docstring. `log` is
    told each step as it begins, `tick` each measurement as it ends ("prefill cost: 3 of 17").

    Takes about 50 s for SmolLM2 (fp32) on a 2-core CPU with the defaults; a tiny model takes well under one.
    """
    if max_tokens < chunk_size or chunk_size <= 0:
        raise InvalidInputError(f"need 0 < chunk_size <= max_tokens, got {chunk_size} and {max_tokens}")
    say = log or (lambda _msg: None)
    told = tick or (lambda _msg: None)

    def counted(step: str) -> MeasureProgress:
        return lambda done, total: told(f"{step}: {done} of {total} measurements")

    lengths = list(layer_lengths or _doublings(chunk_size // 2, max_tokens))
    say(f"prefill cost: chunks of {chunk_size} tokens up to {max_tokens} tokens ...")
    chunk_samples = await anyio.to_thread.run_sync(
        measure_chunks, backend, max_tokens, chunk_size, repeats, counted("prefill cost")
    )
    say(f"layer cost: {backend.spec.num_layers} layers over {lengths} tokens ...")
    layer_samples = await anyio.to_thread.run_sync(
        measure_layers, backend, lengths, repeats, counted("layer cost")
    )
    link_samples: list[list[float]] = []
    if store is not None:
        say(f"store: reads from {store!r} ...")
        layer_section = backend.spec.kv_bytes_per_token // backend.spec.num_layers * chunk_size
        chunk_bytes = backend.spec.kv_bytes_per_token * chunk_size
        link_samples = await measure_link(store, (4096, layer_section, chunk_bytes), repeats)
    spec = backend.spec
    return Profile(
        machine=machine_id(),
        model=spec.name,
        fingerprint=spec.fingerprint,
        dtype=dtype_name(spec.dtype),
        device=torch.device(backend.device).type,
        chunk=fit_chunk_cost(chunk_samples),
        layer=fit_layer_cost(layer_samples),
        link=fit_link(link_samples) if link_samples else None,
        store=repr(store) if store is not None else None,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        samples={"chunk": chunk_samples, "layer": layer_samples, "link": link_samples},
    )


def _doublings(lo: int, hi: int) -> list[int]:
    out, n = [], max(1, lo)
    while n <= hi:
        out.append(n)
        n *= 2
    return out
