"""Test doubles for the router: engines that speak vLLM's OpenAI API and kv_transfer_params.

`FakeVllmEngine` is a TEST DOUBLE, not vLLM: it serves /v1/completions and /v1/chat/completions
(streamed as SSE or not), /health and /v1/models like vLLM's api_server, reads and answers
kv_transfer_params like a PD engine, and records every request. Its "tokens" are deterministic strings
derived from the prompt, so a test can tell every answer apart. The real-vLLM path is covered by the
end-to-end tests. `FakeBootstrapServer` is a TEST DOUBLE of vLLM's MooncakeBootstrapServer (/query).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

JsonObject = dict[str, Any]
PADDING = "<padding>"  # where `padding` given as JSON bytes goes in an answer


def prompt_key(body: JsonObject) -> str:
    return json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)


def fake_tokens(key: str, count: int, choice: int = 0) -> list[str]:
    """The double's answer: token i of choice c of a prompt."""
    tag = hashlib.sha256(key.encode()).hexdigest()[:8]
    return [f" {tag}.{choice}.{i}" for i in range(count)]


def expected_text(prompt: object, count: int, choice: int = 0) -> str:
    key = json.dumps(prompt, sort_keys=True)
    return "".join(fake_tokens(key, count, choice))


@dataclass
class Seen:
    path: str
    body: JsonObject
    headers: CIMultiDict[str]
    at: float = field(default_factory=time.monotonic)
    answered_at: float | None = None  # a prefill's: when its answer was made, before it is sent

    @property
    def kv(self) -> JsonObject:
        return self.body.get("kv_transfer_params") or {}

    @property
    def is_prefill(self) -> bool:
        return bool(self.kv.get("do_remote_decode"))


class FakeVllmEngine:
    """TEST DOUBLE of a vLLM OpenAI-compatible server (see the module docstring).

    Knobs a test may set at any time: `healthy`, `fail_status` (answer with vLLM's error JSON; only the
    next `fail_next` generations when that is set),
    `eos_at_prefill` (prefill's one token ends the answer), `prefill_finish` (the finish_reason of
    prefill's answer, e.g. "abort" as vLLM answers a request it rejected while shutting down),
    `hold` (an Event every generation waits on before answering), `health_hold` (an Event /health
    waits on before answering, as an engine too busy to answer its probe in time),
    `hold_after_first_chunk` (streams stop after one chunk until it is set),
    `break_after_first_chunk` (the connection is dropped mid-stream), `padding` (a JSON value, or JSON
    bytes, put into the choices of non-streamed decode answers to prompts starting with "big", as
    prompt logprobs would be), `nixl` (prefill returns NIXL's kv_transfer_params), `api_key` (as
    vLLM's VLLM_API_KEY: /v1 routes answer 401 without `Authorization: Bearer <key>`).
    `authorizations` records (path, Authorization) of every request.
    """

    def __init__(self, name: str, *, nixl: bool = False) -> None:
        self.name = name
        self.nixl = nixl
        self.healthy = True
        self.fail_status: int | None = None
        self.fail_next: int | None = None
        self.eos_at_prefill = False
        self.prefill_finish: str | None = None
        self.hold: asyncio.Event | None = None
        self.health_hold: asyncio.Event | None = None
        self.hold_after_first_chunk: asyncio.Event | None = None
        self.break_after_first_chunk = False
        self.padding: object = ""  # see the class docstring (any JSON value)
        self.seen: list[Seen] = []
        self.api_key: str | None = None
        self.fingerprint: str | None = None  # its KV fingerprint, on /health as dllm-serve says it
        self.active = self.max_active = 0  # generations being answered now, and the most at once
        self.authorizations: list[tuple[str, str | None]] = []
        self.record = True  # False: keep no history (benchmarks)
        self.arrived = asyncio.Event()
        self.cancelled: list[str] = []
        self.cancelled_event = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def generations(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/") and s.path != "/v1/models"]

    async def start(self, port: int = 0) -> FakeVllmEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth])  # vLLM: no limit
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        for event in (self.hold, self.hold_after_first_chunk):
            if event is not None:
                event.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        auth = request.headers.get("Authorization")
        if self.record:
            self.authorizations.append((request.path, auth))
        if self.api_key is not None and request.path.startswith("/v1") and auth != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _health(self, _: web.Request) -> web.Response:
        if self.health_hold is not None:
            await self.health_hold.wait()
        headers = {"X-Dllm-Kv-Fingerprint": self.fingerprint} if self.fingerprint is not None else None
        return web.Response(status=200 if self.healthy else 503, headers=headers)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = Seen(request.path, body, CIMultiDict(request.headers))
        if self.record:
            self.seen.append(seen)
        self.arrived.set()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.fail_status is not None and self.fail_next != 0:
                if self.fail_next is not None:
                    self.fail_next -= 1
                error = {"message": f"{self.name} refuses", "type": "BadRequestError", "param": None}
                return web.json_response(
                    {"error": {**error, "code": self.fail_status}}, status=self.fail_status
                )
            if seen.is_prefill:
                answer = web.json_response(self._prefill_answer(seen))
                seen.answered_at = time.monotonic()
                return answer
            if body.get("stream"):
                return await self._stream(request, seen)
            whole = self._answer(seen)
            if not isinstance(self.padding, bytes):
                return web.json_response(whole)
            body = json.dumps(whole).encode().replace(json.dumps(PADDING).encode(), self.padding)
            return web.Response(body=body, content_type="application/json")
        except asyncio.CancelledError:
            self.cancelled.append(request.headers.get("X-Request-Id", ""))
            self.cancelled_event.set()
            raise
        finally:
            self.active -= 1

    def _head(self, seen: Seen, chunk: bool = False) -> JsonObject:
        chat = seen.path.endswith("chat/completions")
        kind = "chat.completion" if chat else "text_completion"
        return {
            "id": f"{self.name}-{seen.headers.get('X-Request-Id', '')}",
            "object": kind + (".chunk" if chunk and chat else ""),
            "created": 1,
            "model": "fake-model",
        }

    def _choice(self, seen: Seen, index: int, text: str, finish: str | None) -> JsonObject:
        if seen.path.endswith("chat/completions"):
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def _usage(self, seen: Seen, completion: int) -> JsonObject:
        prompt = len(prompt_key(seen.body)) // 4
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _prefill_answer(self, seen: Seen) -> JsonObject:
        token = fake_tokens(prompt_key(seen.body), 1)[0]
        finish = self.prefill_finish or ("stop" if self.eos_at_prefill else "length")
        kv = None
        if self.nixl:
            kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"{self.name}-engine",
                "remote_block_ids": [[1, 2, 3]],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
        return {
            **self._head(seen),
            "choices": [self._choice(seen, 0, token, finish)],
            "usage": self._usage(seen, 1),
            "kv_transfer_params": kv,
        }

    def _count(self, seen: Seen) -> int:
        value = seen.body.get("max_completion_tokens", seen.body.get("max_tokens"))
        return int(value) if isinstance(value, int) else 16

    def _answer(self, seen: Seen) -> JsonObject:
        count, key = self._count(seen), prompt_key(seen.body)
        n = int(seen.body.get("n") or 1)
        choices = [self._choice(seen, c, "".join(fake_tokens(key, count, c)), "length") for c in range(n)]
        if self.padding and key.lstrip('["').startswith("big"):
            for choice in choices:  # bytes: JSON spliced in as it is (encoded once, not per answer)
                choice["prompt_logprobs"] = PADDING if isinstance(self.padding, bytes) else self.padding
        return {
            **self._head(seen),
            "choices": choices,
            "usage": self._usage(seen, count * n),
            "kv_transfer_params": None,
        }

    def _chunk(self, seen: Seen, index: int, text: str, finish: str | None) -> bytes:
        if seen.path.endswith("chat/completions"):
            choice: JsonObject = {"index": index, "delta": {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return (
            b"data: " + json.dumps({**self._head(seen, chunk=True), "choices": [choice]}).encode() + b"\n\n"
        )

    async def _stream(self, request: web.Request, seen: Seen) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count, key = self._count(seen), prompt_key(seen.body)
        n = int(seen.body.get("n") or 1)
        for i in range(count):
            for c in range(n):
                finish = "length" if i == count - 1 else None
                await response.write(self._chunk(seen, c, fake_tokens(key, count, c)[i], finish))
            if i == 0 and self.hold_after_first_chunk is not None:
                await self.hold_after_first_chunk.wait()
            if i == 0 and self.break_after_first_chunk:
                assert request.transport is not None
                request.transport.close()
                return response
        options = seen.body.get("stream_options") or {}
        if options.get("include_usage"):
            usage = {**self._head(seen, chunk=True), "choices": [], "usage": self._usage(seen, count * n)}
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class FakeBootstrapServer:
    """TEST DOUBLE of vLLM's MooncakeBootstrapServer: GET /query lists engine ids by data-parallel rank."""

    def __init__(self, engine_ids: list[str]) -> None:
        self.engine_ids = engine_ids
        self.up = True
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> FakeBootstrapServer:
        app = web.Application()
        app.router.add_get("/query", self._query)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _query(self, _: web.Request) -> web.Response:
        if not self.up:
            return web.Response(status=503)
        entries = {
            str(rank): {"engine_id": eid, "worker_addr": {"0": {"0": f"127.0.0.1:{17000 + rank}"}}}
            for rank, eid in enumerate(self.engine_ids)
        }
        return web.json_response(entries)
