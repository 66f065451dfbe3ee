"""What the vLLM connector keys a request by (`vllm_keys`) and how it signs its chunks, without vLLM:
requests here are stand-ins with the fields vLLM's `Request` has; `tests_vllm/test_isolation.py` runs
the same on real vLLM engines and a `Request` built with `mm_features`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrestore.chunkio.host_pages import HostPages
from kvrestore.chunkio.layer_load import LayerLoad
from kvrestore.chunkio.page_dest import SectionPages
from kvrestore.chunkio.pages import PagedCache
from kvrestore.chunkio.save import ChunkSaver
from kvrestore.codec.quant import key_space
from kvrestore.codec.seal import SECRET_ENV, Seal
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.keys import chunk_keys, namespaced
from kvrestore.core.kv import KVChunk
from kvrestore.core.spec import ModelSpec
from kvrestore.core.sync import LoopThread as IOThread
from kvrestore.integrations.vllm.config import ConnectorConfig, ConnectorContext
from kvrestore.integrations.vllm.keys import RequestKeys
from kvrestore.integrations.vllm.layouts import kv_views
from kvrestore.integrations.vllm.stats import records
from kvrestore.restorer import Restorer
from kvrestore.stores import LocalStore, MemoryStore

from .conftest import tiny_model

H, D, L = 2, 4, 3
SPEC = ModelSpec("tiny", L, H, D, 100, torch.float32, fingerprint="ab" * 16)
BASE = key_space(SPEC.fingerprint, "native")
TOKENS = list(range(40))
SECRET = "a connector secret of 32 bytes.."


def request(rid="r", tokens=TOKENS, salt=None, lora=None, mm=(), embeds=None):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=None if tokens is None else list(tokens),
        prompt_embeds=embeds,
        cache_salt=salt,
        lora_request=lora,
        mm_features=list(mm),
    )


def keys_of(keys: RequestKeys, req) -> list[str] | None:
    refs = keys.refs(req, req.prompt_token_ids or [], 16)
    return None if refs is None else [r.key for r in refs]


def adapter(tmp_path, name: str, weights: bytes):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(d))


def test_salts_key_apart_and_a_salt_is_a_restorers_namespace():
    keys = RequestKeys(BASE)
    plain, a, b = (keys_of(keys, request(salt=s)) for s in (None, "tenantA", "tenantB"))
    assert plain == [r.key for r in chunk_keys(TOKENS, BASE, 16)]  # no salt: the keys of today
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert keys_of(keys, request(salt="")) == plain  # vLLM treats an empty salt as none
    backend_ns = namespaced(BASE, "tenantA")
    assert a == [r.key for r in chunk_keys(TOKENS, backend_ns, 16)]


def test_a_restorer_of_the_same_namespace_shares_the_connectors_keys():
    from kvrestore.backends.hf import HFBackend

    backend = HFBackend(tiny_model("llama"), name="tiny-llama")
    r = Restorer(backend, MemoryStore(), chunk_size=16, namespace="tenantA")
    keys = RequestKeys(key_space(backend.spec.fingerprint, "native"))
    assert keys_of(keys, request(salt="tenantA")) == [x.key for x in r.chunks(TOKENS)[1]]


def test_adapters_are_keyed_by_their_files_not_their_name_or_id(tmp_path):
    keys = RequestKeys(BASE)
    a = adapter(tmp_path, "a", b"weights-a")
    a_again = adapter(tmp_path, "a-copy", b"weights-a")  # the same adapter on another path
    a_again.lora_int_id = 7
    b = adapter(tmp_path, "b", b"weights-b")
    base = keys_of(keys, request())
    ka, ka2, kb = (
        keys_of(keys, request(lora=a)),
        keys_of(keys, request(lora=a_again)),
        keys_of(keys, request(lora=b)),
    )
    assert ka == ka2
    assert not set(ka) & set(kb) and not set(ka) & set(base)
    salted = keys_of(keys, request(lora=a, salt="t"))
    assert not set(salted) & set(ka) and not set(salted) & set(keys_of(keys, request(salt="t")))
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"weights-a, retrained")
    assert not set(keys_of(keys, request(lora=a))) & set(ka)  # new weights: new keys


def test_what_cannot_be_keyed_is_refused_and_logged_once(tmp_path):
    keys = RequestKeys(BASE)
    gone = SimpleNamespace(lora_name="gone", lora_int_id=2, lora_path=str(tmp_path / "nope"))
    no_hash = SimpleNamespace(
        modality="image", identifier=None, mm_position=SimpleNamespace(offset=3, length=4)
    )
    unkeyable = [
        request(embeds=torch.zeros(40, 8)),
        request(tokens=None),
        request(lora=gone),
        request(mm=[no_hash]),
        request(salt="tenant-\ud800"),  # a lone surrogate, as JSON's "\ud800" decodes: no UTF-8 for it
    ]
    before = len(records("unkeyed"))
    for req in unkeyable + unkeyable:
        assert keys_of(keys, req) is None
    assert len(records("unkeyed")) - before == len(unkeyable)  # once per reason


def test_an_image_changes_the_keys_from_its_chunk_on():
    keys = RequestKeys(BASE)

    def image(identifier, offset=20):
        return SimpleNamespace(
            modality="image", identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=6)
        )

    one, two = keys_of(keys, request(mm=[image("h1")])), keys_of(keys, request(mm=[image("h2")]))
    assert one[0] == two[0]  # chunk 0 (tokens 0-15) precedes the image
    assert one[1] != two[1] and one[2] != two[2]
    assert keys_of(keys, request(mm=[image("h1", offset=21)]))[1] != one[1]


@pytest.fixture
def io():
    t = IOThread()
    yield t
    t.close()


def _save(store, io, seal, n=40):
    kv = torch.randn(L, 2, H, n, D)
    refs = chunk_keys(list(range(n)), BASE, 16)
    saver = ChunkSaver(SPEC, store, io, seal=seal)
    for r in refs:
        assert saver.submit(r.key, KVChunk(r.start, kv[:, :, :, r.start : r.end].clone()))
    assert saver.flush(timeout=10) and saver.written == len(refs)
    return refs, kv


def _layer_load(store, io, chunks, seal):
    placed: dict[int, torch.Tensor] = {}

    class Handed:  # page writes (`page_dest.Writes`) that keep each layer's pieces, joined
        queues = False

        def put(self, layer, pieces):
            placed[layer] = torch.cat([p.kv() for p in pieces], dim=2)

        def flush(self, layer):
            pass

    load = LayerLoad(SPEC, store, chunks, 32, SectionPages(Handed()), seal=seal)
    load.start(io, 10)
    for layer in range(L):
        assert load.wait(layer)
    load.future.result(timeout=10)
    return load, placed


def test_the_connector_signs_its_chunks_and_loads_only_signed_ones(io):
    seal = Seal(SECRET)
    store = MemoryStore()
    chunks, kv = _save(store, io, seal)
    load, placed = _layer_load(store, io, chunks, seal)
    assert not load.failed and torch.equal(placed[0], kv[0, :, :, :32])
    forged_store = MemoryStore()
    chunks, _ = _save(forged_store, io, None)  # a writer without the secret, under the right keys
    load, placed = _layer_load(forged_store, io, chunks, seal)
    assert load.failed == {0, 1} and placed == {}  # the two chunks of tokens [0, 32)
    assert len(forged_store) == 3  # a miss, not deleted


def test_host_page_loads_refuse_unsigned_chunks_and_keep_them(tmp_path, io):
    store = LocalStore(str(tmp_path))
    chunks, _ = _save(store, io, None)
    pages = [torch.zeros(12, H, 8, 2 * D) for _ in range(L)]
    views = [kv_views(p, "cpu", H, D) for p in pages]
    dest = HostPages(PagedCache([k for k, _ in views], [v for _, v in views]), list(range(12)), 0, 32)
    load = LayerLoad(SPEC, store, chunks, 32, dest, seal=Seal(SECRET))
    load.start(io)
    for layer in range(L):
        load.wait(layer)
    load.cancel("the step ended")
    for f in load.deletes:
        f.result(timeout=10)
    assert load.failed == {0, 1}  # the two chunks of tokens [0, 32)
    assert all(bool((p == 0).all()) for p in pages)  # nothing of the forged chunks reached the pages
    assert all(io.call(store.contains, [c.key for c in chunks]))


def test_the_secret_comes_from_the_config_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    ctx = ConnectorContext.make(
        ConnectorConfig.from_extra({"store_url": "memory://", "cost_dir": str(tmp_path)}), SPEC, 16
    )
    assert ctx.seal is None
    cfg = ConnectorConfig.from_extra({"store_url": "memory://", "secret": SECRET, "cost_dir": str(tmp_path)})
    assert SECRET not in repr(cfg)
    assert ConnectorContext.make(cfg, SPEC, 16).seal is not None
    monkeypatch.setenv(SECRET_ENV, SECRET)
    ctx = ConnectorContext.make(
        ConnectorConfig.from_extra({"store_url": "memory://", "cost_dir": str(tmp_path)}), SPEC, 16
    )
    assert ctx.seal is not None
    with pytest.raises(InvalidInputError, match="secret"):
        ConnectorConfig.from_extra({"store_url": "memory://", "secret": "short"})
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(InvalidInputError, match="secret"):
        ConnectorConfig.from_extra({"store_url": "memory://"})
