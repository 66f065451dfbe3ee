"""The fingerprint names every weight: in memory (every parameter and buffer) and on disk (every byte of a
checkpoint's weight files), with the files' digests cached safely."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvrestore.backends.hf import HFBackend
from kvrestore.core import fingerprint
from kvrestore.core.errors import InvalidInputError
from kvrestore.core.fingerprint import DigestCache, of_checkpoint, of_tensors
from kvrestore.integrations.vllm.config import checkpoint_fingerprint

from .conftest import tiny_model

MODEL = tiny_model("llama")
TENSORS = [*MODEL.named_parameters(), *MODEL.named_buffers()]
CONFIG = MODEL.config.to_dict()


def flip_one_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of element `index` of `t` (in place): another value, whatever the element held."""
    raw = t.data.reshape(-1)[index : index + 1].view(torch.uint8)
    raw[bit // 8] ^= 1 << (bit % 8)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_single_element_changed_changes_the_fingerprint(data):
    """Every parameter and buffer, every element, any bit: none is left out of the hash."""
    base = of_tensors(CONFIG, TENSORS, torch.float32)
    name, t = data.draw(st.sampled_from(TENSORS), label="tensor")
    index = data.draw(st.integers(0, t.numel() - 1), label="element")
    bit = data.draw(st.integers(0, 8 * t.element_size() - 1), label="bit")
    flip_one_bit(t, index, bit)
    try:
        assert of_tensors(CONFIG, TENSORS, torch.float32) != base, (name, index, bit)
    finally:
        flip_one_bit(t, index, bit)
    assert of_tensors(CONFIG, TENSORS, torch.float32) == base


def test_the_backend_hashes_parameters_buffers_config_and_dtype():
    model = tiny_model("llama")
    fp = HFBackend(model).spec.fingerprint
    assert fp == of_tensors(
        model.config.to_dict(), [*model.named_parameters(), *model.named_buffers()], torch.float32
    )
    inv_freq = model.model.rotary_emb.inv_freq  # a buffer, not in the state dict
    inv_freq[0] += 1
    assert HFBackend(model).spec.fingerprint != fp
    inv_freq[0] -= 1
    assert HFBackend(model).spec.fingerprint == fp
    assert HFBackend(model, dtype=torch.bfloat16).spec.fingerprint != fp


# -- checkpoints on disk -----------------------------------------------------------------------------


def save_checkpoint(path: Path, model=None) -> Path:
    """A local checkpoint directory a `from_pretrained` loads: the model, and a tokenizer over bytes."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    (model or tiny_model("llama")).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(256)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_a_restorer_and_the_connector_name_a_checkpoint_alike(checkpoint, tmp_path):
    backend = HFBackend.from_pretrained(checkpoint, dtype=torch.float32, cache_dir=tmp_path / "a")
    got = checkpoint_fingerprint(checkpoint, torch.float32, cache_dir=tmp_path / "b")
    assert backend.spec.fingerprint == got
    assert checkpoint_fingerprint(checkpoint, torch.float32, cache_dir=tmp_path / "b") == got  # cached or not
    assert checkpoint_fingerprint(checkpoint, torch.bfloat16, cache_dir=tmp_path / "b") != got
    assert HFBackend.from_pretrained(checkpoint, dtype=torch.bfloat16).spec.fingerprint != got
    with pytest.raises(InvalidInputError, match="fingerprint"):  # the connector says what to give instead
        checkpoint_fingerprint(tmp_path / "nope", torch.float32, cache_dir=tmp_path / "b")


def test_a_checkpoint_is_named_by_its_config_and_each_file(checkpoint, tmp_path):
    base = of_checkpoint(checkpoint, torch.float32, tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert of_checkpoint(copy, torch.float32, tmp_path) == base  # where it lives does not count
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.0"  # nor what wrote it
    (copy / "config.json").write_text(json.dumps(config))
    assert of_checkpoint(copy, torch.float32, tmp_path) == base
    config["rms_norm_eps"] = 1e-3  # what the model computes does
    (copy / "config.json").write_text(json.dumps(config))
    assert of_checkpoint(copy, torch.float32, tmp_path) != base
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    (copy / "extra.bin").write_bytes(b"\0")  # a weight file more
    assert of_checkpoint(copy, torch.float32, tmp_path) != of_checkpoint(checkpoint, torch.float32, tmp_path)
    (copy / "empty").mkdir()
    for bad, match in [
        (tmp_path / "nope", "not a local checkpoint directory"),
        (copy / "empty", "no weight file"),
    ]:
        with pytest.raises(InvalidInputError, match=match):
            of_checkpoint(bad, torch.float32, tmp_path)
    (copy / "config.json").write_text("[1]")
    with pytest.raises(InvalidInputError, match="config.json"):
        of_checkpoint(copy, torch.float32, tmp_path)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = save_checkpoint(tmp_path_factory.mktemp("edit") / "tiny")
    return root, load_file(root / "model.safetensors")


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_single_element_changed_on_disk_changes_the_fingerprint(weights, tmp_path_factory, data):
    """The file rewritten in place, as one would edit a checkpoint, through one persistent digest cache:
    the cache never answers for the old content."""
    root, tensors = weights
    cache = tmp_path_factory.getbasetemp() / "digests"
    before = of_checkpoint(root, torch.float32, cache)
    name = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
    t = tensors[name]
    index = data.draw(st.integers(0, t.numel() - 1), label="element")
    bit = data.draw(st.integers(0, 8 * t.element_size() - 1), label="bit")
    flip_one_bit(t, index, bit)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    after = of_checkpoint(root, torch.float32, cache)
    assert after != before, (name, index, bit)
    flip_one_bit(t, index, bit)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    assert of_checkpoint(root, torch.float32, cache) == before


# -- the digest cache --------------------------------------------------------------------------------


class Reads:
    """Counts the files `fingerprint.file_digest` reads."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[str] = []
        real = fingerprint.file_digest

        def counted(path):
            self.paths.append(str(path))
            return real(path)

        monkeypatch.setattr(fingerprint, "file_digest", counted)


def test_a_restart_reads_no_weight_file(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_S", -1.0)  # the files were just written: count them settled
    reads = Reads(monkeypatch)
    first = of_checkpoint(checkpoint, torch.float32, tmp_path)
    assert len(reads.paths) == 1  # model.safetensors
    assert of_checkpoint(checkpoint, torch.float32, tmp_path) == first
    assert of_checkpoint(checkpoint, torch.bfloat16, tmp_path) != first  # the dtype needs no read either
    assert len(reads.paths) == 1
    entries = list((tmp_path / "fingerprints").glob("*.json"))
    assert len(entries) == 1 and not list((tmp_path / "fingerprints").glob(".tmp-*"))


def test_a_file_changed_in_any_way_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_S", -1.0)
    reads = Reads(monkeypatch)
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 100)
    cache = DigestCache(tmp_path / "cache")
    d = cache.digest(f)
    assert cache.digest(f) == d and len(reads.paths) == 1
    st0 = f.stat()
    os.utime(f, ns=(st0.st_atime_ns, st0.st_mtime_ns + 1))  # same bytes, another time
    assert cache.digest(f) == d and len(reads.paths) == 2
    f.write_bytes(b"a" * 101)  # another size
    assert cache.digest(f) != d and len(reads.paths) == 3
    moved = tmp_path / "moved.bin"
    os.replace(f, moved)  # another path
    cache.digest(moved)
    assert len(reads.paths) == 4


def test_a_damaged_or_foreign_cache_entry_is_never_believed(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_S", -1.0)
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights")
    cache = DigestCache(tmp_path / "cache")
    good = cache.digest(f)
    key = cache.key(f)
    entry = cache._entry(key)
    for text in [
        "",
        "{",
        "[]",
        json.dumps({"key": key, "xxh3_128": "zz" * 16}),
        json.dumps({"key": key, "xxh3_128": "00"}),
        json.dumps({"key": [*key[:-1], key[-1] + 1], "xxh3_128": "00" * 16}),
    ]:
        entry.write_text(text)
        assert cache.lookup(key) is None, text
        assert cache.digest(f) == good


def test_a_file_changed_recently_is_never_cached(tmp_path, monkeypatch):
    """A file rewritten within one tick of the file system's clock keeps its times: one changed less than
    `RACY_S` ago is read every time."""
    monkeypatch.setattr(fingerprint, "RACY_S", 1e9)
    reads = Reads(monkeypatch)
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights")
    cache = DigestCache(tmp_path / "cache")
    cache.digest(f)
    cache.digest(f)
    assert len(reads.paths) == 2 and not (tmp_path / "cache").exists()


def test_a_cache_that_cannot_be_written_costs_only_the_read(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_S", -1.0)
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights")
    assert DigestCache(tmp_path / "cache" / "fingerprints").digest(f) == fingerprint.file_digest(f)


def test_an_empty_file_has_the_digest_of_no_bytes(tmp_path):
    import xxhash

    (tmp_path / "empty.bin").write_bytes(b"")
    assert fingerprint.file_digest(tmp_path / "empty.bin") == xxhash.xxh3_128_digest(b"")
