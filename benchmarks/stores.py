"""Stores: how fast does a restore load from S3, Redis, Mooncake's store, a disk, memory and a tiered store?

On SmolLM2-135M (fp32) KV of one prompt (default 2048 tokens, 256-token chunks of 11.8 MB each), stored in
a real S3-compatible server (`moto_server` on 127.0.0.1, started here), a local directory and memory:

* **load** (interleaved A B C ... every round): `restore(policy=LoadOnly(), out=kv)` from each store, in
  bytes/s (stats.bytes_loaded / stats.seconds), against **raw s3fs reads of the same objects**
  (`S3FileSystem._cat_file`, as many at once as the restorer has load lanes). Target:
  load-only-s3 / raw-s3fs >= 0.70. Also: S3 behind the read-ahead buffer (PrefetchStore), a tiered store
  whose memory tier is warm, and one whose upper tiers start cold (every chunk comes from S3 and is
  promoted into memory and disk while it is loaded).
* **hit latency**: `get` of a 4 KB object and of one chunk object, and `contains` of 16 keys, on each
  tier (memory / disk / S3 / Redis / Mooncake); throughput = chunk bytes / chunk get latency.
* **per-chunk reads**: `read_into` of each chunk in turn into a staging buffer (what a load lane does),
  p50 and p99 over every read, on each store side by side; for Mooncake also its client's own `get`
  (bytes, then copied) and `get_into` straight into the caller's unregistered buffer, against the store's
  read into a registered buffer and one copy out (is the registered read worth its copy?).
* **fleet stores**: load-only from Redis over load-only from the local directory (target >= 0.5 at
  1,024 tokens: `--tokens 1024`); Redis is `redis-server` and Mooncake its master, metadata server and
  one storage node, all started here on 127.0.0.1 (tests/redis_server.py, tests/mooncake_server.py).

The S3 server runs on this machine's loopback, so "S3" here means the S3 protocol stack (HTTP, signing,
botocore, aiohttp, moto's Python server on the same 2 CPUs), not a network: the ratio to raw s3fs is the
meaningful number, the absolute MB/s is not a prediction for a real bucket.

    python benchmarks/stores.py                 # 2048 tokens (8 chunks, twice the load lanes), 5 rounds
    python benchmarks/stores.py --quick         # 512 tokens, 2 rounds: a smoke test
    python benchmarks/stores.py --tokens 1024 --out benchmarks/results/stores-fleet.json   # the fleet target
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import torch
from _common import Sample, interleave, machine_info, median, print_table, ratio, summarize, write_json

from kvrestore import ComputeOnly, KVCache, LoadOnly, Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.stores import ChunkStore, MemoryStore, PrefetchStore, TieredStore
from kvrestore.tools.text import reference_tokens

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test servers: tests/redis_server.py, tests/mooncake_server.py
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "stores.json"
CHUNK_SIZE = 256
LOAD_LANES = 4
MB = 1e6
TARGETS = {"load_only_s3_over_raw_s3fs_min": 0.70, "load_only_redis_over_disk_min": 0.50}
#: per-chunk reads of each store: a p99 needs many
READ_TIERS = ("memory", "disk", "s3", "redis", "mooncake")
NOTES = [
    "ratios are ratios of medians taken within this run; every raw timing is in the JSON",
    "raw-s3fs = S3FileSystem._cat_file of the very chunk objects the restore loads, "
    f"{LOAD_LANES} at a time (the restorer's load lanes): bytes only, nothing decoded or checked",
    "load-only-* = Restorer.restore(LoadOnly(), out=reused KVCache): fetch, checksum every layer, place",
    "S3 is moto_server on 127.0.0.1 sharing the CPUs with the client: compare ratios, not absolute MB/s",
    "redis = redis-server 7 on 127.0.0.1 (no persistence), redis-py asyncio + hiredis; mooncake = "
    "mooncake_master + its HTTP metadata server + one mooncake_client lending 1 GB, TCP transport on "
    "127.0.0.1: both share the 2 CPUs with the client",
    "read-* = ChunkStore.read_into of one chunk into a reused buffer, every chunk in turn: p50/p99 "
    "over all reads; mooncake-get = the client's get() (bytes) then one copy into the buffer; "
    "mooncake-get_into-direct = get_into straight into the unregistered buffer (no copy, but a read "
    "abandoned at a deadline would write into a buffer handed on: the store does not do it)",
    "tiered-cold = a new TieredStore([memory, disk, s3]) per run with empty upper tiers: loads from S3 "
    "and promotes every chunk upwards in the background (the promotion finishing is not timed)",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Moto:
    """moto_server on 127.0.0.1, a free port."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(300):
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto_server did not start")

    def options(self) -> dict[str, Any]:
        return {
            "key": "bench",
            "secret": "bench",
            "endpoint_url": self.endpoint,
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import s3fs

    from tests.mooncake_server import MooncakeServer
    from tests.redis_server import RedisServer

    moto = Moto()
    tmp = tempfile.mkdtemp(prefix="kvrestore-bench-stores-")
    redis_server = RedisServer().start()
    mooncake_server = MooncakeServer(segment_size="1GB").start()
    try:
        backend = HFBackend.from_smollm2(dtype=torch.float32)
        tokens = reference_tokens(backend.tokenizer, args.tokens)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **moto.options())
        await fs.set_session()
        await fs._mkdir(bucket)
        s3_url = f"s3://{bucket}/kv"

        log(f"computing the KV of {len(tokens)} tokens once")
        computed = await Restorer(backend, MemoryStore(), CHUNK_SIZE).restore(tokens, ComputeOnly())
        kv = computed.kv
        memory = MemoryStore()
        disk = open_store(f"file://{tmp}/disk")
        s3 = open_store(s3_url, **moto.options())
        redis = open_store(redis_server.url)
        mooncake = open_store(mooncake_server.url, **mooncake_server.options())
        tiers = {"memory": memory, "disk": disk, "s3": s3, "redis": redis, "mooncake": mooncake}
        for store in tiers.values():
            await Restorer(backend, store, CHUNK_SIZE).save(tokens, kv)
        _, refs = Restorer(backend, memory, CHUNK_SIZE).chunks(tokens)
        paths = [s3.path(r.key) for r in refs]
        warm = TieredStore(
            [MemoryStore(), open_store(f"file://{tmp}/warm"), open_store(s3_url, **moto.options())]
        )
        await Restorer(backend, warm, CHUNK_SIZE).restore(tokens, LoadOnly())  # fills its memory tier
        await warm.flush()
        prefetch = PrefetchStore(open_store(s3_url, **moto.options()), depth=LOAD_LANES)
        reused = KVCache.empty(backend.spec, len(tokens))
        reused.data.zero_()

        async def raw_s3fs() -> Sample:
            sem = asyncio.Semaphore(LOAD_LANES)

            async def one(p: str) -> int:
                async with sem:
                    return len(await fs._cat_file(p))

            t0 = time.perf_counter()
            nbytes = sum(await asyncio.gather(*(one(p) for p in paths)))
            return Sample(time.perf_counter() - t0, {"bytes": nbytes})

        def load_only(store_fn: Any, fresh: bool = False) -> Any:
            async def case() -> Sample:
                store = store_fn()
                r = Restorer(backend, store, CHUNK_SIZE, load_lanes=LOAD_LANES)
                res = await r.restore(tokens, LoadOnly(), out=reused)
                if fresh:  # a store made for this run only
                    await store.close()
                st = res.stats
                if st.loaded_chunks != st.n_chunks or st.failed_loads:
                    raise RuntimeError(f"LoadOnly fell back to compute: {st}")
                if not torch.equal(res.kv.data, kv.data):
                    raise RuntimeError("restored KV differs from the saved KV")
                return Sample(st.seconds, {"bytes": st.bytes_loaded})

            return case

        cold_dirs: list[str] = []

        def cold() -> ChunkStore:
            d = f"{tmp}/cold-{len(cold_dirs)}"
            cold_dirs.append(d)
            return TieredStore([MemoryStore(), open_store(d), open_store(s3_url, **moto.options())])

        log(f"load group: {args.rounds} rounds + 1 warm-up")
        load = await interleave(
            {
                "raw-s3fs": raw_s3fs,
                "load-only-s3": load_only(lambda: s3),
                "load-only-s3-prefetch": load_only(lambda: prefetch),
                "load-only-redis": load_only(lambda: redis),
                "load-only-mooncake": load_only(lambda: mooncake),
                "load-only-tiered-cold": load_only(cold, fresh=True),
                "load-only-tiered-warm": load_only(lambda: warm),
                "load-only-disk": load_only(lambda: disk),
                "load-only-memory": load_only(lambda: memory),
            },
            args.rounds,
            log=log,
        )

        # -- hit latency per tier --
        small_key = "f" * 40
        small = os.urandom(4096)
        for store in tiers.values():
            await store.put(small_key, small)
        probe = [r.key for r in refs] + [f"{i:040x}" for i in range(16 - len(refs))]

        def hit(store: ChunkStore, what: str) -> Any:
            async def case() -> Sample:
                t0 = time.perf_counter()
                if what == "small":
                    got = await store.get(small_key)
                    n = len(got or b"")
                elif what == "chunk":
                    got = await store.get(refs[0].key)
                    n = len(got or b"")
                else:
                    await store.contains(probe)
                    n = 0
                return Sample(time.perf_counter() - t0, {"bytes": n})

            return case

        cases = {
            f"{tier}-{what}": hit(store, what)
            for what in ("small", "chunk", "contains16")
            for tier, store in tiers.items()
        }
        log(f"latency group: {args.rounds * args.io_repeats} rounds + 1 warm-up")
        latency = await interleave(cases, args.rounds * args.io_repeats)

        # -- per-chunk reads: every chunk in turn, into one reused buffer --
        biggest = max([len(await memory.get(r.key) or b"") for r in refs])
        buffer = memoryview(bytearray(biggest + (1 << 20)))
        turn = {"i": 0}

        def next_key() -> str:
            turn["i"] += 1
            return refs[turn["i"] % len(refs)].key

        def read(store: ChunkStore) -> Any:
            async def case() -> Sample:
                key = next_key()
                t0 = time.perf_counter()
                n = await store.read_into(key, buffer)
                return Sample(time.perf_counter() - t0, {"bytes": n or 0})

            return case

        mc_client = mooncake._ready_client()  # the store's own client, for its raw calls
        import numpy as np

        direct = np.frombuffer(buffer, np.uint8)

        def mooncake_raw(how: str) -> Any:
            async def case() -> Sample:
                name = mooncake.object_key(next_key())

                def call() -> int:
                    if how == "get":
                        data = mc_client.get(name)
                        np.copyto(direct[: len(data)], np.frombuffer(data, np.uint8))
                        return len(data)
                    return int(mc_client.get_into(name, direct.ctypes.data, len(direct)))

                t0 = time.perf_counter()
                n = await asyncio.to_thread(call)
                return Sample(time.perf_counter() - t0, {"bytes": n})

            return case

        read_cases = {f"read-{t}": read(tiers[t]) for t in READ_TIERS}
        read_cases["mooncake-get"] = mooncake_raw("get")
        read_cases["mooncake-get_into-direct"] = mooncake_raw("get_into")
        n_reads = args.rounds * args.io_repeats * len(refs)
        log(f"per-chunk read group: {n_reads} reads per case + 1 warm-up")
        reads = await interleave(read_cases, n_reads)
        for store in (disk, s3, warm, prefetch, redis, mooncake):
            await store.close()
        await fs._s3.close()  # the raw client
    finally:
        moto.stop()
        redis_server.stop()
        mooncake_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def mbps(samples: list[Sample]) -> float:
        return median([s.extra["bytes"] / s.seconds / MB for s in samples])

    raw_mbps = mbps(load["raw-s3fs"])
    load_rows = {
        name: {
            "median_s": median([s.seconds for s in ss]),
            "MB_per_s": mbps(ss),
            "over_raw_s3fs": ratio(mbps(ss), raw_mbps),
        }
        for name, ss in load.items()
    }
    chunk_bytes = len(await memory.get(refs[0].key) or b"")
    lat_rows = {}
    for tier in tiers:
        small_s = median([s.seconds for s in latency[f"{tier}-small"]])
        chunk_s = median([s.seconds for s in latency[f"{tier}-chunk"]])
        lat_rows[tier] = {
            "get_4KB_ms": small_s * 1e3,
            "get_chunk_ms": chunk_s * 1e3,
            "chunk_MB_per_s": chunk_bytes / chunk_s / MB,
            "contains16_ms": median([s.seconds for s in latency[f"{tier}-contains16"]]) * 1e3,
        }

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    read_rows = {}
    for name, ss in reads.items():
        secs = [s.seconds for s in ss]
        read_rows[name] = {
            "p50_ms": pct(secs, 0.5) * 1e3,
            "p99_ms": pct(secs, 0.99) * 1e3,
            "MB_per_s": sum(s.extra["bytes"] for s in ss) / sum(secs) / MB,
            "reads": len(ss),
        }
    headline = load_rows["load-only-s3"]["over_raw_s3fs"]
    redis_over_disk = ratio(load_rows["load-only-redis"]["MB_per_s"], load_rows["load-only-disk"]["MB_per_s"])
    mooncake_over_disk = ratio(
        load_rows["load-only-mooncake"]["MB_per_s"], load_rows["load-only-disk"]["MB_per_s"]
    )
    print_table(
        ["case", "median s", "MB/s", "/ raw-s3fs"],
        [[k, v["median_s"], v["MB_per_s"], v["over_raw_s3fs"]] for k, v in load_rows.items()],
        title=f"\nLoadOnly restore of {len(tokens)} tokens ({len(refs)} chunks, {chunk_bytes / MB:.1f} MB each)",
    )
    print_table(
        ["tier", "get 4 KB ms", "get chunk ms", "chunk MB/s", "contains(16) ms"],
        [
            [t, r["get_4KB_ms"], r["get_chunk_ms"], r["chunk_MB_per_s"], r["contains16_ms"]]
            for t, r in lat_rows.items()
        ],
        title="\nhit latency per tier (medians)",
    )
    print_table(
        ["read", "p50 ms", "p99 ms", "MB/s", "reads"],
        [[k, r["p50_ms"], r["p99_ms"], r["MB_per_s"], r["reads"]] for k, r in read_rows.items()],
        title="\nper-chunk read_into latency, every chunk in turn",
    )
    ok = headline >= TARGETS["load_only_s3_over_raw_s3fs_min"]
    redis_ok = redis_over_disk >= TARGETS["load_only_redis_over_disk_min"]
    print(f"\nload-only-s3 / raw-s3fs = {headline:.2f} (target >= 0.70): {'PASS' if ok else 'FAIL'}")
    print(
        f"load-only-redis / load-only-disk = {redis_over_disk:.2f} (target >= 0.50 at 1,024 tokens; "
        f"{len(tokens)} here): {'PASS' if redis_ok else 'FAIL'}; mooncake / disk = {mooncake_over_disk:.2f}"
    )
    return {
        "benchmark": "stores",
        "machine": machine_info(),
        "config": {
            "tokens": len(tokens),
            "chunk_size": CHUNK_SIZE,
            "load_lanes": LOAD_LANES,
            "rounds": args.rounds,
            "io_repeats": args.io_repeats,
            "chunk_bytes": chunk_bytes,
        },
        "targets": TARGETS,
        "results": {
            "load": load_rows,
            "latency": lat_rows,
            "reads": read_rows,
            "load_only_s3_over_raw_s3fs": headline,
            "load_only_redis_over_disk": redis_over_disk,
            "load_only_mooncake_over_disk": mooncake_over_disk,
            "pass": ok,
            "redis_pass": redis_ok,
        },
        "raw": {
            "load": {k: summarize(v) for k, v in load.items()},
            "latency": {k: summarize(v) for k, v in latency.items()},
            "reads": {k: summarize(v) for k, v in reads.items()},
        },
        "notes": NOTES,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--io-repeats", type=int, default=4, help="latency rounds = rounds x io-repeats")
    p.add_argument("--quick", action="store_true", help="512 tokens, 2 rounds")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    if args.quick:
        args.tokens, args.rounds, args.io_repeats = 512, 2, 2
    result = asyncio.run(run(args))
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
