"""What signed chunks cost: the keyed check's throughput per core, and restores with a secret against without.

With a secret (`Restorer(secret=...)`, `kvrestore.codec.seal`) a reader checks a keyed BLAKE2b MAC of
each chunk's header and a GMAC tag (AES-256-GCM, empty plaintext) of every section before a byte of it
is used. Measured here, in one run:

* **primitives** (`--primitives` alone, or first in every run): one core's throughput of each candidate
  over a 256 MiB buffer (xxh3-64, keyed BLAKE2b, keyed BLAKE3 where the `blake3` package is installed,
  Poly1305, GMAC, and `SectionTags.tag` as the readers call it, on a buffer and on one SmolLM2 section),
  and whether each releases the GIL: how far a pure-Python counter on another thread gets while it
  hashes, against the counter alone (a primitive that holds the GIL leaves it under ~50%).
* **restores**, interleaved round by round (medians of `--rounds`), chunks saved with and without the
  secret from the same KV, each restore checked to equal it exactly:
  * `LoadOnly` from host memory (a `MemoryStore`), where nothing hides the check (target <= 1.35x);
  * `TokenTwoPointer` over a `ThrottledStore` at 1x the balance bandwidth (the stored bytes over a
    full prefill's time, measured here), where the check overlaps computing (target <= 1.10x);
  * the header MACs alone (`Seal.check`, over 1,000 repeats) as a share of the unsigned load-only one;
  * every section's check alone (`codec.verify_sections` of every chunk: xxh3-64 unsigned, the GMAC tags
    signed; a reader with a secret checks the tag instead of the xxh3-64, not besides it).

  The signed / unsigned ratios are the median over rounds of each round's ratio (the two cases run back
  to back in a round), so that a round slowed by the machine's other load counts once, not twice.

    flock /tmp/kvrestore-cpu.lock python benchmarks/seal_cost.py     # SmolLM2 fp32, 4,096 tokens
    python benchmarks/seal_cost.py --primitives                       # the primitives only
    python benchmarks/seal_cost.py --tiny --out /tmp/s.json           # smoke test: a tiny random Llama

Prints tables and writes benchmarks/results/seal_cost.json.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash
from _common import Sample, interleave, machine_info, median, print_table, ratio, run_to_json
from _provenance import code_version
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

from kvrestore import LoadOnly, Restorer, TokenTwoPointer, codec
from kvrestore.backends.hf import HFBackend
from kvrestore.codec.header import _ENCODER
from kvrestore.codec.seal import Seal
from kvrestore.stores import MemoryStore, ThrottledStore

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


PRIMITIVE_BYTES = 256 << 20
#: one SmolLM2 fp32 section of a 256-token chunk: 2 x 3 heads x 256 tokens x 64 dims x 4 bytes
SECTION_BYTES = 2 * 3 * 256 * 64 * 4


def _gil_share(fn: Callable[[memoryview], Any], data: memoryview, calls: int = 5) -> float:
    """How far a pure-Python counter on another thread gets during one call of `fn(data)`, as a share of
    its rate alone: near 1 where `fn` releases the GIL (less on a busy machine), near 0 where it holds
    it for the call (the counter moves only while the caller waits to take the GIL back, a switch
    interval, set to 0.1 ms here)."""
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    t = threading.Thread(target=counter)
    t.start()
    try:
        c0, t0 = count[0], time.perf_counter()
        time.sleep(0.2)
        alone = (count[0] - c0) / (time.perf_counter() - t0)
        shares = []
        for _ in range(calls):
            c0, t0 = count[0], time.perf_counter()
            fn(data)
            shares.append((count[0] - c0) / (time.perf_counter() - t0) / alone)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    return median(shares)


def primitives() -> dict[str, Any]:
    """Throughput per core (GB/s, median of 5) and GIL share of each keyed candidate, on one buffer."""
    key = os.urandom(32)
    data = memoryview(bytearray(os.urandom(1 << 20)) * (PRIMITIVE_BYTES >> 20))
    section = data[:SECTION_BYTES]
    gmac = AESGCM(key)
    tags = Seal(b"benchmark secret, 32 bytes long.").sections(os.urandom(16))
    cands: dict[str, Callable[[memoryview], Any]] = {
        "xxh3-64 (not keyed)": xxhash.xxh3_64_intdigest,
        "keyed BLAKE2b": lambda d: hashlib.blake2b(d, key=key, digest_size=32).digest(),
        "Poly1305": lambda d: Poly1305.generate_tag(key, d),
        "GMAC (AES-256-GCM)": lambda d: gmac.encrypt(b"\0" * 12, b"", d),
        "SectionTags.tag (GMAC)": lambda d: tags.tag(0, d),
    }
    try:
        import blake3  # optional: not a dependency, measured where installed

        cands["keyed BLAKE3"] = lambda d: blake3.blake3(d, key=key).digest()
    except ImportError:
        log("blake3 is not installed: keyed BLAKE3 is not measured")
    out: dict[str, Any] = {}
    rows = []
    for name, fn in cands.items():
        fn(data)
        per = []
        for _ in range(5):
            t = time.perf_counter()
            fn(data)
            per.append(time.perf_counter() - t)
        reps = max(1, (256 << 20) // SECTION_BYTES)
        t = time.perf_counter()
        for _ in range(reps):
            fn(section)
        section_gbs = SECTION_BYTES * reps / (time.perf_counter() - t) / 1e9
        gbs = PRIMITIVE_BYTES / median(per) / 1e9
        share = _gil_share(fn, data)
        out[name] = {"gb_per_s": gbs, "section_gb_per_s": section_gbs, "gil_share": share}
        rows.append([name, gbs, section_gbs, share])
    print_table(
        ["primitive", "GB/s (256 MiB)", f"GB/s ({SECTION_BYTES >> 10} KiB)", "other thread's share"],
        rows,
        title="one core; a share near 1 means the GIL is released while it hashes",
    )
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "seal_cost",
        "machine": machine_info(),
        "code": code_version(),
        "primitives": primitives(),
    }
    if args.primitives:
        return result
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
    t = time.perf_counter()
    kv = (await plain.restore(tokens, LoadOnly())).kv  # computed: nothing is stored yet
    full_s = time.perf_counter() - t
    await plain.save(tokens, kv)
    await signed.save(tokens, kv)
    _, refs = plain.chunks(tokens)
    stored = [sum([len(await s.get(r.key) or b"") for r in refs]) for s in (plain_store, signed_store)]
    balance = stored[0] / full_s
    links = [ThrottledStore(s, bytes_per_s=balance) for s in (plain_store, signed_store)]
    throttled = [Restorer(backend, link, args.chunk, learn=False, profile=False) for link in links[:1]]
    throttled.append(Restorer(backend, links[1], args.chunk, learn=False, profile=False, secret=SECRET))
    log(
        f"{desc}: {args.tokens} tokens in {len(refs)} chunks of {args.chunk}; full prefill {full_s:.2f} s, "
        f"balance {balance / 1e6:.1f} MB/s; {stored[1] - stored[0]} signature bytes in {stored[0]}"
    )

    def case(r: Restorer, policy_of: Callable[[], Any], link: ThrottledStore | None = None):
        async def restore() -> Sample:
            if link is not None:
                link.reset()
            t = time.perf_counter()
            res = await r.restore(tokens, policy_of())
            seconds = time.perf_counter() - t
            assert res.stats.failed_loads == 0, res.stats
            assert torch.equal(res.kv.data, kv.data) or not isinstance(policy_of(), LoadOnly)
            if isinstance(policy_of(), LoadOnly):
                assert res.stats.loaded_chunks == len(refs), res.stats
            return Sample(seconds, {"loaded_chunks": res.stats.loaded_chunks})

        return restore

    cases = {
        "load-only, unsigned": case(plain, LoadOnly),
        "load-only, signed": case(signed, LoadOnly),
        "two-pointer@1x, unsigned": case(throttled[0], TokenTwoPointer, links[0]),
        "two-pointer@1x, signed": case(throttled[1], TokenTwoPointer, links[1]),
    }
    samples = await interleave(cases, args.rounds, warmup=1, log=log, collect=True)
    med = {name: median([s.seconds for s in got]) for name, got in samples.items()}
    # the header MACs' own cost: every chunk's header checked, as a signed restore checks it
    seal = Seal(SECRET)
    headers = [codec.read_header(await signed_store.get(r.key))[0] for r in refs]
    repeats = 1000
    t = time.perf_counter()
    for _ in range(repeats):
        for h in headers:
            seal.check(h, _ENCODER, h.num_layers)
    mac_s = (time.perf_counter() - t) / repeats
    # every section of every chunk checked once, as a restore checks them: xxh3-64 unsigned, GMAC signed
    sections_s = {}
    for name, store, sealed in (("unsigned", plain_store, None), ("signed", signed_store, seal)):
        blobs = [await store.get(r.key) for r in refs]
        heads = [codec.read_header(b)[0] for b in blobs]
        per = []
        for _ in range(5):
            t = time.perf_counter()
            for h, b in zip(heads, blobs, strict=True):
                codec.verify_sections(h, b, sealed)
            per.append(time.perf_counter() - t)
        sections_s[name] = median(per)

    def paired(kind: str) -> float:
        """The median over rounds of signed / unsigned, each pair run back to back in one round."""
        pairs = zip(samples[f"{kind}, unsigned"], samples[f"{kind}, signed"], strict=True)
        return median([ratio(s.seconds, u.seconds) for u, s in pairs])

    load_ratio, tp_ratio = paired("load-only"), paired("two-pointer@1x")
    print_table(
        ["case", "median s", "signed / unsigned (median of rounds)", "target"],
        [
            ["load-only, unsigned", med["load-only, unsigned"], 1.0, ""],
            ["load-only, signed", med["load-only, signed"], load_ratio, "<= 1.35"],
            ["two-pointer@1x, unsigned", med["two-pointer@1x, unsigned"], 1.0, ""],
            ["two-pointer@1x, signed", med["two-pointer@1x, signed"], tp_ratio, "<= 1.10"],
            [f"header MACs alone ({len(refs)})", mac_s, ratio(mac_s, med["load-only, unsigned"]), ""],
            ["section checks alone, xxh3-64", sections_s["unsigned"], 1.0, ""],
            [
                "section checks alone, GMAC",
                sections_s["signed"],
                ratio(sections_s["signed"], sections_s["unsigned"]),
                "",
            ],
        ],
        title=f"{desc}, {args.tokens} tokens ({args.rounds} rounds, interleaved)",
    )
    result.update(
        {
            "config": {
                "model": desc,
                "tokens": args.tokens,
                "chunk_size": args.chunk,
                "rounds": args.rounds,
                "tiny": args.tiny,
            },
            "chunks": len(refs),
            "full_prefill_s": full_s,
            "balance_bytes_per_s": balance,
            "stored_bytes": {"unsigned": stored[0], "signed": stored[1]},
            "seconds": {name: [s.seconds for s in got] for name, got in samples.items()},
            "median_s": med,
            # the median over rounds of each round's signed / unsigned (the pair runs back to back)
            "load_only_signed_vs_unsigned": load_ratio,
            "two_pointer_1x_signed_vs_unsigned": tp_ratio,
            "ratio_of_medians": {
                "load_only": ratio(med["load-only, signed"], med["load-only, unsigned"]),
                "two_pointer_1x": ratio(med["two-pointer@1x, signed"], med["two-pointer@1x, unsigned"]),
            },
            "section_checks_s_per_restore": sections_s,
            "targets": {"load_only": 1.35, "two_pointer_1x": 1.10, "check_gb_per_s_per_core": 3.0},
            "header_macs_s_per_restore": mac_s,
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096; --tiny 256)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 7; --tiny 1)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model: a smoke test")
    p.add_argument("--primitives", action="store_true", help="measure the primitives only")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (256 if args.tiny else 4096)
    args.chunk = min(args.chunk, 64) if args.tiny else args.chunk
    args.rounds = args.rounds or (1 if args.tiny else 5)
    args.out = args.out or (DEFAULT_OUT.with_name("seal_cost-tiny.json") if args.tiny else DEFAULT_OUT)
    return run_to_json(run, args, args.out)


if __name__ == "__main__":
    sys.exit(main())
