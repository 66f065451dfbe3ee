"""What signed chunks cost a restore: a load-only restore from host memory with a secret against one without.

With a secret (`Restorer(secret=...)`, `kvrestore.codec.seal`) a reader checks a keyed BLAKE2b MAC of
each chunk's header before it uses the chunk; the sections are bound through the checksums the header
holds, so the MAC never reads the KV a second time. Measured here, in one run, interleaved round by
round (medians of `--rounds`):

* **unsigned**: chunks saved without a secret, restored by a restorer without one (today's path);
* **signed**: chunks saved with a secret, restored by a restorer with it (every MAC checked);
* **MAC alone**: the checks of every chunk's header on their own (`Seal.check`, timed over 1,000
  repeats), as a share of the unsigned restore: the cost the MAC adds, free of the restore's noise.

Both restores load every chunk from a `MemoryStore` (`LoadOnly`) and must equal the saved KV exactly.
Target (issue 45): the MAC's cost <= 3% of a load-only restore from host memory at 4,096 tokens.

    flock /tmp/kvrestore-cpu.lock python benchmarks/seal_cost.py     # SmolLM2 fp32, 4,096 tokens
    python benchmarks/seal_cost.py --tiny --out /tmp/s.json          # smoke test: a tiny random Llama

Prints a table and writes benchmarks/results/seal_cost.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import Sample, interleave, machine_info, median, print_table, ratio, run_to_json
from _provenance import code_version

from kvrestore import LoadOnly, Restorer, codec
from kvrestore.backends.hf import HFBackend
from kvrestore.codec.header import _ENCODER
from kvrestore.codec.seal import Seal
from kvrestore.stores import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "seal_cost.json"
SECRET = b"benchmark secret, 32 bytes long."


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_backend(tiny: bool, n_tokens: int) -> tuple[HFBackend, str, list[int] | None]:
    if tiny:
        sys.path.insert(0, str(ROOT))
        from tests.conftest import tiny_model

        return (
            HFBackend(tiny_model("llama", layers=4), name="tiny-llama"),
            "tiny random Llama (4 layers)",
            None,
        )
    from kvrestore.tools.text import reference_tokens

    backend = HFBackend.from_smollm2(dtype=torch.float32)
    return backend, "SmolLM2-135M-Instruct (fp32)", reference_tokens(backend.tokenizer, n_tokens)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backend, desc, text = load_backend(args.tiny, args.tokens)
    if text is not None:
        tokens = torch.tensor(text[: args.tokens])
    else:
        tokens = torch.randint(
            0, backend.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
        )
    plain_store, signed_store = MemoryStore(), MemoryStore()
    plain = Restorer(backend, plain_store, args.chunk, learn=False, profile=False)
    signed = Restorer(backend, signed_store, args.chunk, learn=False, profile=False, secret=SECRET)
    kv = (await plain.restore(tokens, LoadOnly())).kv  # computed: nothing is stored yet
    await plain.save(tokens, kv)
    await signed.save(tokens, kv)
    _, refs = plain.chunks(tokens)
    log(f"{desc}: {args.tokens} tokens in {len(refs)} chunks of {args.chunk}; load-only from host memory")

    def case(r: Restorer):
        async def restore() -> Sample:
            t = time.perf_counter()
            res = await r.restore(tokens, LoadOnly())
            seconds = time.perf_counter() - t
            assert res.stats.loaded_chunks == len(refs), res.stats
            assert torch.equal(res.kv.data, kv.data), "a restore differs from the saved KV"
            return Sample(seconds)

        return restore

    samples = await interleave(
        {"unsigned": case(plain), "signed": case(signed)}, args.rounds, warmup=1, log=log, collect=True
    )
    # the MAC's own cost: every chunk's header checked, as a signed restore checks it
    seal = Seal(SECRET)
    headers = [codec.read_header(await signed_store.get(r.key))[0] for r in refs]
    repeats = 1000
    t = time.perf_counter()
    for _ in range(repeats):
        for h in headers:
            seal.check(h, _ENCODER)
    mac_s = (time.perf_counter() - t) / repeats
    unsigned_s, signed_s = (
        median([s.seconds for s in samples["unsigned"]]),
        median([s.seconds for s in samples["signed"]]),
    )
    mac_share = ratio(mac_s, unsigned_s)
    print_table(
        ["case", "median s", "vs unsigned"],
        [
            ["unsigned (no secret)", unsigned_s, 1.0],
            ["signed (MAC checked)", signed_s, ratio(signed_s, unsigned_s)],
            [f"MAC alone ({len(refs)} headers)", mac_s, mac_share],
        ],
        title=f"{desc}, {args.tokens} tokens, load-only from host memory ({args.rounds} rounds)",
    )
    log(f"MAC share of a load-only restore: {mac_share:.3%} (target <= 3%)")
    return {
        "benchmark": "seal_cost",
        "config": {
            "model": desc,
            "tokens": args.tokens,
            "chunk_size": args.chunk,
            "rounds": args.rounds,
            "tiny": args.tiny,
        },
        "machine": machine_info(),
        "code": code_version(),
        "chunks": len(refs),
        "unsigned_s": [s.seconds for s in samples["unsigned"]],
        "signed_s": [s.seconds for s in samples["signed"]],
        "unsigned_median_s": unsigned_s,
        "signed_median_s": signed_s,
        "signed_vs_unsigned": ratio(signed_s, unsigned_s),
        "mac_s_per_restore": mac_s,
        "mac_share": mac_share,
        "target_mac_share": 0.03,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096; --tiny 256)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 7; --tiny 1)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model: a smoke test")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (256 if args.tiny else 4096)
    args.chunk = min(args.chunk, 64) if args.tiny else args.chunk
    args.rounds = args.rounds or (1 if args.tiny else 7)
    args.out = args.out or (DEFAULT_OUT.with_name("seal_cost-tiny.json") if args.tiny else DEFAULT_OUT)
    return run_to_json(run, args, args.out)


if __name__ == "__main__":
    sys.exit(main())
