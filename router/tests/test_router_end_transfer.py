"""Security review M2, the router's half: when decode fails a dllm-flow prompt after prefill may have
run, the router tells that decode pod to end the prompt's transfer id (POST /v1/dllm/end_transfer), in
the background, so prefill's sender stops holding the blocks; on both request paths.

Over real HTTP, with the engine doubles of router_engine_double.py; `EndRouteEngineDouble` adds the
end route dllm_connector.end_route serves on a real decode engine (tested there against a real
side channel).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from router_engine_double import FakeVllmEngine
from router_harness import RouterFactory, RunningRouter, wait_event, wait_until

from dllm_router import transfer_end
from dllm_router.openai import COMPLETIONS

pytestmark = pytest.mark.timeout(30)

KEY = "engine-key-for-the-end-route"
END_PATH = "/v1/dllm/end_transfer"
RECORD_PATH = "/v1/dllm/transfer_record"
# The fast path takes a non-streamed single prompt; a stream, or several prompts, the coroutine path.
PATHS = {
    "fast": {"prompt": "tell me", "max_tokens": 4},
    "coroutine": {"prompt": "tell me", "max_tokens": 4, "stream": True},
}


class EndRouteEngineDouble(FakeVllmEngine):
    """TEST DOUBLE of a decode engine with dllm-serve's end and record routes: records each end's body
    and Authorization, and each record asked. Knobs: `end_status` (the answer), `end_hold` (an Event
    every end waits on), `record_answer` (the record route's JSON, with the asked transfer id)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.ends: list[tuple[JsonBody, str | None]] = []
        self.end_arrived = asyncio.Event()
        self.end_status = 204
        self.end_hold: asyncio.Event | None = None
        self.record_answer: JsonBody = {"state": "unknown"}
        self.records_asked: list[tuple[JsonBody, str | None]] = []

    async def start(self, port: int = 0) -> EndRouteEngineDouble:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post(END_PATH, self._end)
        app.router.add_post(RECORD_PATH, self._record)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.end_hold is not None:
            self.end_hold.set()
        await super().stop()

    async def _end(self, request: web.Request) -> web.Response:
        self.ends.append((await request.json(), request.headers.get("Authorization")))
        self.end_arrived.set()
        if self.end_hold is not None:
            await self.end_hold.wait()
        return web.Response(status=self.end_status)

    async def _record(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.records_asked.append((body, request.headers.get("Authorization")))
        return web.json_response({"transfer_id": body["transfer_id"], **self.record_answer})


JsonBody = dict[str, Any]


@pytest.fixture
async def pair() -> Any:
    made: list[FakeVllmEngine] = []

    async def make() -> tuple[FakeVllmEngine, EndRouteEngineDouble]:
        p = await FakeVllmEngine("p0").start()
        d = await EndRouteEngineDouble("d0").start()
        p.api_key = d.api_key = KEY
        made.extend((p, d))
        return p, d

    yield make
    for engine in made:
        await engine.stop()


async def _router(
    start_router: RouterFactory, p: FakeVllmEngine, d: FakeVllmEngine, flow: str = "dllm"
) -> RunningRouter:
    return await start_router(flow, [p], [d], engine_api_key=KEY)


def _decode_tid(d: FakeVllmEngine) -> str:
    [call] = d.generations
    tid = call.kv["transfer_id"]
    assert isinstance(tid, str)
    return tid


def _ends(r: RunningRouter) -> dict[str, int]:
    return {k: v for k, v in r.router.metrics.transfer_ends.items() if v}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("order", ["prefill_first", "decode_first"])
async def test_a_decode_400_after_prefill_ends_the_transfer_once(
    pair: Any, start_router: RouterFactory, path: str, order: str
) -> None:
    p, d = await pair()
    d.fail_status = 400
    d.end_hold = asyncio.Event()  # the end is not answered until the client has its answer
    if order == "prefill_first":
        d.hold = asyncio.Event()
    else:
        p.hold = asyncio.Event()
    r = await _router(start_router, p, d)
    task = asyncio.create_task(r.text_of(COMPLETIONS, PATHS[path]))
    if order == "prefill_first":
        await wait_until(lambda: len(p.generations) == 1 and p.active == 0, "prefill answered")
        assert d.hold is not None
        d.hold.set()
    status, text = await asyncio.wait_for(task, 10)
    assert status == 400  # decode's answer, while the end is still unanswered
    assert json.loads(text)["error"]["message"] == "d0 refuses"
    await wait_event(d.end_arrived, "the end")
    [(body, authorization)] = d.ends
    assert body == {"transfer_id": _decode_tid(d)}
    assert p.generations[0].kv["transfer_id"] == body["transfer_id"]  # the id prefill sends under
    assert authorization == f"Bearer {KEY}"
    assert d.end_hold is not None
    d.end_hold.set()
    if p.hold is not None:
        p.hold.set()
    await wait_until(lambda: _ends(r) == {"sent": 1}, "the end counted as sent")
    await wait_until(lambda: r.router.transfer_ends.in_flight == 0, "no end in flight")
    assert len(d.ends) == 1


@pytest.mark.parametrize("path", PATHS)
async def test_a_decode_that_answers_gets_no_end(pair: Any, start_router: RouterFactory, path: str) -> None:
    p, d = await pair()
    r = await _router(start_router, p, d)
    status, _ = await r.text_of(COMPLETIONS, PATHS[path])
    assert status == 200
    assert r.router.transfer_ends.in_flight == 0  # an end would have been started before the answer
    assert _ends(r) == {}
    assert d.ends == []


@pytest.mark.parametrize("path", PATHS)
async def test_a_prefill_that_refused_sends_nothing_to_end(
    pair: Any, start_router: RouterFactory, path: str
) -> None:
    p, d = await pair()
    p.fail_status = 400
    d.hold = asyncio.Event()
    r = await _router(start_router, p, d)
    status, _ = await r.text_of(COMPLETIONS, PATHS[path])
    assert status == 400
    assert r.router.transfer_ends.in_flight == 0
    assert d.ends == []


@pytest.mark.parametrize("path", PATHS)
async def test_a_client_that_leaves_before_decode_answers_ends_the_transfer(
    pair: Any, start_router: RouterFactory, path: str
) -> None:
    p, d = await pair()
    d.hold = asyncio.Event()  # decode waits; prefill has answered
    r = await _router(start_router, p, d)
    task = asyncio.create_task(r.text_of(COMPLETIONS, PATHS[path]))
    await wait_event(d.arrived, "decode request")
    await wait_until(lambda: len(p.generations) == 1 and p.active == 0, "prefill answered")
    task.cancel()  # the client goes away
    await asyncio.gather(task, return_exceptions=True)
    await wait_event(d.end_arrived, "the end")
    assert d.ends == [({"transfer_id": _decode_tid(d)}, f"Bearer {KEY}")]
    await wait_until(lambda: _ends(r) == {"sent": 1}, "the end counted")


async def test_a_decode_timeout_ends_the_transfer(pair: Any, start_router: RouterFactory) -> None:
    p, d = await pair()
    d.hold = asyncio.Event()
    r = await start_router("dllm", [p], [d], engine_api_key=KEY, request_timeout_s=0.5)
    status, _ = await r.text_of(COMPLETIONS, PATHS["fast"])
    assert status == 504
    await wait_event(d.end_arrived, "the end")
    assert d.ends[0][0] == {"transfer_id": _decode_tid(d)}


async def test_an_end_decode_refuses_is_counted_failed_and_shown(
    pair: Any, start_router: RouterFactory
) -> None:
    p, d = await pair()
    d.fail_status, d.end_status = 400, 502
    r = await _router(start_router, p, d)
    status, _ = await r.text_of(COMPLETIONS, PATHS["fast"])
    assert status == 400
    await wait_until(lambda: _ends(r) == {"failed": 1}, "the end counted as failed")
    async with r.client.get(r.url + "/metrics") as page:
        text = await page.text()
    assert 'dllm_router_transfer_ends_total{outcome="failed"} 1.0' in text
    assert 'dllm_router_transfer_ends_total{outcome="sent"} 0.0' in text


async def test_ends_beyond_the_bound_are_dropped_and_counted(
    pair: Any, start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfer_end, "MAX_IN_FLIGHT", 1)
    p, d = await pair()
    d.fail_status = 400
    d.end_hold = asyncio.Event()  # the first end stays in flight
    r = await _router(start_router, p, d)
    for _ in range(3):
        status, _ = await r.text_of(COMPLETIONS, PATHS["fast"])
        assert status == 400  # every client answered at once
    await wait_event(d.end_arrived, "the first end")
    assert r.router.transfer_ends.in_flight == 1
    assert _ends(r) == {"dropped": 2}
    d.end_hold.set()
    await wait_until(lambda: _ends(r) == {"dropped": 2, "sent": 1}, "the first end answered")


@pytest.mark.parametrize("flow", ["nixl", "mooncake"])
async def test_vllms_own_connectors_get_no_end(
    pair: Any, start_router: RouterFactory, flow: str, bootstrap: Any
) -> None:
    p, d = await pair()
    p.nixl = flow == "nixl"
    d.fail_status = 400
    overrides: dict[str, Any] = {}
    if flow == "mooncake":
        server = await bootstrap(["engine-0"])
        overrides["mooncake_bootstrap_port"] = server.port
    r = await start_router(flow, [p], [d], engine_api_key=KEY, **overrides)
    for body in PATHS.values():
        status, _ = await r.text_of(COMPLETIONS, body)
        assert status == 400
    assert r.router.transfer_ends.in_flight == 0
    assert d.ends == []
