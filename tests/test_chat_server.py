"""examples/chat_server.py in process, on a tiny seeded Llama with a byte-level chat template (fast).

The real model runs through docs/tutorial-serving.md (tests/test_docs.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from kvrestore import open_store  # noqa: E402
from kvrestore.backends.hf import HFBackend  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _load_example():
    spec = importlib.util.spec_from_file_location("chat_server", ROOT / "examples" / "chat_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat_server"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


chat_server = _load_example()
CHUNK = 16


class ByteChatTokenizer:
    """A chat template over bytes (the tiny model's vocabulary is 256): enough of a tokenizer to serve."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, return_dict=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class SlowBackend(HFBackend):
    """Every compute unit and every generate() takes at least `delay` seconds (the slowness is the subject:
    model work long enough to block an event loop that ran it); compute units are recorded (start token,
    token bytes), counted as they start and finish, and so are the threads model work ran on."""

    delay = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.units: list[tuple[int, bytes]] = []
        self.started = self.finished = 0
        self.model_threads: set[int] = set()
        self._units_lock = threading.Lock()
        generate = self.model.generate

        def slow_generate(*args, **kwargs):
            with self._units_lock:
                self.model_threads.add(threading.get_ident())
            time.sleep(self.delay)
            return generate(*args, **kwargs)

        self.model.generate = slow_generate

    def _unit(self, tokens, start):
        with self._units_lock:
            self.started += 1
            self.model_threads.add(threading.get_ident())
        time.sleep(self.delay)
        with self._units_lock:
            self.units.append((start, bytes(tokens.tolist())))
            self.finished += 1

    def prefill_chunk(self, tokens, past, start):
        self._unit(tokens, start)
        return super().prefill_chunk(tokens, past, start)

    def prefill_into(self, tokens, cache, start, **kwargs):
        self._unit(tokens, start)
        return super().prefill_into(tokens, cache, start, **kwargs)


def make_backend(delay: float = 0.0) -> SlowBackend:
    backend = SlowBackend(tiny_model("llama"), tokenizer=ByteChatTokenizer(), name="tiny-llama-chat")
    backend.delay = delay
    return backend


def make_service(tmp_path: Path, backend: HFBackend | None = None, **kwargs):
    backend = backend or make_backend()
    limits = chat_server.Limits(max_new_tokens=64, max_content_chars=2000, max_context_tokens=1024)
    store = open_store(f"file://{tmp_path}")
    return chat_server.ChatService(backend, store, chunk_size=CHUNK, limits=limits, **kwargs)


def serve(service, scenario):
    """Run `scenario(client)` against the service's app, in process, on a loopback port."""

    async def main():
        async with TestClient(TestServer(service.app())) as client:
            return await scenario(client)

    return asyncio.run(main())


async def post(client, conv: str, content, max_new_tokens=8, expect=200):
    resp = await client.post(
        f"/v1/conversations/{conv}/messages", json={"content": content, "max_new_tokens": max_new_tokens}
    )
    body = await resp.json()
    assert resp.status == expect, body
    return body


def reference_reply(service, messages: list[dict], max_new_tokens: int = 8) -> str:
    """A plain full prefill + greedy generation, no cache anywhere."""
    prompt = service.prompt_ids(messages, next_turn=True)
    return service.tokenizer.decode(service.backend.generate(prompt, None, max_new_tokens))


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "missing field 'content'"),
        ({"content": 5}, "'content' must be a string"),
        ({"content": "   "}, "'content' is empty"),
        ({"content": "x" * 2001}, "'content' too long"),
        ({"content": "hi", "max_new_tokens": "8"}, "'max_new_tokens' must be an integer"),
        ({"content": "hi", "max_new_tokens": True}, "'max_new_tokens' must be an integer"),
        ({"content": "hi", "max_new_tokens": 0}, "between 1 and 64"),
        ({"content": "hi", "max_new_tokens": 65}, "between 1 and 64"),
        ({"content": "hi", "role": "system"}, "unknown fields ['role']"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_turns_are_json_400s(tmp_path, body, message):
    service = make_service(tmp_path)

    async def scenario(client):
        resp = await client.post("/v1/conversations/c1/messages", json=body)
        assert resp.status == 400 and resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert message in error
        # nothing was created by a refused turn
        assert (await client.get("/v1/conversations/c1")).status == 404

    serve(service, scenario)


def test_malformed_json_bad_id_too_long_conversation_and_unknown_routes(tmp_path):
    service = make_service(tmp_path)

    async def scenario(client):
        resp = await client.post("/v1/conversations/c1/messages", data=b"{not json")
        assert resp.status == 400 and "JSON object" in (await resp.json())["error"]
        resp = await client.post("/v1/conversations/bad%20id!/messages", json={"content": "hi"})
        assert resp.status == 400 and "conversation id" in (await resp.json())["error"]
        long = await post(client, "c1", "y" * 1000, max_new_tokens=60, expect=400)
        assert "conversation too long" in long["error"]
        missing = await client.get("/v1/conversations/nobody")
        assert missing.status == 404 and "nobody" in (await missing.json())["error"]
        nowhere = await client.get("/v2/elsewhere")
        assert nowhere.status == 404 and nowhere.content_type == "application/json"
        wrong_method = await client.get("/v1/conversations/c1/messages")
        assert wrong_method.status == 405 and wrong_method.content_type == "application/json"
        health = await client.get("/healthz")
        assert health.status == 200 and (await health.json())["status"] == "ok"

    serve(service, scenario)


# -- turns -----------------------------------------------------------------------------------------


def test_second_turn_loads_the_first_turns_kv_and_replies_as_a_full_prefill(tmp_path):
    service = make_service(tmp_path)

    async def scenario(client):
        first = await post(client, "c1", "Tell me about the with statement, please.")
        second = await post(client, "c1", "And what if the body raises?")
        conv = await (await client.get("/v1/conversations/c1")).json()
        return first, second, conv

    first, second, conv = serve(service, scenario)
    messages = conv["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert first["restore"]["loaded_chunks"] == 0 and first["restore"]["policy"] == "two-pointer"
    assert second["restore"]["loaded_chunks"] > 0
    assert second["restore"]["computed_chunks"] + second["restore"]["loaded_chunks"] == -(
        -second["restore"]["n_tokens"] // CHUNK
    )
    assert first["reply"] == messages[1]["content"] == reference_reply(service, messages[:1])
    assert second["reply"] == messages[3]["content"] == reference_reply(service, messages[:3])
    for turn in (first, second):  # the first token comes after the restore it is computed on
        assert turn["ttft_s"] >= turn["restore"]["seconds"] > 0


def test_the_save_computes_only_the_tokens_after_the_prompt(tmp_path):
    backend = make_backend()
    service = make_service(tmp_path, backend)

    async def scenario(client):
        await post(client, "c1", "Hello there, how are you today?")
        await service.flush()

    serve(service, scenario)
    messages = service.conversations["c1"].messages
    prompt = service.prompt_ids(messages[:1], next_turn=True)
    history = service.prompt_ids(messages, next_turn=False)
    *restore_units, (save_start, save_tokens) = backend.units
    assert all(start < len(prompt) for start, _ in restore_units)
    # the save computed only the reply and the end-of-turn tokens, on top of the restored prompt
    assert save_start == len(prompt) and list(save_tokens) == history[len(prompt) :]


def test_two_conversations_run_concurrently_and_the_loop_stays_responsive(tmp_path):
    backend = make_backend(delay=0.25)
    service = make_service(tmp_path, backend)
    a_text, b_text = "Alpha " * 12, "Bravo " * 12

    async def scenario(client):
        loop_thread = threading.get_ident()
        turns = asyncio.ensure_future(asyncio.gather(post(client, "a", a_text), post(client, "b", b_text)))
        answered_during_a_unit = 0  # health checks answered while a compute unit was running
        while not turns.done():  # restores, generation and saves are running all along
            started = backend.started
            if started > backend.finished:  # a unit is running now
                assert (await client.get("/healthz")).status == 200
                answered_during_a_unit += backend.finished < started  # and had not ended at the answer
            await asyncio.wait({turns}, timeout=0.01)  # the pace of the checks, not a synchronisation
        return await turns, loop_thread, answered_during_a_unit

    (a, b), loop_thread, answered = serve(service, scenario)
    # model work never runs on (and so never blocks) the event loop, which keeps answering meanwhile
    assert backend.model_threads and loop_thread not in backend.model_threads
    assert answered >= 1
    assert a["reply"] == reference_reply(service, [{"role": "user", "content": a_text}])
    assert b["reply"] == reference_reply(service, [{"role": "user", "content": b_text}])
    a_prompt = bytes(service.prompt_ids([{"role": "user", "content": a_text}], next_turn=True))
    owners = ["a" if a_prompt[s : s + len(t)] == t else "b" for s, t in backend.units]
    switches = sum(x != y for x, y in zip(owners, owners[1:], strict=False))
    assert switches >= 2, owners  # the compute lane alternated between the two restores


def test_turns_of_one_conversation_are_serialized(tmp_path):
    backend = make_backend(delay=0.05)
    service = make_service(tmp_path, backend)

    async def scenario(client):
        replies = await asyncio.gather(
            post(client, "c1", "first question"), post(client, "c1", "second question")
        )
        conv = await (await client.get("/v1/conversations/c1")).json()
        return replies, conv["messages"]

    replies, messages = serve(service, scenario)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert {messages[0]["content"], messages[2]["content"]} == {"first question", "second question"}
    by_question = {r["reply"]: r for r in replies}
    earlier, later = by_question[messages[1]["content"]], by_question[messages[3]["content"]]
    # the later turn saw the whole earlier turn, and found its KV saved
    assert later["restore"]["n_tokens"] == len(service.prompt_ids(messages[:3], next_turn=True))
    assert later["restore"]["loaded_chunks"] > 0 and earlier["restore"]["loaded_chunks"] == 0
    assert messages[3]["content"] == reference_reply(service, messages[:3])


@pytest.mark.parametrize("fault", ["deleted", "corrupt"])
def test_a_damaged_store_between_turns_recomputes_and_answers_correctly(tmp_path, fault):
    service = make_service(tmp_path)

    async def scenario(client):
        await post(client, "c1", "Tell me about the with statement, please.")
        await service.flush()
        chunks = sorted(tmp_path.rglob("*.kvc"))
        assert chunks
        for path in chunks:
            if fault == "deleted":
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        second = await post(client, "c1", "And what if the body raises?")
        conv = await (await client.get("/v1/conversations/c1")).json()
        return second, conv["messages"]

    second, messages = serve(service, scenario)
    r = second["restore"]
    assert r["loaded_chunks"] == 0 and r["computed_chunks"] == -(-r["n_tokens"] // CHUNK)
    if fault == "corrupt":
        assert r["failed_loads"] >= 1
    assert second["reply"] == reference_reply(service, messages[:3])


def test_a_failed_save_is_logged_and_the_next_turn_recomputes(tmp_path, caplog):
    service = make_service(tmp_path)

    async def broken_save(*args, **kwargs):
        raise OSError("disk full")

    async def scenario(client):
        service.restorer.save = broken_save
        await post(client, "c1", "Hello there")
        second = await post(client, "c1", "Again")
        conv = await (await client.get("/v1/conversations/c1")).json()
        return second, conv["messages"]

    second, messages = serve(service, scenario)
    assert "saving a conversation's KV failed" in caplog.text
    assert second["restore"]["loaded_chunks"] == 0
    assert second["reply"] == reference_reply(service, messages[:3])


def test_cli_defaults_to_loopback():
    args = chat_server.parse_args([])
    assert args.host == "127.0.0.1" and args.store.startswith("file://")
    assert chat_server._is_loopback("127.0.0.1") and chat_server._is_loopback("::1")
    assert not chat_server._is_loopback("0.0.0.0")


def test_kv_extension_reuses_the_prompt_rows(tmp_path):
    service = make_service(tmp_path)
    backend = service.backend
    prompt = list(b"<user>hello\n<assistant>")
    history = list(b"<user>hello\n<assistant>hi!\n")
    full = backend.prefill_chunk(torch.tensor(history), None, 0).data
    buffer = chat_server.KVCache.empty(backend.spec, len(prompt))  # too small: grows
    buffer.write(backend.prefill_chunk(torch.tensor(prompt), None, 0))
    kv = service._extend_kv(buffer, prompt, history)
    assert kv.n_tokens == len(history)
    torch.testing.assert_close(kv.data, full, atol=1e-5, rtol=0)
