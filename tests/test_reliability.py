"""The reliability suite: hostile scenarios end to end, each produced for real, none may give a wrong KV
cache, lose an acknowledged write or hang. (Single faults are in test_store_faults.py; wrapper stacks
and capacity in test_store_guarantees.py; cancellation's bound in test_cancel.py.)

* the S3 server killed at random moments of restores;
* concurrent restores over chunks corrupted in every way;
* restores cancelled at random deadlines while others run on the same engine;
* a full disk: a 2 MB tmpfs, where this machine lets a test mount one.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import anyio
import pytest
import torch

from kvrestore import ComputeOnly, LoadOnly, Restorer, TokenTwoPointer, open_store
from kvrestore.core.keys import chunk_keys
from kvrestore.stores import MemoryStore

from .conftest import random_tokens

pytest.importorskip("s3fs")
ATOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent


def run(fn, *args):
    return anyio.run(partial(fn, *args))


def test_s3_server_killed_at_random_moments_every_restore_exact(llama_backend):
    from .s3_server import MotoServer

    b = llama_backend
    tokens = random_tokens(256, b.spec.vocab_size, seed=60)
    ref = b.prefill_chunk(tokens, None, 0).data
    rng = random.Random(60)
    outcomes = []
    for trial in range(4):
        with MotoServer() as server:
            url = f"s3://{server.make_bucket()}/kv"

            async def main(server=server, url=url, trial=trial):
                async with Restorer(b, open_store(url, **server.options()), chunk_size=32) as w:
                    await w.save(tokens)
                r = Restorer(b, open_store(url, **server.options()), chunk_size=32, load_timeout_s=10)
                kill_after = rng.randint(0, 6)  # events into the restore: before, during or after loads
                seen = [0]

                def maybe_kill(event):
                    seen[0] += 1
                    if seen[0] > kill_after and server.proc is not None:
                        server.stop()

                policy = [LoadOnly(), TokenTwoPointer()][trial % 2]
                with anyio.fail_after(60):
                    res = await r.restore(tokens, policy, on_event=maybe_kill)
                await r.close()
                return res

            res = run(main)
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)
        outcomes.append((res.stats.loaded_chunks, res.stats.computed_chunks))
    assert all(loaded + computed == 8 for loaded, computed in outcomes)


def _damage(blob: bytes, how: int) -> bytes:
    if how == 0:
        return blob[: len(blob) // 2]  # truncated
    if how == 1:
        b = bytearray(blob)
        b[-7] ^= 0x10  # a flipped bit in a section
        return bytes(b)
    if how == 2:
        return blob + b"\0" * 9  # bytes past the last section
    return b"not a chunk at all" * 10  # garbage


@pytest.mark.parametrize("where", ["memory", "file"])
def test_concurrent_restores_over_corrupted_chunks_are_all_exact(llama_backend, tmp_path, where):
    b = llama_backend
    tokens = random_tokens(320, b.spec.vocab_size, seed=61)
    ref = b.prefill_chunk(tokens, None, 0).data
    keys = [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)]

    async def main():
        store = MemoryStore() if where == "memory" else open_store(f"file://{tmp_path}")
        r = Restorer(b, store, chunk_size=32, load_lanes=3)
        await r.save(tokens)
        for how, k in enumerate(keys[1:10:2]):  # five chunks, four kinds of damage
            await store.put(k, _damage(await store.get(k), how % 4))
        results = []

        async def one(i: int) -> None:
            policy = [LoadOnly(), TokenTwoPointer(), ComputeOnly()][i % 3]
            results.append(await r.restore(tokens, policy))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
        return results, [await store.get(k) for k in keys[1:10:2]]

    results, left = run(main)
    assert len(results) == 20
    for res in results:
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)
    assert all(blob is None for blob in left)  # damaged objects are deleted, never served again


def test_restores_cancelled_at_random_deadlines_leave_the_engine_sound(llama_backend):
    b = llama_backend
    tokens = random_tokens(512, b.spec.vocab_size, seed=62)
    ref = b.prefill_chunk(tokens, None, 0).data
    rng = random.Random(62)

    async def main():
        store = MemoryStore()
        r = Restorer(b, store, chunk_size=32, load_lanes=2)
        await r.save(tokens)
        for k in [c.key for c in chunk_keys(tokens, b.spec.fingerprint, 32)][::3]:
            await store.delete(k)  # a third of the chunks must be computed
        finished = []

        async def one(i: int) -> None:
            policy = [LoadOnly(), TokenTwoPointer(), ComputeOnly()][i % 3]
            with anyio.move_on_after(rng.uniform(0.0, 0.05)):
                await r.restore(tokens, policy)
            finished.append(await r.restore(tokens, policy))  # the same engine, right after

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
        return finished

    finished = run(main)
    assert len(finished) == 20
    for res in finished:
        torch.testing.assert_close(res.kv.data, ref, atol=ATOL, rtol=0)


# -- a full disk -----------------------------------------------------------------------------------

FULL_DISK = textwrap.dedent(
    """
    import sys, anyio, torch
    sys.path.insert(0, {root!r})
    from kvrestore import Restorer, StoreError, open_store, LoadOnly
    from kvrestore.backends.hf import HFBackend
    from tests.conftest import tiny_model, random_tokens

    b = HFBackend(tiny_model("llama", layers=3), name="tiny-llama")
    tokens = random_tokens(4096, b.spec.vocab_size, seed=63)  # 3 MB of KV for a 2 MB disk

    async def main():
        r = Restorer(b, open_store("file://" + {disk!r}), chunk_size=256)
        try:
            await r.save(tokens)
        except StoreError as exc:
            print("save refused:", type(exc).__name__, str(exc)[:200])  # a StoreError subclass
        else:
            raise SystemExit("save of 3 MB onto a 2 MB disk reported no error")
        res = await r.restore(tokens, LoadOnly())
        full = b.prefill_chunk(tokens, None, 0).data
        assert torch.allclose(res.kv.data, full, atol=1e-5, rtol=0), "restore not exact"
        print("restore exact:", res.stats.loaded_chunks, "loaded,", res.stats.computed_chunks, "computed")

    anyio.run(main)
    """
)


def _tmpfs_command(disk: Path, script: str) -> list[str] | None:
    """How to run `script` with `disk` a fresh 2 MB tmpfs: as root directly, else in a user namespace."""
    mount = f'mount -t tmpfs -o size=2m tmpfs {disk} && {sys.executable} -c "$0"'
    if os.geteuid() == 0:
        probe = subprocess.run(["sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {disk} && umount {disk}"])
        if probe.returncode == 0:
            return ["sh", "-c", f"{mount}; rc=$?; umount {disk}; exit $rc", script]
    if shutil.which("unshare"):
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {disk}"])
        if probe.returncode == 0:
            return ["unshare", "-rm", "sh", "-c", mount, script]
    return None


@pytest.mark.slow
def test_full_disk_save_is_one_store_error_and_restores_stay_exact(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = FULL_DISK.format(root=str(ROOT), disk=str(disk))
    cmd = _tmpfs_command(disk, script)
    if cmd is None:
        pytest.skip("cannot mount a tmpfs here (neither root nor user namespaces)")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "save refused:" in proc.stdout and "could not be written" in proc.stdout, proc.stdout
    assert "restore exact" in proc.stdout
