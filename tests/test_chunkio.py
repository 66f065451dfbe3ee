"""The chunk data path: checksums, staging buffers, and ChunkLoader on real stores (CPU; CUDA if present)."""

from __future__ import annotations

import struct
import zlib

import anyio
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrestore import codec
from kvrestore.chunkio import ChunkLoader, StagingPool
from kvrestore.chunkio.pool import GRANULE
from kvrestore.codec.checksums import device_checksums, segment_checksums, weights
from kvrestore.core.errors import (
    ChunkDecodeError,
    CorruptChunkError,
    ForeignChunkError,
    FormatVersionError,
    MissingChunkError,
)
from kvrestore.core.kv import KVCache
from kvrestore.core.spec import ModelSpec
from kvrestore.stores import FsspecStore, MemoryStore, ThrottledStore, TieredStore

KEY = "0123456789abcdef" * 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_spec(dtype=torch.float32, layers=3, heads=2, dim=8) -> ModelSpec:
    return ModelSpec("tiny", layers, heads, dim, 100, dtype, "ab" * 16)


def reference_sums(t: torch.Tensor) -> list[int]:
    """Device checksums computed with numpy's unsigned (defined-wrap) arithmetic, as signed ints."""
    words = t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1).view(np.uint64)
    w = weights(words.shape[1]).numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        sums = (words * w).sum(axis=1, dtype=np.uint64)
    return [int(x) for x in sums.view(np.int64)]


def test_weights_are_heads_of_one_cached_tensor():
    """Any length is the head of the longest made so far: one tensor per device, not one per length."""
    with np.errstate(over="ignore"):
        idx = np.arange(1000, dtype=np.uint64)
        want = ((idx * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)) | np.uint64(1)).view(
            np.int64
        )
    short = weights(5)
    long = weights(1000)
    assert np.array_equal(short.numpy(), want[:5]) and np.array_equal(long.numpy(), want)
    assert weights(7).data_ptr() == long.data_ptr() and weights(7).numel() == 7  # the head of the longer


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    tokens=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_device_checksums_match_unsigned_arithmetic_and_views(layers, tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    cache = (torch.randn(layers, 2, 2, tokens + 5, 8, generator=g) * 1e4).to(dtype)
    chunk = cache[:, :, :, 2 : 2 + tokens]  # a token slice of a cache: strided
    want = reference_sums(chunk)
    assert device_checksums(chunk).tolist() == want
    assert device_checksums(chunk.contiguous()).tolist() == want
    for device in DEVICES[1:]:
        assert device_checksums(cache.to(device)[:, :, :, 2 : 2 + tokens]).tolist() == want


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_segment_checksums_equal_each_sections_own(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    sections = [torch.randint(-(2**62), 2**62, (n,), generator=g) * 3 for n in lengths]  # products wrap
    want = [int(device_checksums(t[None])[0]) for t in sections]
    for device in DEVICES:
        assert segment_checksums(torch.cat(sections).to(device), lengths).tolist() == want


def test_device_checksum_sees_any_changed_word():
    t = torch.randn(2, 2, 2, 4, 8)
    base = device_checksums(t)
    words = t.view(torch.int64).view(-1)
    for i in range(0, words.numel(), 7):
        changed = t.clone()
        changed.view(torch.int64).view(-1)[i] ^= 1 << (i % 64)
        layer = i // (words.numel() // 2)
        assert device_checksums(changed)[layer] != base[layer]


def test_staging_pool_reuses_buffers():
    pool = StagingPool()
    a = pool.acquire(10)
    assert a.nbytes >= 10 and len(a.view) == a.nbytes
    pool.release(a)
    b = pool.acquire(100)
    assert b is a and pool.allocated == 1
    c = pool.acquire(5 << 20)  # larger than any free buffer: a new one
    assert c is not a and c.nbytes >= 5 << 20 and pool.allocated == 2
    pool.release(b)
    with pytest.raises(RuntimeError, match="twice"):  # two readers would share it
        pool.release(a)
    pool.release(c)
    assert pool.idle_bytes == a.nbytes + c.nbytes
    pool.close()  # the memory goes back: nothing is kept
    assert pool.idle_bytes == 0 and pool.acquire(10) is not a


def test_staging_pool_gives_back_what_is_past_its_working_size():
    pool = StagingPool(max_idle_bytes=4 * GRANULE)
    small = [pool.acquire(10) for _ in range(3)]
    big = pool.acquire(8 * GRANULE)  # an outsized buffer: dropped on release, the small ones kept
    for b in [*small, big]:
        pool.release(b)
    assert pool.idle_bytes == 3 * GRANULE and all(any(x is b for x in pool._free) for b in small)


class _Event:
    """A CUDA event's completion, set by hand."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_an_upload_event_is_reused_only_once_it_guards_no_free_buffer():
    pool = StagingPool(max_idle=2)
    a, b, c = pool.acquire(10), pool.acquire(10), pool.acquire(10)
    shared = _Event(done=True)  # one upload read both a and b
    pool.release(a, busy_until=shared)
    pool.release(b, busy_until=shared)
    assert pool.acquire(10) is a and pool._events == []  # b still waits on it
    assert pool.acquire(10) is b and pool._events == [shared]  # now it guards nothing
    pending = _Event(done=False)
    pool.release(a)
    pool.release(b)
    pool.release(c, busy_until=pending)  # the pool is full: c is dropped
    assert pool._events == [shared]  # a pending event is not handed out to be recorded again


@pytest.mark.parametrize("where", ["file", "throttled-file"])  # read in a lane thread, and by the loop
def test_an_object_longer_than_its_chunk_can_be_is_a_miss_never_staged(tmp_path, where, monkeypatch):
    """An object under a chunk's key longer than any encoding of that chunk (header room plus zstd's
    worst case per layer): a CorruptChunkError (a miss), no buffer larger than that limit is ever asked
    for, and the free buffers are each free once."""
    spec = make_spec()
    _, blob = chunk_blob(spec, compression="zstd")
    acquire = StagingPool.acquire
    asked: list[int] = []
    pools: list[StagingPool] = []

    def recorded(self, nbytes):
        pools.append(self)
        asked.append(nbytes)
        return acquire(self, nbytes)

    monkeypatch.setattr(StagingPool, "acquire", recorded)
    store = stores(tmp_path)[where]()
    err, _, _ = load_into(spec, store, blob + bytes(8 * GRANULE))
    assert isinstance(err, CorruptChunkError) and "more than this chunk can take" in str(err)
    assert asked and max(asked) < 2 * GRANULE  # the chunk's limit, never the object's 8 MiB
    for pool in set(pools):
        assert len({id(b) for b in pool._free}) == len(pool._free)


# -- ChunkLoader -----------------------------------------------------------------------------------


def chunk_blob(spec: ModelSpec, n_tokens: int = 6, start: int = 12, compression: str = "none", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim, generator=g)
    from kvrestore.core.kv import KVChunk

    kv = KVChunk(start, data.to(spec.dtype))
    return kv, codec.encode_chunk(kv, spec, KEY, compression=compression)


def stores(tmp_path):
    return {
        "memory": lambda: MemoryStore(),
        "pinned-memory": lambda: MemoryStore(pinned=True),
        "file": lambda: FsspecStore(str(tmp_path / "dir")),
        "throttled-file": lambda: ThrottledStore(FsspecStore(str(tmp_path / "t")), bytes_per_s=1e9),
        "tiered": lambda: TieredStore([MemoryStore(), FsspecStore(str(tmp_path / "tier"))]),
    }


def load_into(spec, store, blob, device="cpu", n_tokens=6, start=12, fill=7.0, put=True):
    """Put `blob` (unless `put` is False) and load it into a cache filled with `fill`; (result, cache)."""
    cache = KVCache(
        spec,
        torch.full((spec.num_layers, 2, spec.num_kv_heads, 30, spec.head_dim), fill)
        .to(spec.dtype)
        .to(device),
    )
    loader = ChunkLoader(spec, store)

    async def body():
        async with store:
            if put:
                await store.put(KEY, blob)
            return await loader.load(KEY, start, cache.chunk(start, start + n_tokens).data)

    try:
        return anyio.run(body), cache, loader
    except ChunkDecodeError as exc:
        return exc, cache, loader


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["memory", "file", "throttled-file", "tiered", "pinned-memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_loads_exactly_into_the_token_range(tmp_path, device, where, dtype, compression):
    if where == "pinned-memory" and device != "cuda":
        pytest.skip("page-locked memory needs CUDA")
    spec = make_spec(dtype)
    kv, blob = chunk_blob(spec, compression=compression)
    nbytes, cache, _ = load_into(spec, stores(tmp_path)[where](), blob, device)
    assert nbytes == len(blob)
    got = cache.data.cpu()
    assert torch.equal(got[:, :, :, 12:18], kv.data)
    assert (got[:, :, :, :12] == 7).all() and (got[:, :, :, 18:] == 7).all()  # nothing else touched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["memory", "file", "pinned-memory"])
def test_every_damaged_byte_is_refused(tmp_path, device, where):
    if where == "pinned-memory" and device != "cuda":
        pytest.skip("page-locked memory needs CUDA")
    spec = make_spec()
    _, blob = chunk_blob(spec)
    header, _ = codec.read_header(blob)
    body = header.layers[0].offset
    # the prefix, the header, the padding, and bytes of the first, a middle and the last section
    for pos in [0, 5, 12, 30, body - 1, body, body + 100, len(blob) // 2, len(blob) - 1]:
        bad = bytearray(blob)
        bad[pos] ^= 0x40
        got, cache, _ = load_into(spec, stores(tmp_path)[where](), bytes(bad), device)
        assert isinstance(got, ChunkDecodeError), pos
        data = cache.data.cpu()
        assert (data[:, :, :, :12] == 7).all() and (data[:, :, :, 18:] == 7).all()  # only its own rows
        if device == "cpu":  # verified before the copy: the cache is untouched
            assert (data == 7).all()


@pytest.mark.parametrize("where", ["memory", "file"])
def test_truncated_overlong_foreign_and_missing(tmp_path, where):
    spec = make_spec()
    _, blob = chunk_blob(spec)
    got, _, _ = load_into(spec, stores(tmp_path)[where](), blob[:-1])
    assert isinstance(got, ChunkDecodeError) and "bytes" in str(got)
    # longer than the staging buffer the loader sized from the chunk: read again whole, then refused
    got, _, _ = load_into(spec, stores(tmp_path)[where](), blob + bytes(200_000))
    assert isinstance(got, CorruptChunkError)
    assert "past the last section" in str(got) or "more than this chunk can take" in str(got)
    other = make_spec(torch.float16)
    _, foreign = chunk_blob(other)
    got, _, _ = load_into(spec, stores(tmp_path)[where](), foreign)
    assert isinstance(got, ForeignChunkError)
    got, _, _ = load_into(spec, stores(tmp_path / "empty")[where](), blob, put=False)
    assert isinstance(got, MissingChunkError)


def older_format(blob: bytes) -> bytes:
    """The same chunk with its header's version set to the previous format (checksums still valid)."""
    header, end = codec.read_header(blob)
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(header), "version": codec.PLAIN_VERSION - 1})
    return struct.pack("<4sII", codec.MAGIC, len(raw), zlib.crc32(raw)) + raw + blob[end:]


def test_an_older_format_chunk_is_a_clean_miss(tmp_path):
    spec = make_spec()
    _, blob = chunk_blob(spec)
    got, cache, _ = load_into(spec, FsspecStore(str(tmp_path)), older_format(blob))
    assert isinstance(got, FormatVersionError) and "version" in str(got)
    assert (cache.data == 7).all()


def test_lanes_share_a_warm_staging_pool(tmp_path):
    spec = make_spec(layers=4, heads=2, dim=16)
    store = FsspecStore(str(tmp_path))
    cache = KVCache.empty(spec, 8 * 32)
    loader = ChunkLoader(spec, store)
    chunks = []

    async def one(i, limiter):
        async with limiter:
            await loader.load(f"{i:032x}", 32 * i, cache.chunk(32 * i, 32 * i + 32).data)

    async def body():
        async with store:
            for i in range(8):
                kv, _ = chunk_blob(spec, n_tokens=32, start=32 * i, seed=i)
                await store.put(f"{i:032x}", codec.encode_chunk(kv, spec, f"{i:032x}"))
                chunks.append(kv)
            limiter = anyio.CapacityLimiter(4)
            for _ in range(5):  # five restores' worth, four lanes at a time
                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(one, i, limiter)

    anyio.run(body)
    for i, kv in enumerate(chunks):
        assert torch.equal(cache.data[:, :, :, 32 * i : 32 * i + 32], kv.data)
    assert loader.pool(False).allocated <= 4  # never more buffers than lanes at once


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_pinned_memory_store_needs_cuda():
    from kvrestore.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="needs CUDA"):
        MemoryStore(pinned=True)
