"""How many files of kvrestore/ one restore runs code in: the size of the path a reader has to follow.

    python benchmarks/files_touched.py                 # 1,024 tokens, tiny random Llama on the CPU
    python benchmarks/files_touched.py --out /tmp/f.json

One token-wise restore (`TokenTwoPointer`) that both computes and loads: every chunk of the prompt is
saved, then the first chunk's object is deleted, so the compute lane has a chunk that only computing
can restore while the load lanes fetch the rest (the stats say how many of each ran). A warm-up restore
first takes imports and first-use set-ups out of the count, and only the `restorer.restore(tokens,
policy)` call is counted (the policy is built, and the object deleted, before it, as a caller would):
`sys.setprofile` (the thread calling `restore`) and `threading.setprofile` (every thread started after
it: lane and worker threads) record each Python function that runs, and the script counts the
distinct files under kvrestore/ they live in.
The lane threads that already run when counting starts (started by the warm-up) are counted through
`threading.setprofile_all_threads` where Python has it (3.12+), else only their new threads are seen.

Target (issue 47): at most 25 files in the restoring thread. Writes
benchmarks/results/files_touched.json.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
from _common import machine_info, write_json
from _provenance import code_version
from gpu_restore import tiny_prompt

import kvrestore
from kvrestore import Restorer, TokenTwoPointer
from kvrestore.stores.memory import MemoryStore

PACKAGE = Path(kvrestore.__file__).resolve().parent
RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 25


class FileCounter:
    """The files under kvrestore/ whose code runs while it is on, by thread (the one that started it:
    "main"; any other: "threads")."""

    def __init__(self) -> None:
        self.main: set[str] = set()
        self.threads: set[str] = set()
        self._main_id = threading.get_ident()

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(str(PACKAGE)):
            (self.main if threading.get_ident() == self._main_id else self.threads).add(path)

    def __enter__(self) -> FileCounter:
        set_all: Callable[[Any], None] | None = getattr(threading, "setprofile_all_threads", None)
        (set_all or threading.setprofile)(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        set_all: Callable[[Any], None] | None = getattr(threading, "setprofile_all_threads", None)
        (set_all or threading.setprofile)(None)  # type: ignore[arg-type]

    @staticmethod
    def relative(paths: set[str]) -> list[str]:
        return sorted(str(Path(p).resolve().relative_to(PACKAGE)) for p in paths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default=str(RESULTS / "files_touched.json"))
    args = p.parse_args()

    backend, tokens, desc = tiny_prompt(args.tokens)

    async def run() -> tuple[Any, FileCounter]:
        store = MemoryStore()
        restorer = Restorer(backend, store, chunk_size=args.chunk, learn=False, profile=False)
        await restorer.save(tokens)
        _, refs = restorer.chunks(tokens)
        first = refs[0].key

        policy = TokenTwoPointer()
        await store.delete(first)  # only computing can restore chunk 0
        await restorer.restore(tokens, policy)  # warm-up: imports and first-use set-ups
        await store.delete(first)
        with FileCounter() as counter:  # the restore call alone, not the set-up around it
            result = await restorer.restore(tokens, policy)
        await restorer.close()
        return result, counter

    result, counter = anyio.run(run)
    st = result.stats
    assert st.computed_chunks > 0 and st.loaded_chunks > 0, "the restore must both compute and load"
    main_files, thread_files = FileCounter.relative(counter.main), FileCounter.relative(counter.threads)
    every = sorted(set(main_files) | set(thread_files))
    print(f"{desc}, {args.tokens} tokens in {args.chunk}-token chunks, token-wise two-pointer:")
    print(f"  computed {st.computed_chunks} chunks, loaded {st.loaded_chunks}")
    print(f"  files of kvrestore/ run in the restoring thread: {len(main_files)} (target <= {TARGET})")
    print(f"  in any thread: {len(every)}")
    for f in main_files:
        print(f"    {f}")
    write_json(
        args.out,
        {
            "config": {
                "model": desc,
                "tokens": args.tokens,
                "chunk": args.chunk,
                "policy": "TokenTwoPointer",
            },
            "computed_chunks": st.computed_chunks,
            "loaded_chunks": st.loaded_chunks,
            "main_thread_files": len(main_files),
            "all_thread_files": len(every),
            "target_main_thread_files": TARGET,
            "main_thread": main_files,
            "other_threads": thread_files,
            "code": code_version(),
            "machine": machine_info(),
        },
    )


if __name__ == "__main__":
    main()
