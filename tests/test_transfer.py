"""`Transfer` owns the staging buffers of one move and gives each back exactly once: when the move ends,
when it fails part-way, and when a caller leaves it early. Run on a CPU, where the device path of the
layer reads runs too (deferred checks) and a transfer records no event."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio import ChunkLoader, StagingPool
from kvrestore.chunkio.layers import ChunkLoadFailed, LayerReader
from kvrestore.chunkio.load import upload_checked
from kvrestore.chunkio.transfer import Transfer, TransferLane
from kvrestore.core.errors import ChunkDecodeError, CorruptChunkError
from kvrestore.core.keys import ChunkRef
from kvrestore.core.kv import KVCache, KVChunk
from kvrestore.stores import FsspecStore

from .test_chunkio import KEY, chunk_blob, make_spec


class Ledger:
    """Every buffer a `StagingPool` hands out and takes back (the real pools run as they do)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.out: Counter[int] = Counter()
        self.back: Counter[int] = Counter()
        acquire, release = StagingPool.acquire, StagingPool.release

        def acquired(pool, nbytes):
            buf = acquire(pool, nbytes)
            self.out[id(buf)] += 1
            return buf

        def released(pool, buf, busy_until=None):
            self.back[id(buf)] += 1
            assert self.back[id(buf)] <= self.out[id(buf)], "a buffer handed back that was not handed out"
            release(pool, buf, busy_until)

        monkeypatch.setattr(StagingPool, "acquire", acquired)
        monkeypatch.setattr(StagingPool, "release", released)

    def balanced(self) -> bool:
        """Each buffer handed out was handed back once per time it was handed out."""
        return bool(self.out) and self.out == self.back


def test_a_transfer_gives_each_buffer_back_once(monkeypatch):
    ledger = Ledger(monkeypatch)
    pool = StagingPool()
    with Transfer(pool) as transfer:
        early = transfer.stage(10)
        kept = transfer.copy_in(memoryview(b"some bytes"))
        assert bytes(kept.view[:10]) == b"some bytes" and transfer.held == 2
        transfer.give_back(early)
        transfer.give_back(early)  # given back already: nothing to do
        transfer.give_back(None)
        assert transfer.held == 1
    transfer.close()  # closing again gives nothing back twice
    assert transfer.held == 0 and ledger.balanced()
    with pytest.raises(RuntimeError, match="closed"):
        transfer.stage(10)
    with pytest.raises(ValueError, match="part-way"), Transfer(pool) as failing:
        failing.stage(10)
        raise ValueError("part-way")
    assert ledger.balanced() and pool.idle_bytes > 0


def test_an_upload_that_raises_gives_its_staging_back_once(monkeypatch):
    """`upload_checked` fails after its copy (a flipped byte: the checksums differ) and while queueing it
    (a destination of the wrong shape): either way its staged buffer goes back once, ready for reuse."""
    ledger = Ledger(monkeypatch)
    spec = make_spec()
    _, blob = chunk_blob(spec)
    header, _ = codec.read_header(blob)
    expected = [s.device_sum for s in header.layers]
    damaged = bytearray(blob)
    damaged[header.layers[1].offset + 3] ^= 0x10
    dest = torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 6, spec.head_dim)
    pool = StagingPool()

    def upload(data: bytes, into: torch.Tensor) -> None:
        with Transfer(pool) as transfer:
            host = transfer.copy_in(memoryview(data)).tensor
            upload_checked(host[header.layers[0].offset : header.end], into, expected, transfer)

    upload(blob, dest)
    assert torch.equal(dest, chunk_blob(spec)[0].data)
    with pytest.raises(CorruptChunkError, match="layer 1"):
        upload(bytes(damaged), dest)
    with pytest.raises(RuntimeError):  # the body does not fit: the copy fails as it is queued
        upload(blob, torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 5, spec.head_dim))
    assert ledger.balanced()
    assert len(ledger.out) == 1  # each upload reused the one buffer the first handed back


def test_every_staged_load_gives_its_buffers_back_once(tmp_path, monkeypatch):
    """A loader reading objects from a directory (staged: compressed ones; uncompressed ones through a
    staged probe), good, damaged, cut short, past their limit, or gone: every buffer goes back once."""
    ledger = Ledger(monkeypatch)
    spec = make_spec()
    _, plain = chunk_blob(spec)
    _, packed = chunk_blob(spec, compression="zstd")
    store = FsspecStore(str(tmp_path / "dir"))
    loader = ChunkLoader(spec, store)
    cache = KVCache(spec, torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 30, spec.head_dim))
    flipped = bytearray(packed)
    flipped[-5] ^= 0x01
    objects = [plain, packed, bytes(flipped), packed[:-40], packed + bytes(8 << 20), None]

    async def load_each() -> list[object]:
        outcomes: list[object] = []
        async with store:
            for blob in objects:
                await store.delete(KEY)
                if blob is not None:
                    await store.put(KEY, blob)
                try:
                    outcomes.append(await loader.load(KEY, 12, cache.chunk(12, 18).data))
                except ChunkDecodeError as exc:
                    outcomes.append(exc)
        return outcomes

    outcomes = anyio.run(load_each)
    assert outcomes[:2] == [len(plain), len(packed)]
    assert all(isinstance(o, ChunkDecodeError) for o in outcomes[2:])
    assert ledger.balanced()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_layer_read_gives_its_buffers_back_once(tmp_path, monkeypatch, compression):
    """Layer reads on the device path (deferred checks) from a directory, whose spans are staged: a good
    chunk, a damaged one and one cut short. The read fails naming the bad chunks, every buffer is back
    once, and the good chunk's layers are in place."""
    ledger = Ledger(monkeypatch)
    spec = make_spec()
    store = FsspecStore(str(tmp_path / "dir"))
    g = torch.Generator().manual_seed(3)
    kvs = [
        torch.randn(spec.num_layers, 2, spec.num_kv_heads, 6, spec.head_dim, generator=g) for _ in range(3)
    ]
    keys = [f"{j:02d}" * 16 for j in range(3)]
    blobs = [
        codec.encode_chunk(KVChunk(0, kv), spec, k, compression=compression)
        for kv, k in zip(kvs, keys, strict=True)
    ]
    header, _ = codec.read_header(blobs[1])
    damaged = bytearray(blobs[1])
    damaged[header.layers[2].offset + 1] ^= 0x20
    stored = [bytes(blobs[0]), bytes(damaged), blobs[2][: header.layers[2].offset + 4]]
    chunks = [ChunkRef(j, 0, 6, k, at=6 * j) for j, k in enumerate(keys)]
    reader = LayerReader(spec, store, chunks, lane=TransferLane(StagingPool()), defer_checks=True)
    cache = KVCache(spec, torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 18, spec.head_dim))

    async def read() -> ChunkLoadFailed:
        async with store:
            for k, blob in zip(keys, stored, strict=True):
                await store.put(k, blob)
            assert await reader.open() == [True, True, True]
            with pytest.raises(ChunkLoadFailed) as failed:
                await reader.read_layers(range(1, 3), cache)
                await reader.verify()
        return failed.value

    failed = anyio.run(read)
    assert 0 not in failed.indices and 2 in failed.indices
    assert torch.equal(cache.data[1:3, :, :, :6], kvs[0][1:3])
    assert ledger.balanced()
