"""What a blocking restore costs over the same restore awaited in a running loop.

    python benchmarks/sync_overhead.py                  # 1,024 tokens, tiny random Llama on the CPU
    python benchmarks/sync_overhead.py --rounds 40 --out /tmp/s.json

Three ways to run one restore (`LoadOnly` from a `MemoryStore`: a few milliseconds, so that what
surrounds the restore shows), taking turns round after round on one restorer:

* **awaited**: `await restorer.restore(...)` inside an event loop that is already running (timed
  inside the loop: what an async caller waits);
* **SyncRestorer**: `SyncRestorer.restore(...)` from a thread without a loop (timed around the call);
* **asyncio.run**: `asyncio.run(restorer.restore(...))`, a fresh loop per call, the loop's start and
  teardown included.

Each round's overhead is its blocking time less that round's awaited time; the three take turns
going first; the medians over rounds are reported. The awaited runs go through the SyncRestorer's own loop (`portal.call` of a coroutine
that times itself), so all three share one restorer, one store and one engine.

Target (issue 47): SyncRestorer within 1 ms of awaited. Writes benchmarks/results/sync_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from _common import machine_info, write_json
from _provenance import code_version
from gpu_restore import tiny_prompt

from kvrestore import LoadOnly, SyncRestorer
from kvrestore.stores.memory import MemoryStore

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_S = 0.001


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default=str(RESULTS / "sync_overhead.json"))
    args = p.parse_args()

    backend, tokens, desc = tiny_prompt(args.tokens)

    sync = SyncRestorer(backend, MemoryStore(), chunk_size=args.chunk, learn=False, profile=False)
    restorer = sync.restorer
    sync.save(tokens)

    async def awaited() -> float:
        t0 = time.perf_counter()
        await restorer.restore(tokens, LoadOnly())
        return time.perf_counter() - t0

    def blocking() -> float:
        t0 = time.perf_counter()
        sync.restore(tokens, LoadOnly())
        return time.perf_counter() - t0

    def fresh_loop() -> float:
        t0 = time.perf_counter()
        asyncio.run(restorer.restore(tokens, LoadOnly()))
        return time.perf_counter() - t0

    portal: Any = sync._loop.portal
    for _ in range(3):  # warm-up
        portal.call(awaited)
        blocking()
    rows: list[tuple[float, float, float]] = []
    for k in range(args.rounds):  # the three take turns going first, so that no order favours one
        times: dict[str, float] = {}
        order = [("awaited", lambda: portal.call(awaited)), ("sync", blocking), ("run", fresh_loop)]
        for name, run in order[k % 3 :] + order[: k % 3]:
            times[name] = run()
        rows.append((times["awaited"], times["sync"], times["run"]))
    sync.close()

    awaited_s = statistics.median(r[0] for r in rows)
    sync_over = statistics.median(r[1] - r[0] for r in rows)
    run_over = statistics.median(r[2] - r[0] for r in rows)
    print(f"{desc}, {args.tokens} tokens, LoadOnly from memory, {args.rounds} rounds (medians):")
    print(f"  awaited in a running loop   {awaited_s * 1e3:8.2f} ms")
    print(f"  SyncRestorer.restore        +{sync_over * 1e3:7.2f} ms  (target <= {TARGET_S * 1e3:g} ms)")
    print(f"  asyncio.run(restore)        +{run_over * 1e3:7.2f} ms")
    write_json(
        args.out,
        {
            "config": {"model": desc, "tokens": args.tokens, "chunk": args.chunk, "rounds": args.rounds},
            "awaited_s": awaited_s,
            "sync_overhead_s": sync_over,
            "asyncio_run_overhead_s": run_over,
            "target_sync_overhead_s": TARGET_S,
            "rounds": [{"awaited_s": a, "sync_s": s, "asyncio_run_s": r} for a, s, r in rows],
            "code": code_version(),
            "machine": machine_info(),
        },
    )


if __name__ == "__main__":
    main()
