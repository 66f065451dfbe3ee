"""The vLLM connector's vLLM-free parts: paged layouts, the split, config, learned costs, background I/O.

The connector itself runs against a real vLLM engine in `tests_vllm/` (`make test-vllm`); nothing here
imports vLLM.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

from kvrestore import codec
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import SectionPages
from kvrestore.chunkio.pages import blocks_of
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.codec.quant import key_space
from kvrestore.core.errors import InvalidInputError, KVRestoreError, StoreError
from kvrestore.core.keys import ChunkRef, chunk_keys
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread as IOThread
from kvrestore.costs.compute import ChunkCost
from kvrestore.costs.learned import CostLearner, fit_prefill_steps
from kvrestore.integrations.vllm.config import (
    ConnectorConfig,
    ConnectorContext,
    check_shared_memory,
    preflight,
)
from kvrestore.integrations.vllm.layouts import LAYOUTS, kv_views
from kvrestore.integrations.vllm.stats import log_through
from kvrestore.policies import LoadOnly
from kvrestore.restorer import SyncRestorer
from kvrestore.stores import MemoryStore

from .conftest import tiny_model
from .paged import gather_chunk, gather_tokens, scatter_tokens

H, D, BS, NB = 2, 4, 8, 10


def _paged(layout: str, nb: int = NB, bs: int = BS) -> torch.Tensor:
    """A zeroed paged layer in `layout`; the cuda one physically NHD ([B, N, H, C]) so that its logical
    [B, H, N, C] view is not contiguous, as FlashAttention's is."""
    if layout == "cpu":
        return torch.zeros(nb, H, bs, 2 * D)
    if layout == "cuda":
        return torch.zeros(nb, bs, H, 2 * D).permute(0, 2, 1, 3)
    shape = {
        "flash_attn": (2, nb, bs, H, D),
        "flashinfer_nhd": (nb, 2, bs, H, D),
        "flashinfer_hnd": (nb, 2, H, bs, D),
    }[layout]
    return torch.zeros(shape)


def _slot(cache: torch.Tensor, layout: str, kv: int, block: int, head: int, off: int) -> torch.Tensor:
    """The [D] vector of K (kv=0) or V (kv=1) of one token slot, read the way the backend reads it."""
    if layout == "cpu":  # cpu_attn.py's view and split, then cpu_attn_vec.hpp's reshape_and_cache
        nb, _, bs, _ = cache.shape
        key_cache, value_cache = cache.view(nb, H, bs * 2, -1).chunk(2, dim=2)
        if kv == 0:  # "Write Key as column-major": element d of token `off` at d * block_size + off
            return key_cache[block, head].reshape(-1)[off::bs][:D]
        return value_cache[block, head, off]
    if layout == "cuda":  # flash_attn.py: kv_cache.transpose(1, 2).split(head_size, dim=-1)
        key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
        return (key_cache, value_cache)[kv][block, off, head]
    if layout == "flash_attn":
        return cache[kv, block, off, head]
    if layout == "flashinfer_nhd":
        return cache[block, kv, off, head]
    return cache[block, kv, head, off]


def _scattered(layout: str, blocks: list[int], start: int, data: torch.Tensor) -> torch.Tensor:
    """A zeroed paged layer with `data` scattered as tokens [start, ...), checked slot by slot the way
    the backend reads it, and checked to hold nothing else."""
    cache = _paged(layout)
    n = data.shape[2]
    scatter_tokens(cache, layout, blocks, start, data, H, D)
    for t in range(n):
        pos = start + t
        for kv in (0, 1):
            for h in range(H):
                got = _slot(cache, layout, kv, blocks[pos // BS], h, pos % BS)
                assert torch.equal(got, data[kv, h, t])
    for kv in (0, 1):  # nothing else was written: every other slot is still zero
        written = sum(
            int((_slot(cache, layout, kv, b, 0, o) != 0).any()) for b in range(NB) for o in range(BS)
        )
        assert written == n
    assert torch.equal(gather_tokens(cache, layout, blocks, start, start + n, H, D), data)
    return cache


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_puts_each_token_where_the_backend_reads_it_and_gather_reads_it_back(layout):
    blocks = [7, 2, 5]  # a request's pages, out of order
    start, n = 3, 17  # tokens [3, 20): spans all three pages
    data = torch.randn(2, H, n, D)
    cache = _scattered(layout, blocks, start, data)
    assert torch.equal(gather_tokens(cache, layout, blocks, 8, 16, H, D), data[:, :, 5:13])
    # every layer at once: each layer's tokens, whatever pages and offsets the range starts and ends in
    other = _paged(layout)
    scatter_tokens(other, layout, blocks, start, -data, H, D)
    for a, b in [(3, 20), (8, 16), (9, 9), (0, 24), (16, 24)]:
        both = gather_chunk([cache, other], layout, blocks, a, b, H, D)
        assert torch.equal(both[0], gather_tokens(cache, layout, blocks, a, b, H, D))
        assert torch.equal(both[1], gather_tokens(other, layout, blocks, a, b, H, D))
        lo, hi = max(a, start), min(b, start + n)
        if lo < hi:
            assert torch.equal(both[1][:, :, lo - a : hi - a], -data[:, :, lo - start : hi - start])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("start, n", [(0, 24), (8, 16), (0, 8)])
def test_whole_pages_are_scattered_where_the_backend_reads_them(layout, start, n):
    """A range on page boundaries goes in one indexed copy per K and V: the same slots, nothing else."""
    _scattered(layout, [7, 2, 5], start, torch.randn(2, H, n, D))


def test_layout_errors_are_clear():
    with pytest.raises(InvalidInputError, match="a cuda vLLM layer"):
        kv_views(torch.zeros(NB, H, BS, D), "cuda", H, D)  # C must be 2 * D
    with pytest.raises(InvalidInputError, match="contiguous"):
        kv_views(_paged("cuda"), "cpu", H, D)
    with pytest.raises(InvalidInputError, match="unknown paged layout"):
        kv_views(_paged("cpu"), "nhd", H, D)
    with pytest.raises(InvalidInputError, match="need 3 blocks"):
        gather_tokens(_paged("cpu"), "cpu", [0, 1], 0, 17, H, D)
    with pytest.raises(InvalidInputError, match="data must be"):
        scatter_tokens(_paged("cpu"), "cpu", [0], 0, torch.zeros(2, H, 4, D + 1), H, D)
    assert blocks_of([4, 9, 1, 3], 8, 17, BS) == [9, 1]
    assert blocks_of([4, 9], 5, 5, BS) == []


# -- the split -------------------------------------------------------------------------------------


def test_compute_cost_is_learned_from_steps():
    assert fit_prefill_steps([]) is None
    assert fit_prefill_steps([[1, 2000, 0.2]]) is None  # decode steps alone say nothing about prefill
    one = fit_prefill_steps([[2000, 0, 6.0], [1, 2000, 0.2]])
    assert one.fixed_s == pytest.approx(0.2) and one.seconds(2000) == pytest.approx(6.0)
    true = ChunkCost.per_pair(0.05, 2e-3, 1e-6)
    samples = [
        [n, p, true.seconds(n, p)] for n, p in [(2000, 0), (512, 1024), (256, 3000), (1, 2000), (4000, 0)]
    ]
    fit = fit_prefill_steps(samples)
    assert fit.seconds(300, 1700) == pytest.approx(true.seconds(300, 1700), rel=1e-3)


def test_compute_cost_is_learned_from_passes_of_several_requests(tmp_path):
    """A busy engine rarely computes one request alone: a step of several is one forward pass, a sample
    of their tokens and attention pairs together, and fits the same cost a request alone would. A
    pass of decode steps alone is not kept; a pass of one request is a step."""
    true = ChunkCost.per_pair(0.05, 2e-3, 1e-6)

    def pass_s(requests):  # one fixed cost per pass, the tokens and pairs of every request
        return true.fixed_s + sum(true.seconds(n, p) - true.fixed_s for n, p in requests)

    book = CostLearner(SPEC, path=tmp_path / "c.json")
    for requests in ([(1024, 0), (1024, 0)], [(1800, 0), (248, 1800)], [(600, 1200), (1, 900), (1, 40)]):
        book.observe_pass(requests, pass_s(requests))
    assert book.state.steps == [] and len(book.state.passes) == 3
    n, pairs, _ = book.state.passes[1]
    assert n == 2048 and pairs == 1800 * 900 + 248 * (1800 + 124)
    book.observe_pass([(1, 2000), (1, 100)], 0.06)  # decodes alone
    assert len(book.state.passes) == 3
    fit = book.step_cost()
    assert fit is not None and fit.seconds(300, 1700) == pytest.approx(true.seconds(300, 1700), rel=1e-3)
    book.observe_pass([(500, 0)], 1.0)
    assert book.state.steps == [[500.0, 0.0, 1.0]] and book.step_cost() is not fit
    book.flush()
    again = CostLearner(SPEC, path=tmp_path / "c.json")
    assert again.state.passes == book.state.passes
    state = json.loads((tmp_path / "c.json").read_text())
    state["passes"][0][1] = -5.0  # out of bounds: the file is a hint not taken
    (tmp_path / "c.json").write_text(json.dumps(state))
    assert CostLearner(SPEC, path=tmp_path / "c.json").state.passes == []


def test_engine_fits_are_made_once_per_sample_that_changes_them(tmp_path):
    """The scheduler asks `step_cost` and `loading_factor` for every request it schedules: the fits are
    kept until a step, a loading step or a re-read file changes what they are fitted from."""
    book = CostLearner(SPEC, path=tmp_path / "c.json")
    book.observe_step(2000, 0, 6.0)
    first = book.step_cost()
    assert first is book.step_cost()  # the same fit, not refitted
    book.observe_loading(1000, 1000, 2.0, 4.0, SPEC.num_layers)
    factor = book.loading_factor()
    assert factor is not None and book.step_cost() is first  # a loading step leaves the step fit alone
    book.observe_loading(1000, 1000, 2.0, 8.0, SPEC.num_layers)
    assert book.loading_factor() > factor
    book.observe_step(2000, 0, 12.0)
    assert book.step_cost() is not first and book.step_cost().seconds(2000) > first.seconds(2000)
    book.flush()
    other = CostLearner(SPEC, path=tmp_path / "c.json")  # the scheduler's process, fitted from the file
    before = other.step_cost().seconds(2000)
    book.observe_step(2000, 0, 30.0)  # the worker learns more and writes it
    book.flush()
    other._mtime = 0.0  # the file is re-read whatever its timestamp's resolution
    assert other.refresh() and other.step_cost().seconds(2000) > before
    assert other.step_cost().seconds(2000) == pytest.approx(book.step_cost().seconds(2000))


def test_cost_book_persists_across_processes(tmp_path):
    book = CostLearner(SPEC, path=tmp_path / "c.json")
    book.observe_step(2000, 0, 6.0)
    book.observe_load("file:///kv", 90_000_000, 3.0)
    book.flush()  # the book writes on a thread of its own: this waits for the file
    again = CostLearner(SPEC, path=tmp_path / "c.json")  # another process reading the same file
    assert again.state.steps == [[2000.0, 0.0, 6.0]]
    assert again.link_cost("file:///kv").bytes_per_s == pytest.approx(3e7)
    assert again.link_cost("s3://other") is None
    for i in range(40):
        book.observe_step(1000 + i, 0, 1.0)
    assert len(book.state.steps) == CostLearner.MAX_PREFILLS
    (tmp_path / "c.json").write_text('{"compute": [[2000, 0, 6.0]]}')  # another format: a hint not taken
    assert CostLearner(SPEC, path=tmp_path / "c.json").step_cost() is None


def test_config_is_checked():
    cfg = ConnectorConfig.from_extra({"store_url": "/tmp/kv", "chunk_size": 128, "split": "load_all"})
    assert cfg.chunk_size == 128 and cfg.split == "load_all" and cfg.compression == "none"
    assert cfg.batch is True  # CacheFlow's batch rule, unless turned off
    assert ConnectorConfig.from_extra({"store_url": "/x", "batch": False}).batch is False
    for bad, match in [
        ({"store_url": "/x", "batch": "no"}, "batch must be True or False"),
        ({}, "store_url"),
        ({"store_url": "/x", "chunk": 3}, "unknown kv_connector_extra_config keys"),
        ({"store_url": "/x", "chunk_size": 0}, "chunk_size"),
        ({"store_url": "/x", "compression": "lz4"}, "compression"),
        ({"store_url": "/x", "split": "half"}, "split"),
        ({"store_url": "/x", "lookup_timeout_s": -1}, "lookup_timeout_s"),
        ({"store_url": "/x", "on_load_error": "ignore"}, "on_load_error"),
        ({"store_url": "/x", "kv_encoding": "int3"}, "kv_encoding"),
        ({"store_url": "/x", "host_link_bytes_per_s": 0}, "host_link_bytes_per_s"),
        ({"store_url": "/x", "host_link_bytes_per_s": "1e9"}, "host_link_bytes_per_s"),
    ]:
        with pytest.raises(InvalidInputError, match=match):
            ConnectorConfig.from_extra(bad)


# -- background I/O --------------------------------------------------------------------------------

SPEC = ModelSpec(
    "tiny",
    num_layers=3,
    num_kv_heads=H,
    head_dim=D,
    vocab_size=100,
    dtype=torch.float32,
    fingerprint="ab" * 16,
)


@pytest.fixture
def io():
    t = IOThread()
    yield t
    t.close()


def _stored_prompt(store: MemoryStore, io: IOThread, n: int = 40, chunk: int = 16, key_tile: int = 0):
    """A prompt's chunks saved through a ChunkSaver (keys in tiles of `key_tile` tokens where whole:
    `codec.layout`); returns (chunks, its full KV [L, 2, H, n, D])."""
    kv = torch.randn(SPEC.num_layers, 2, H, n, D)
    refs = chunk_keys(list(range(n)), SPEC.fingerprint, chunk)
    saver = ChunkSaver(SPEC, store, io, key_tile=key_tile)
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10)
    assert saver.written == len(refs) and saver.dropped == 0 and saver.pending_bytes == 0
    return refs, kv


class _Handed:
    """Page writes (`page_dest.Writes`) that hand each layer's pieces to `place(layer, pieces)`."""

    queues = False

    def __init__(self, place) -> None:
        self.put = place

    def flush(self, layer: int) -> None:
        pass


def _sections(place) -> SectionPages:
    """The host path's destination, each layer's pieces handed to `place(layer, pieces)`."""
    return SectionPages(_Handed(place))  # type: ignore[arg-type]


def _joined(placed: dict[int, torch.Tensor]):
    """A `place` that keeps each layer's pieces joined into one [2, H, T, D] tensor."""

    def place(layer: int, pieces) -> None:
        assert [p.start for p in pieces] == [0, *(p.start + p.n_tokens for p in pieces[:-1])]
        placed[layer] = torch.cat([p.kv() for p in pieces], dim=2)

    return place


def _load(store, io, chunks, k, timeout=10.0):
    placed: dict[int, torch.Tensor] = {}
    load = LayerLoad(SPEC, store, chunks, k, _sections(_joined(placed)))
    load.start(io, timeout)
    for layer in range(SPEC.num_layers):
        assert load.wait(layer)
    load.future.result(timeout=10)
    return load, placed


@pytest.mark.parametrize("key_tile", [0, 8])
def test_a_layer_load_places_every_layer_of_the_prefix(io, key_tile):
    store = MemoryStore()
    chunks, kv = _stored_prompt(store, io, key_tile=key_tile)
    load, placed = _load(store, io, chunks, 24)  # ends inside the second chunk
    assert not load.failed and load.failed_ranges() == []
    assert sorted(placed) == [0, 1, 2]
    for layer in range(3):
        assert torch.equal(placed[layer], kv[layer, :, :, :24])
    assert load.bytes_read > 24 * SPEC.kv_bytes_per_token and load.seconds > 0


def test_compressed_chunks_load_the_same_kv(io):
    """zstd sections are decoded into tensors of their own (uncompressed ones are views of the bytes)."""
    store = MemoryStore()
    kv = torch.randn(SPEC.num_layers, 2, H, 40, D)
    refs = chunk_keys(list(range(40)), SPEC.fingerprint, 16)
    saver = ChunkSaver(SPEC, store, io, compression="zstd")
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10)
    load, placed = _load(store, io, refs, 40)
    assert not load.failed
    for layer in range(SPEC.num_layers):
        assert torch.equal(placed[layer], kv[layer])


@pytest.mark.parametrize("encoding", ["int8", "fp8", "int4"])
def test_encoded_chunks_are_saved_and_decoded_into_the_pages(io, encoding):
    """The connector's saver writes chunks in its kv_encoding under that encoding's key space (as a
    Restorer keys them); a load decodes each into vLLM's CPU pages exactly as the codec decodes it,
    reading fewer bytes than native chunks hold; a reader of another encoding finds them foreign."""
    n, chunk, k = 40, 16, 36
    kv = torch.randn(SPEC.num_layers, 2, H, n, D)
    refs = chunk_keys(list(range(n)), key_space(SPEC.fingerprint, encoding), chunk)
    assert refs[0].key != chunk_keys(list(range(n)), SPEC.fingerprint, chunk)[0].key
    store = MemoryStore()
    saver = ChunkSaver(SPEC, store, io, encoding=encoding)
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10) and saver.written == len(refs)
    enc = codec.spec_encoding(SPEC, encoding)
    want = torch.empty_like(kv)  # what the codec decodes, chunk by chunk
    for r in refs:
        enc.decode(enc.encode(kv[:, :, :, r.start : r.end]), want[:, :, :, r.start : r.end])

    ids = list(range(NB))[::-1]
    pages = [_paged("cpu") for _ in range(SPEC.num_layers)]

    def place(layer: int, pieces) -> None:
        for p in pieces:
            scatter_tokens(pages[layer], "cpu", ids, p.start, p.kv(), H, D)

    chunks = refs
    load = LayerLoad(SPEC, store, chunks, k, _sections(place), encoding=encoding)
    load.start(io, 10)
    for layer in range(SPEC.num_layers):
        assert load.wait(layer)
    assert not load.failed
    for layer in range(SPEC.num_layers):
        got = gather_tokens(pages[layer], "cpu", ids, 0, k, H, D)
        assert torch.equal(got, want[layer, :, :, :k])
    assert load.bytes_read < n * SPEC.kv_bytes_per_token  # every chunk read whole, smaller than native
    if encoding == "int8":  # half a step of one scale per token and head, the scale rounded to bf16
        step = kv.abs().amax(-1, keepdim=True) / 127
        assert ((want - kv).abs() <= 0.51 * step * 1.01).all()

    native = LayerLoad(SPEC, store, chunks[:1], 16, _sections(lambda layer, pieces: None))
    native.start(io, 10)
    assert not native.wait(0) or native.failed == {0}
    assert "encoding" in " ".join(native.errors)


def test_fp8_pages_are_stored_as_they_are_and_requantized_only_for_other_scales():
    """An fp8 cache's values go into fp8 sections untouched, with the layer's scales; loaded into pages of
    the same scales they come back as they were, into pages of other scales they are decoded and
    quantized with those (an int8 chunk likewise)."""
    from kvrestore.chunkio.page_dest import Piece
    from kvrestore.chunkio.pages import fp8_layer_scales, fp8_sections, fp8_values

    enc = codec.spec_encoding(SPEC, "fp8")
    values = torch.randn(SPEC.num_layers, 2, H, 12, D).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = fp8_layer_scales([(0.5, 2.0)] * SPEC.num_layers)
    sections = fp8_sections(values, scales, enc)
    kv = torch.empty(SPEC.num_layers, 2, H, 12, D)
    enc.decode(sections, kv)
    assert torch.equal(
        kv, values.view(torch.float8_e4m3fn).float() * torch.tensor([0.5, 2.0]).view(2, 1, 1, 1)
    )
    piece = Piece(0, 10, sections[1], enc, 12)
    assert torch.equal(fp8_values(piece, scales[1], torch.device("cpu")), values[1, :, :, :10])
    other = fp8_layer_scales([(1.0, 1.0)])[0]
    want = kv[1, :, :, :10].to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(fp8_values(piece, other, torch.device("cpu")), want)
    int8 = codec.spec_encoding(SPEC, "int8")
    as_int8 = Piece(0, 10, int8.encode(kv)[1], int8, 12)
    assert fp8_values(as_int8, other, torch.device("cpu")).shape == (2, H, 10, D)
    with pytest.raises(InvalidInputError, match="fp8"):
        fp8_sections(values, scales, int8)


def test_a_damaged_or_missing_chunk_fails_its_tokens_only(io):
    store = MemoryStore()
    chunks, kv = _stored_prompt(store, io)
    blob = bytearray(io.call(store.get, chunks[1].key))
    blob[-5] ^= 0xFF  # a flipped bit in the last layer's section
    io.call(store.put, chunks[1].key, bytes(blob))
    load, placed = _load(store, io, chunks[:2], 32)
    assert load.failed == {1} and load.failed_ranges() == [(16, 32)]
    assert torch.equal(placed[0][:, :, :16], kv[0, :, :, :16])
    io.call(store.delete, chunks[0].key)
    load, _ = _load(store, io, chunks[:2], 32)
    assert load.failed == {0, 1}


def test_a_foreign_chunk_is_a_failure(io):
    store = MemoryStore()
    chunks, _ = _stored_prompt(store, io)
    other = ModelSpec("tiny", 3, H, D, 100, torch.float32, fingerprint="cd" * 16)
    # the right key, another model's chunk under it
    io.call(
        store.put,
        chunks[0].key,
        codec.encode_chunk(KVChunk(0, torch.zeros(3, 2, H, 16, D)), other, chunks[0].key),
    )
    load, _ = _load(store, io, chunks[:1], 16)
    assert load.failed == {0} and "fingerprint" in " ".join(load.errors).lower()


class _DownStore(MemoryStore):
    async def get_range(self, key, start, end):
        raise StoreError("connection refused")

    async def get(self, key):
        raise StoreError("connection refused")


def test_a_store_that_is_down_fails_the_load_without_hanging(io):
    load, placed = _load(_DownStore(), io, [ChunkRef(0, 0, 16, "ab" * 20)], 16)
    assert load.failed == {0} and placed == {}


class _StuckStore(MemoryStore):
    """Answers headers, then never delivers a section (a link that stalls)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    async def get_range(self, key, start, end):
        import anyio

        if start > 0:
            while not self.release.is_set():
                await anyio.sleep(0.01)
        return await super().get_range(key, start, end)


def test_a_stalled_load_is_given_up_at_its_deadline_and_writes_nothing_after(io):
    release = threading.Event()
    store = _StuckStore(release)
    chunks, _ = _stored_prompt(store, io)
    placed: list[int] = []
    load = LayerLoad(SPEC, store, chunks, 32, _sections(lambda layer, pieces: placed.append(layer)))
    load.start(io, timeout=0.3)
    assert not load.wait(0)  # the deadline passes
    assert load.cancelled and load.failed == {0, 1}  # every chunk that holds tokens [0, 32)
    release.set()
    load.cancel("again")  # idempotent
    with pytest.raises(BaseException):  # noqa: B017 - cancelled
        load.future.result(timeout=5)
    assert placed == []


def test_the_save_queue_is_bounded_and_counts_drops(io):
    store = MemoryStore()
    saver = ChunkSaver(SPEC, store, io, max_bytes=SPEC.kv_bytes_per_token * 20)
    refs = chunk_keys(list(range(48)), SPEC.fingerprint, 16)
    gate = threading.Event()
    orig = store.put

    async def slow_put(key, data):
        import anyio

        while not gate.is_set():
            await anyio.sleep(0.01)
        await orig(key, data)

    store.put = slow_put
    results = [saver.submit(r.key, KVChunk(r.start, torch.zeros(3, 2, H, 16, D))) for r in refs]
    assert results == [True, False, False] and saver.dropped == 2
    gate.set()
    assert saver.flush(timeout=10)
    assert saver.written == 1 and io.call(store.contains, [r.key for r in refs]) == [True, False, False]
    # room is taken before a chunk is copied out, and given back if the copy fails
    one = SPEC.kv_bytes_per_token * 16
    assert saver.reserve(refs[1].key, one) and not saver.reserve(refs[2].key, one)
    assert saver.dropped == 3 and saver.pending_bytes == one
    saver.unreserve(one)
    assert saver.pending_bytes == 0 and saver.reserve(refs[2].key, one)
    saver.submit_reserved(refs[2].key, KVChunk(refs[2].start, torch.zeros(3, 2, H, 16, D)), one)
    assert saver.flush(timeout=10) and saver.written == 2 and saver.pending_bytes == 0
    # the room given back is the room reserved, also for a chunk smaller than it (an fp8 cache's
    # chunk is reserved at the model dtype's size)
    assert saver.reserve(refs[1].key, one)
    saver.submit_reserved(refs[1].key, KVChunk(refs[1].start, torch.zeros(3, 2, H, 8, D)), one)
    assert saver.flush(timeout=10) and saver.pending_bytes == 0


def test_chunks_saved_the_connector_way_are_a_restorers_and_back(io):
    """The connector's keys and wire format are the Restorer's: a Restorer loads what the connector's
    saver wrote (from KV in the model's own layout), and a LayerLoad reads what a Restorer saved."""
    from kvrestore.backends.hf import HFBackend

    backend = HFBackend(tiny_model("llama"), name="tiny-llama")
    spec = backend.spec
    tokens = list(range(3, 43))
    store = MemoryStore()
    with SyncRestorer(backend, store, chunk_size=16) as restorer:
        full = restorer.restore(tokens).kv  # computed
        saver = ChunkSaver(spec, store, io)
        for r in chunk_keys(tokens, spec.fingerprint, 16):
            saver.submit(r.key, KVChunk(r.start, full.data[:, :, :, r.start : r.end].clone()))
        assert saver.flush(timeout=10)
        res = restorer.restore(tokens, policy=LoadOnly())
        assert res.stats.loaded_chunks == 3 and res.stats.computed_chunks == 0
        assert torch.equal(res.kv.data, full.data)

    store2 = MemoryStore()
    with SyncRestorer(backend, store2, chunk_size=16) as restorer:
        restorer.save(tokens)
    refs = chunk_keys(tokens, spec.fingerprint, 16)
    placed: dict[int, torch.Tensor] = {}
    load = LayerLoad(spec, store2, refs, 32, _sections(_joined(placed)))
    load.start(io, 10)
    for layer in range(spec.num_layers):
        assert load.wait(layer)
    assert not load.failed
    for layer in range(spec.num_layers):
        assert torch.allclose(placed[layer], full.data[layer, :, :, :32], atol=1e-5)


@pytest.mark.parametrize("start, n", [(0, 24), (0, 21), (3, 21), (3, 5), (0, 8)], ids=str)
def test_the_device_scatter_writes_what_the_host_scatter_writes(start, n):
    """The device path of `scatter_tokens` (run here on host tensors): whole pages in one indexed copy,
    a partial first or last page alone; the same pages as the host path, slot for slot."""
    from kvrestore.chunkio.pages import _scatter_device

    blocks = [7, 2, 5]
    data = torch.randn(2, H, n, D)
    host, device = _paged("cuda"), _paged("cuda")
    scatter_tokens(host, "cuda", blocks, start, data, H, D)
    _scatter_device(*kv_views(device, "cuda", H, D), blocks, start, data)
    assert torch.equal(device, host) and host.abs().sum() > 0


@pytest.mark.parametrize("device_path", [False, True], ids=["host-checked", "device-path"])
@pytest.mark.parametrize("where", ["memory", "file"])
@pytest.mark.parametrize("k", [24, 40])
@pytest.mark.parametrize("key_tile", [0, 8])
def test_a_device_layer_load_places_each_layer_as_rows_up_to_the_first_failed_chunk(
    io, k, where, device_path, tmp_path, key_tile
):
    """The device path of a layer load (`RowPages`, run here on a host buffer): each layer's rows [2, H, T, D] as the prompt's KV,
    a read of two layers at a time after the first alone; a damaged chunk in the middle stops the rows
    of the layers read from then on at its first token, names it, and the object is deleted. The
    device path (shared staging, one upload, device checksums read back per read, runs of chunks placed
    at once) and the host-checked one, from memory and from files."""
    from kvrestore.chunkio.page_dest import RowPages
    from kvrestore.chunkio.pool import StagingPool
    from kvrestore.chunkio.transfer import TransferLane
    from kvrestore.stores.local import LocalStore

    def load(store, chunks):
        placed: dict[int, torch.Tensor] = {}
        lane = TransferLane(StagingPool())
        rows = RowPages.buffer(SPEC, chunks, 2, torch.device("cpu"))

        def place(layer: int, pieces) -> None:
            (piece,) = pieces
            placed[layer] = piece.kv().clone()

        load = LayerLoad(
            SPEC,
            store,
            chunks,
            k,
            RowPages(_Handed(place)),  # type: ignore[arg-type]
            layers_per_read=2,
            rows=rows,
            lane=lane,
            device_path=device_path,
        )
        load.start(io, 10.0)
        assert all(load.wait(layer) for layer in range(SPEC.num_layers))
        load.future.result(timeout=10)
        return load, placed

    store = MemoryStore() if where == "memory" else LocalStore(str(tmp_path))
    chunks, kv = _stored_prompt(store, io, key_tile=key_tile)
    good, placed = load(store, chunks)
    assert not good.failed and sorted(placed) == [0, 1, 2]
    for layer in range(3):
        assert torch.equal(placed[layer], kv[layer, :, :, :k])
    blob = bytearray(io.call(store.get, chunks[1].key))
    blob[-5] ^= 0xFF  # the last layer's section
    io.call(store.put, chunks[1].key, bytes(blob))
    bad, placed = load(store, chunks)
    assert bad.failed == {1} and bad.failed_ranges() == [(16, min(32, k))]
    # layer 0 was read (whole) before the damage showed in the read of layers 1-2: vLLM recomputes
    # the failed range whatever its pages hold
    assert torch.equal(placed[0], kv[0, :, :, :k])
    for layer in (1, 2):
        assert torch.equal(placed[layer], kv[layer, :, :, :16])
    assert io.call(store.get, chunks[1].key) is None


# -- nothing in a user's way --------------------------------------------------------------------------


def test_a_store_that_cannot_be_used_is_refused_before_vllm_loads_the_model(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match="not usable"):
        preflight(ConnectorConfig.from_extra({"store_url": str(tmp_path / "file" / "kv")}))
    with pytest.raises(StoreError, match="read-only"):  # a replica that only reads: the cache must exist
        preflight(ConnectorConfig.from_extra({"store_url": str(tmp_path / "none"), "save": False}))
    preflight(ConnectorConfig.from_extra({"store_url": f"file://{tmp_path / 'kv'}"}))
    assert not (tmp_path / "kv").exists()  # made by the first save
    preflight(ConnectorConfig.from_extra({"store_url": "memory://"}))  # nothing to check
    preflight(ConnectorConfig.from_extra({"store_url": "s3://bucket/kv"}))  # asked at the first lookup
    for typo in ("memroy://", "memory:/", "s4://bucket/kv", "file://relative/kv", " /var/cache/kv"):
        with pytest.raises(KVRestoreError, match="known schemes|absolute path|whitespace"):
            preflight(ConnectorConfig.from_extra({"store_url": typo}))


def test_memory_is_refused_where_the_scheduler_and_the_worker_are_two_processes():
    mem = ConnectorConfig.from_extra({"store_url": "memory://"})
    for backend, workers in [("mp", 1), ("ray", 1), ("uni", 2)]:
        with pytest.raises(InvalidInputError, match="separate processes"):
            check_shared_memory(mem, backend, workers)
    check_shared_memory(mem, "uni", 1)
    check_shared_memory(ConnectorConfig.from_extra({"store_url": "/var/cache/kv"}), "mp", 4)


def test_with_save_off_the_connector_opens_its_store_read_only(tmp_path):
    (tmp_path / "kv").mkdir()
    spec_ctx = ConnectorContext(
        ConnectorConfig.from_extra({"store_url": str(tmp_path / "kv"), "save": False}),
        SPEC,
        8,
        CostLearner.shared(SPEC, tmp_path / "costs"),
    )
    store = spec_ctx.open_store()
    t = IOThread()
    try:
        with pytest.raises(StoreError, match="read-only"):
            t.call(store.put, "ab" * 20, b"x")
    finally:
        t.close()
    assert list((tmp_path / "kv").iterdir()) == []


class _RefusingStore(MemoryStore):
    """Every write refused (read-only credentials, a bucket that does not exist)."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    async def put(self, key, data):
        self.puts += 1
        raise StoreError("AccessDenied")


def test_a_store_that_refuses_writes_is_left_alone_with_one_warning(io, caplog):
    store = _RefusingStore()
    saver = ChunkSaver(SPEC, store, io, retry_after_s=60)
    refs = chunk_keys(list(range(64)), SPEC.fingerprint, 16)
    chunk = KVChunk(0, torch.zeros(3, 2, H, 16, D))
    with caplog.at_level("WARNING", logger="kvrestore.vllm"):
        assert saver.submit(refs[0].key, chunk)
        assert saver.flush(timeout=10)
        tried = store.puts
        assert [saver.submit(r.key, chunk) for r in refs[1:]] == [False, False, False]  # not even queued
        assert saver.flush(timeout=10)
    assert tried == store.puts == 1 and saver.failed == 4 and saver.pending_bytes == 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    saver.store._down_until = 0.0  # the back-off is over: the next chunk is tried again
    assert saver.submit(refs[1].key, chunk) and saver.flush(timeout=10) and store.puts == 2


def test_the_connectors_lines_go_to_vllms_handlers_unless_logging_is_configured():
    vllm, ours, root = logging.Logger("vllm"), logging.Logger("kvrestore"), logging.Logger("root")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    vllm.addHandler(handler)
    assert log_through(vllm, logger=ours, root=root)
    child = logging.Logger("kvrestore.vllm")
    child.parent = ours
    child.info("split")
    assert [r.levelno for r in seen] == [logging.INFO] and ours.level == logging.INFO
    configured = logging.Logger("kvrestore")
    root.addHandler(logging.NullHandler())  # the application set logging up: left as it is
    assert not log_through(vllm, logger=configured, root=root) and not configured.handlers


def test_the_scheduler_reads_the_costs_the_worker_learned_whatever_their_threads(tmp_path):
    """vLLM's scheduler process runs fewer torch threads than its worker: one cost file for both."""
    threads = torch.get_num_threads()
    worker = CostLearner.shared(SPEC, tmp_path)
    worker.observe_step(256, 0, 0.5)
    worker.observe_load("kv", 10_000_000, 0.01)
    worker.flush()
    torch.set_num_threads(1 if threads != 1 else 2)
    try:
        scheduler = CostLearner(SPEC, path=CostLearner.shared(SPEC, tmp_path).path)
    finally:
        torch.set_num_threads(threads)
    assert scheduler.path == worker.path
    assert scheduler.step_cost() is not None and scheduler.link_cost("kv") is not None
