"""What naming a model by every weight costs: SmolLM2-135M's fingerprint, cold and warm.

    python benchmarks/fingerprint.py                    # 5 rounds
    python benchmarks/fingerprint.py --rounds 9 --out /tmp/f.json

Four cases take turns in every round, on the bundled SmolLM2-135M-Instruct checkpoint (fp32 safetensors):

* **checkpoint, cold**: `of_checkpoint` with an empty digest cache (what `HFBackend.from_pretrained` and
  the vLLM connector pay the first time): every weight file read and hashed with xxh3-128;
* **checkpoint, warm**: the same with the digests cached (every later start): a `stat` per file;
* **tensors**: `of_tensors` over the loaded model's parameters and buffers (`HFBackend(model)`);
* **xxh3 alone**: xxh3-128 over the weight files' bytes already in memory (the hash's own rate).

The files are in the page cache after the warm-up, so "cold" is the digest cache's cold start, not the
disk's: a first read from disk runs at the disk's speed if that is lower. An 8B model's estimate is its
16 GB (bf16) at the cold rate measured here. Writes benchmarks/results/fingerprint.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from _common import machine_info, write_json
from _provenance import code_version

from kvrestore.backends.checkpoints import smollm2_checkpoint
from kvrestore.core import fingerprint
from kvrestore.core.fingerprint import WEIGHT_SUFFIXES, of_checkpoint, of_tensors

RESULTS = Path(__file__).resolve().parent / "results"
BYTES_8B = 16e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "fingerprint.json"))
    args = p.parse_args()

    path = smollm2_checkpoint()
    files = sorted(f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES)
    n_bytes = sum(f.stat().st_size for f in files)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    tensor_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    config = model.config.to_dict()
    contents = [f.read_bytes() for f in files]
    fingerprint.RACY_S = -1.0  # the checkpoint may have just been converted: let the warm cache hold it
    warm_dir = Path(tempfile.mkdtemp(prefix="kvrestore-fp-warm-"))
    of_checkpoint(path, torch.float32, warm_dir)  # warm-up: page cache, and the warm case's digests

    def cold() -> float:
        with tempfile.TemporaryDirectory(prefix="kvrestore-fp-cold-") as d:
            t0 = time.perf_counter()
            of_checkpoint(path, torch.float32, d)
            return time.perf_counter() - t0

    def warm() -> float:
        t0 = time.perf_counter()
        of_checkpoint(path, torch.float32, warm_dir)
        return time.perf_counter() - t0

    def in_memory() -> float:
        t0 = time.perf_counter()
        of_tensors(config, tensors, torch.float32)
        return time.perf_counter() - t0

    def hash_only() -> float:
        t0 = time.perf_counter()
        for c in contents:
            xxhash.xxh3_128_digest(c)
        return time.perf_counter() - t0

    cases = {"checkpoint_cold": cold, "checkpoint_warm": warm, "tensors": in_memory, "xxh3_alone": hash_only}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for k in range(args.rounds):  # each case goes first in turn
        for name in names[k % len(names) :] + names[: k % len(names)]:
            samples[name].append(cases[name]())
    med = {name: statistics.median(xs) for name, xs in samples.items()}
    rate = {
        "checkpoint_cold": n_bytes / med["checkpoint_cold"],
        "tensors": tensor_bytes / med["tensors"],
        "xxh3_alone": n_bytes / med["xxh3_alone"],
    }
    estimate_8b = BYTES_8B / rate["checkpoint_cold"]
    print(
        f"SmolLM2-135M-Instruct fp32: {len(files)} weight file(s), {n_bytes / 1e6:.0f} MB; {args.rounds} rounds"
    )
    print(
        f"  checkpoint, cold cache   {med['checkpoint_cold'] * 1e3:9.1f} ms  {rate['checkpoint_cold'] / 1e9:5.2f} GB/s"
    )
    print(f"  checkpoint, warm cache   {med['checkpoint_warm'] * 1e3:9.2f} ms")
    print(f"  tensors in memory        {med['tensors'] * 1e3:9.1f} ms  {rate['tensors'] / 1e9:5.2f} GB/s")
    print(
        f"  xxh3-128 alone           {med['xxh3_alone'] * 1e3:9.1f} ms  {rate['xxh3_alone'] / 1e9:5.2f} GB/s"
    )
    print(
        f"  8B model (16 GB) cold:   {estimate_8b:9.1f} s at the cold rate (page cache; a disk may be slower)"
    )
    write_json(
        args.out,
        {
            "config": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "rounds": args.rounds},
            "weight_files": len(files),
            "weight_bytes": n_bytes,
            "tensor_bytes": tensor_bytes,
            "median_s": med,
            "bytes_per_s": rate,
            "estimate_8b_16gb_cold_s": estimate_8b,
            "rounds": samples,
            "code": code_version(),
            "machine": machine_info(),
        },
    )


if __name__ == "__main__":
    main()
