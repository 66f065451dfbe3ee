"""vLLM with many workers on this CPU (`tensor_parallel_size` 2), on a tiny random-weight Llama the test
saves (4 query heads, 2 KV heads, 4 layers: `tiny_llama.py`), each run a new process (`serve.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_connector import assert_same_generation, serve  # noqa: E402
from tiny_llama import save_tiny_llama  # noqa: E402

#: one OpenMP thread set per worker: vLLM's default binding refuses two workers on this CPU
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def alone_tp1(tiny):
    return serve(tiny, connector="none")


@pytest.fixture(scope="module")
def alone_tp2(tiny):
    return serve(tiny, connector="none", args=["--tp", "2"], env=TP2)


def test_vllm_alone_gives_the_same_tokens_at_tp_1_and_2(alone_tp1, alone_tp2):
    # the reference every connector case at either tp compares with; varied tokens, not one repeated
    assert len(set(alone_tp1.results[0]["ids"])) > 1
    assert_same_generation(alone_tp2.results[0], alone_tp1.results[0])
