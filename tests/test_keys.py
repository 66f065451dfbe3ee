"""Chunk keys: chained prefix hashes, stable across processes, separated by model fingerprint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrestore.core.keys import chunk_keys, content_key
from kvrestore.stores.base import check_key

FP = "0123456789abcdef" * 2


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=300), st.integers(1, 64))
def test_chunks_cover_tokens_and_keys_are_valid(tokens, size):
    refs = chunk_keys(tokens, FP, size)
    assert refs[0].start == 0 and refs[-1].end == len(tokens)
    assert all(a.end == b.start for a, b in zip(refs, refs[1:], strict=False))
    assert all(0 < r.n_tokens <= size for r in refs)
    assert all(r.n_tokens == size for r in refs[:-1])
    assert all(check_key(r.key) for r in refs)
    assert len({r.key for r in refs}) == len(refs)


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=200), st.integers(1, 32), st.data())
def test_a_changed_token_changes_its_chunk_and_every_later_one(tokens, size, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[i] = tokens[i] + 1
    a, b = chunk_keys(tokens, FP, size), chunk_keys(other, FP, size)
    changed = i // size
    assert [r.key for r in a[:changed]] == [r.key for r in b[:changed]]
    assert all(x.key != y.key for x, y in zip(a[changed:], b[changed:], strict=False))


def test_shared_prefix_shares_full_chunks_but_not_the_partial_one():
    tokens = list(range(100))
    short, long = chunk_keys(tokens[:70], FP, 32), chunk_keys(tokens, FP, 32)
    assert [r.key for r in short[:2]] == [r.key for r in long[:2]]
    assert short[2].n_tokens == 6 and short[2].key != long[2].key


def test_fingerprint_and_chunk_size_separate_keys():
    tokens = list(range(64))
    base = {r.key for r in chunk_keys(tokens, FP, 32)}
    assert base.isdisjoint(r.key for r in chunk_keys(tokens, "f" * 32, 32))
    assert chunk_keys(tokens, FP, 32)[0].key != chunk_keys(tokens, FP, 16)[0].key


def test_tensor_and_list_give_the_same_keys():
    tokens = [5, 9, 1000, 3] * 20
    assert chunk_keys(tokens, FP, 16) == chunk_keys(torch.tensor(tokens, dtype=torch.int32), FP, 16)


def test_keys_are_stable_across_processes():
    """Keys must not depend on Python's per-process hash salt."""
    code = (
        "from kvrestore.core.keys import chunk_keys, content_key;"
        f"print(','.join(r.key for r in chunk_keys(list(range(50)), {FP!r}, 16)));"
        f"print(content_key([1, 2, 3], {FP!r}))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout
        for seed in (1, 2)
    }
    assert len(outs) == 1
    here = (
        ",".join(r.key for r in chunk_keys(list(range(50)), FP, 16))
        + "\n"
        + content_key([1, 2, 3], FP)
        + "\n"
    )
    assert outs == {here}


@pytest.mark.parametrize("size", [0, -3])
def test_bad_chunk_size(size):
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_keys([1, 2, 3], FP, size)


def test_content_key_ignores_position():
    assert content_key([1, 2, 3], FP) == content_key(torch.tensor([1, 2, 3]), FP)
    assert content_key([1, 2, 3], FP) != content_key([1, 2, 4], FP)
