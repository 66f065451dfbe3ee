"""The vLLM connector on the stores a fleet shares (`make test-vllm`): Redis and Mooncake's store, real
servers on 127.0.0.1, and real vLLM engines (`serve.py`, a new process each, as a restarted or another
server would be). One engine computes and saves a prompt; a restarted one (the same cost directory) and
another server (its own) load every stored token from the shared store and generate what vLLM alone
generates. The connector opens these stores by URL like any other (`store_url`, `store_options`)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the test servers of tests/

from test_connector import LOADABLE, N_CHUNKS, assert_same_generation, serve  # noqa: E402

from tests.mooncake_server import MooncakeServer  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvrestore.backends.hf import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def reference(model_dir):
    """vLLM without a connector."""
    return serve(model_dir, connector="none")


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def shared(request, tmp_path_factory):
    """A store URL (and its options) on a real server, under a prefix of this module's own."""
    prefix = f"vllm-{uuid.uuid4().hex[:8]}"
    if request.param == "redis":
        with RedisServer() as server:
            yield request.param, {"store_url": f"{server.url}/{prefix}"}, server
    else:
        with MooncakeServer(segment_size="256MB") as server:
            options = server.options()
            yield request.param, {"store_url": f"{server.url}/{prefix}", "store_options": options}, server


def test_a_restarted_server_and_another_one_load_what_the_first_saved(model_dir, reference, shared, tmp_path):
    kind, store, server = shared
    first_costs, other_costs = str(tmp_path / "costs-a"), str(tmp_path / "costs-b")
    first = serve(model_dir, extra={**store, "cost_dir": first_costs}, args=["--exit"])
    assert first.events("loaded") == []
    if kind == "redis":
        assert len(server.client().keys(f"{store['store_url'].rsplit('/', 1)[1]}/*")) == N_CHUNKS
    restarted = serve(model_dir, extra={**store, "cost_dir": first_costs})
    other = serve(model_dir, extra={**store, "cost_dir": other_costs})
    for run in (first, restarted, other):
        assert_same_generation(run.results[0], reference.results[0])
    for run in (restarted, other):
        loaded = [r["tokens"] for r in run.events("loaded")]
        assert loaded == [LOADABLE], run.log[-3000:]
        assert run.events("load_failed") == [] and run.metrics["load_failures"] == 0


def test_a_running_server_rides_out_a_redis_outage(model_dir, tmp_path):
    """vLLM's OpenAI server over Redis, never restarted: it saves a prompt, loads it; Redis is killed and
    the prompt is served without it (the same greedy output); Redis starts again (empty) and, within the
    connector's `retry_after_s` (10 s), the running server saves and loads again."""
    import asyncio
    import time

    from serve import prompt_ids
    from transformers import AutoTokenizer

    from kvrestore.tools.vllm_server import VLLMServer, complete, kv_transfer

    prompt = prompt_ids(AutoTokenizer.from_pretrained(str(model_dir)), 1000)
    with RedisServer() as redis:
        extra = {"store_url": f"{redis.url}/running", "cost_dir": str(tmp_path / "costs")}
        transfer = kv_transfer("KVRestoreConnector", extra)
        # no prefix caching: every request asks the store, as one to another server of the fleet would
        with VLLMServer(model_dir, kv_transfer=transfer, args=["--no-enable-prefix-caching"]) as server:

            def ask() -> tuple[str, dict[str, float]]:
                done = asyncio.run(complete(server.url, str(model_dir), prompt, max_tokens=8))
                return done.text, server.metrics()

            text, _ = ask()
            again, loaded = ask()
            assert again == text and loaded["saved_chunks"] >= 3 and loaded["loaded_tokens"] > 0
            redis.kill()
            down_text, down = ask()
            assert down_text == text, server.log_tail()
            assert down["loaded_tokens"] == loaded["loaded_tokens"]  # nothing loaded while it is down
            redis.start()  # the same port, empty
            time.sleep(10.0)  # the promise: saving and loading again within 10 s
            back_text, back = ask()  # computed, and saved again
            final_text, final = ask()  # loaded
            assert back_text == final_text == text
            assert final["saved_chunks"] > down["saved_chunks"], server.log_tail()
            assert final["loaded_tokens"] > back["loaded_tokens"], server.log_tail()
