"""The fast path over real HTTP on 127.0.0.1: non-streamed single prompts of the nixl and dllm flows,
answered by callbacks. Each case checks what a client and the engines see (answers, errors, retries,
timeouts, cancellations, metrics, the access line) and that the fast path, or for streams, several
prompts and the mooncake flow the coroutine path, served it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from raw_client import RawClient, completion, post
from router_engine_double import FakeVllmEngine, expected_text
from router_harness import EngineFactory, MutableSource, RouterFactory, RunningRouter, wait_event, wait_until

from dllm_contract.pd_params import DecodeParams, PrefillParams
from dllm_router.histogram import Histogram
from dllm_router.openai import CHAT, COMPLETIONS
from dllm_router.server import Router

pytestmark = pytest.mark.timeout(20)
FLOWS = ["nixl", "dllm"]


async def pair(engines: EngineFactory, flow: str, *, decodes: int = 1) -> tuple[FakeVllmEngine, ...]:
    return (await engines("p0", nixl=flow == "nixl"), *[await engines(f"d{i}") for i in range(decodes)])


def error_of(text: str) -> dict[str, Any]:
    return json.loads(text)["error"]  # type: ignore[no-any-return]


def observed(hist: Histogram) -> int:
    return sum(hist.counts)


async def all_idle(router: Router) -> None:
    pods = [*router.prefill.endpoints.values(), *router.decode.endpoints.values()]
    await wait_until(lambda: all(ep.inflight == 0 for ep in pods), "in-flight counts back to 0")


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_fast_path_relays_decode_answer_with_the_request_id(
    engines: EngineFactory, start_router: RouterFactory, flow: str, route: str
) -> None:
    p, d = await pair(engines, flow)
    r = await start_router(flow, [p], [d])
    prompt: Any = "fast" if route == COMPLETIONS else [{"role": "user", "content": "fast"}]
    body = {"prompt": prompt} if route == COMPLETIONS else {"messages": prompt}
    headers = {"X-Request-Id": "fast-1", "Authorization": "Bearer k"}
    async with await r.post(route, {**body, "max_tokens": 3}, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "fast-1"
        answer = await resp.json()
    choice = answer["choices"][0]
    text = choice["text"] if route == COMPLETIONS else choice["message"]["content"]
    assert text == expected_text(prompt, 3)
    assert answer["id"] == "d0-fast-1"  # decode's own answer, as it came
    [pre], [dec] = p.generations, d.generations
    assert (pre.body["max_tokens"], pre.body["stream"], pre.body["n"]) == (1, False, 1)
    for seen in (pre, dec):
        assert (seen.headers["X-Request-Id"], seen.headers["Authorization"]) == ("fast-1", "Bearer k")
    if flow == "nixl":
        assert dec.kv["remote_engine_id"] == "p0-engine"  # what prefill returned
    else:
        pkv, dkv = PrefillParams.model_validate(pre.kv), DecodeParams.model_validate(dec.kv)
        assert pkv.transfer_id == dkv.transfer_id
    metrics = r.router.metrics
    assert metrics.fast_requests == 1
    assert metrics.requests[(route, 200)] == 1
    assert [observed(h) for h in (metrics.prefill_seconds, metrics.decode_first_byte_seconds)] == [1, 1]
    assert observed(metrics.ttft_seconds) == 1
    await all_idle(r.router)


@pytest.mark.parametrize(
    ("flow", "body"),
    [
        ("nixl", {"prompt": "s", "max_tokens": 2, "stream": True}),
        ("dllm", {"prompt": ["a", "b"], "max_tokens": 2}),
        ("mooncake", {"prompt": "m", "max_tokens": 2}),
    ],
)
async def test_streams_several_prompts_and_mooncake_take_the_coroutine_path(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, flow: str, body: dict[str, Any]
) -> None:
    p, d = await pair(engines, flow)
    boot = await bootstrap(["e0"])
    r = await start_router(flow, [p], [d], mooncake_bootstrap_port=boot.port)
    status, text = await r.text_of(COMPLETIONS, body)
    assert status == 200
    if body.get("stream"):
        assert expected_text("s", 1) in text
        assert text.endswith("data: [DONE]\n\n")
    else:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        assert [c["text"] for c in json.loads(text)["choices"]] == [expected_text(x, 2) for x in prompts]
    assert r.router.metrics.fast_requests == 0
    assert r.router.metrics.requests[(COMPLETIONS, 200)] == 1


@pytest.mark.parametrize("flow", FLOWS)
async def test_prefill_error_on_the_fast_path(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await pair(engines, flow)
    p.fail_status = 400
    d.hold = asyncio.Event()  # dllm: decode waits for KV that never comes
    r = await start_router(flow, [p], [d])
    async with await r.post(COMPLETIONS, {"prompt": "x"}, headers={"X-Request-Id": "pe"}) as resp:
        assert (resp.status, resp.headers["X-Request-Id"]) == (400, "pe")
        assert error_of(await resp.text())["message"] == "p0 refuses"
    if flow == "dllm":
        await wait_event(d.cancelled_event, "decode cancelled")
    else:
        assert d.generations == []
    metrics = r.router.metrics
    assert (metrics.fast_requests, metrics.errors["prefill_error"], metrics.requests[(COMPLETIONS, 400)]) == (
        1,
        1,
        1,
    )
    await all_idle(r.router)


@pytest.mark.parametrize("flow", FLOWS)
async def test_decode_error_on_the_fast_path(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await pair(engines, flow)
    d.fail_status = 500
    r = await start_router(flow, [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert status == 500  # retried once on the only pair, then decode's own error
    assert error_of(text)["message"] == "d0 refuses"
    assert (r.router.metrics.fast_requests, r.router.metrics.errors["decode_error"]) == (1, 1)
    assert r.router.metrics.retries == 1
    await all_idle(r.router)


@pytest.mark.parametrize("flow", FLOWS)
async def test_a_decode_server_error_is_retried_on_the_fast_path(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await pair(engines, flow)
    d.fail_status, d.fail_next = 500, 1
    r = await start_router(flow, [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert status == 200, text
    assert (r.router.metrics.fast_requests, r.router.metrics.retries) == (1, 1)
    assert r.router.metrics.errors.get("decode_error", 0) == 0
    await all_idle(r.router)


async def test_dllm_decode_answering_first_waits_for_prefill(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await pair(engines, "dllm")
    p.hold = asyncio.Event()
    r = await start_router("dllm", [p], [d])
    request = asyncio.create_task(r.text_of(COMPLETIONS, {"prompt": "late", "max_tokens": 2}))
    await wait_until(lambda: observed(r.router.metrics.decode_first_byte_seconds) == 1, "decode's answer")
    assert not request.done()  # prefill's answer decides: it could still be an error or an EOS
    p.hold.set()
    status, text = await request
    assert (status, json.loads(text)["choices"][0]["text"]) == (200, expected_text("late", 2))


@pytest.mark.parametrize("flow", FLOWS)
async def test_upstream_timeout_on_the_fast_path_is_504(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await pair(engines, flow)
    d.hold = asyncio.Event()
    r = await start_router(flow, [p], [d], request_timeout_s=0.3)
    status, text = await r.text_of(COMPLETIONS, {"prompt": "slow"})
    assert status == 504
    assert error_of(text)["type"] == "timeout"
    await wait_event(d.cancelled_event, "timed-out decode cancelled")
    assert (r.router.metrics.fast_requests, r.router.metrics.errors["timeout"]) == (1, 1)
    await all_idle(r.router)


@pytest.mark.parametrize("flow", FLOWS)
async def test_client_disconnect_on_the_fast_path_cancels_upstream(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await pair(engines, flow)
    held = d if flow == "nixl" else p  # nixl: prefill has answered, decode is in flight
    held.hold = asyncio.Event()
    if flow == "dllm":
        d.hold = asyncio.Event()
    r = await start_router(flow, [p], [d])
    c = await RawClient.to(r)
    c.send(post(completion("bye")))
    await wait_event(d.arrived, "decode request")
    c.close()  # the client goes away before the answer
    await wait_event(d.cancelled_event, "decode cancelled")
    if flow == "dllm":
        await wait_event(p.cancelled_event, "prefill cancelled")
    await wait_until(lambda: r.router.metrics.errors["client_disconnect"] == 1, "disconnect counted")
    assert r.router.metrics.fast_requests == 1
    assert r.router.metrics.requests == {}  # no answer was sent
    await all_idle(r.router)


async def test_refused_prefill_pod_is_retried_on_the_fast_path(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p0, p1, d = await engines("p0", nixl=True), await engines("p1", nixl=True), await engines("d0")
    r = await start_router("nixl", [p0, p1], [d])
    await p0.stop()  # after its health check: connections are refused now
    results = [await r.text_of(COMPLETIONS, {"prompt": f"r{i}", "max_tokens": 2}) for i in range(3)]
    assert [(s, json.loads(t)["choices"][0]["text"]) for s, t in results] == [
        (200, expected_text(f"r{i}", 2)) for i in range(3)
    ]
    assert len(p1.generations) == 3
    assert (r.router.metrics.fast_requests, r.router.metrics.retries) == (3, 1)
    assert not r.router.prefill.endpoints[("127.0.0.1", p0.port)].healthy


async def test_refused_decode_pod_is_taken_out_on_the_fast_path(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await pair(engines, "nixl")
    r = await start_router("nixl", [p], [d], retries=2)
    await d.stop()
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert (status, error_of(text)["message"]) == (503, "no ready decode pod")  # the only one is out
    assert not r.router.decode.endpoints[("127.0.0.1", d.port)].healthy
    assert (r.router.metrics.retries, r.router.metrics.errors["no_decode"]) == (1, 1)
    await all_idle(r.router)


async def dropping_pod() -> tuple[asyncio.Server, int]:
    """A TEST DOUBLE pod: healthy, but it reads each generation call and closes without an answer."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readuntil(b"\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        if line.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        else:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


async def test_pod_dropping_the_connection_is_retried_on_another(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await pair(engines, "dllm")
    dropper, port = await dropping_pod()
    source = MutableSource([d])
    source.addresses.add(("127.0.0.1", port))
    try:
        r = await start_router("dllm", [p], [d], decode_source=source)
        for pod in r.router.decode.endpoints.values():
            pod.last_pick = 0 if pod.port == port else 1  # the dropping pod is chosen first
        status, text = await r.text_of(COMPLETIONS, {"prompt": "again", "max_tokens": 2})
        assert (status, json.loads(text)["choices"][0]["text"]) == (200, expected_text("again", 2))
        assert (r.router.metrics.fast_requests, r.router.metrics.retries) == (1, 1)
        assert len(d.generations) == 1
        await all_idle(r.router)
    finally:
        dropper.close()


async def test_only_pod_dropping_connections_is_502_after_the_retry(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await pair(engines, "nixl")
    dropper, port = await dropping_pod()
    try:
        source = MutableSource([])
        source.addresses.add(("127.0.0.1", port))
        r = await start_router("nixl", [p], [d], decode_source=source)
        status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
        assert (status, error_of(text)["type"]) == (502, "decode_unreachable")
        assert (r.router.metrics.retries, r.router.metrics.errors["decode_unreachable"]) == (1, 1)
        assert len(p.generations) == 2  # each attempt's prefill call, then decode dropped
        assert r.router.decode.endpoints[("127.0.0.1", port)].healthy  # it accepted: not taken out
        await all_idle(r.router)
    finally:
        dropper.close()


@pytest.mark.parametrize("flow", FLOWS)
async def test_eos_at_prefill_on_the_fast_path_answers_without_decode(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await pair(engines, flow)
    p.eos_at_prefill = True
    d.hold = asyncio.Event()
    r = await start_router(flow, [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "eos", "max_tokens": 5})
    assert status == 200
    answer = json.loads(text)
    assert answer["choices"][0] == {
        "index": 0,
        "text": expected_text("eos", 1),
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert "kv_transfer_params" not in answer
    if flow == "dllm":
        await wait_event(d.cancelled_event, "decode cancelled")
    else:
        assert d.generations == []
    assert (r.router.metrics.fast_requests, r.router.metrics.prefill_answers) == (1, 1)
    await all_idle(r.router)


async def test_one_token_request_on_the_fast_path_goes_to_prefill_unchanged(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await pair(engines, "nixl")
    r = await start_router("nixl", [p], [d])
    raw = b'{"prompt": "one",  "max_tokens": 1}'
    async with r.client.post(r.url + COMPLETIONS, data=raw) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == expected_text("one", 1)
    [seen] = p.generations
    assert seen.body == {"prompt": "one", "max_tokens": 1}
    assert d.generations == []
    assert (r.router.metrics.fast_requests, r.router.metrics.prefill_answers) == (1, 1)


async def test_draining_server_lets_a_fast_request_finish(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await pair(engines, "nixl")
    d.hold = asyncio.Event()
    r: RunningRouter = await start_router("nixl", [p], [d])
    c = await RawClient.to(r)
    c.send(post(completion("drain")))
    await wait_event(d.arrived, "decode request")
    assert r.router.metrics.fast_requests == 1
    runner = r.server
    cleanup = asyncio.create_task(runner.cleanup(drain_s=5.0))
    await wait_until(lambda: runner.draining, "draining")
    assert not cleanup.done()  # waits for the request in flight
    d.hold.set()
    answer = await c.answer()
    assert (answer.status, answer.headers["connection"]) == (200, "close")
    await cleanup
    assert r.router.metrics.errors["client_disconnect"] == 0


async def test_a_failing_step_answers_500_and_closes_the_connection(
    engines: EngineFactory, start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a step must not leave the client waiting: 500, the connection closes, counts drop."""
    p, d = await pair(engines, "dllm")
    r = await start_router("dllm", [p], [d])

    def broken(*_: object) -> bool:
        raise RuntimeError("a bug")

    monkeypatch.setattr("dllm_router.openai.finished_at_prefill", broken)
    c = await RawClient.to(r)
    c.send(post(completion("bug")))
    answer = await c.answer()
    assert (answer.status, answer.headers["connection"]) == (500, "close")
    assert await c.closed_by_server()
    await all_idle(r.router)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "abort", "max_tokens": 5},  # the fast path
        {"prompt": "abort", "max_tokens": 5, "stream": True},  # the coroutine path
        {"prompt": ["abort", "twice"], "max_tokens": 5},  # the coroutine path, one exchange per prompt
    ],
    ids=["fast", "stream", "prompts"],
)
async def test_a_prefill_that_answers_abort_is_retried_on_another_not_waited_on(
    engines: EngineFactory, start_router: RouterFactory, body: dict[str, Any]
) -> None:
    """Issue 31: vLLM answers 200 with finish_reason "abort" for a request its engine core rejected while
    shutting down (a prefill pod being replaced). No KV comes, so decode would wait prefillWaitMs and
    answer 500; the router takes that pod out and runs the prompt on another prefill at once."""
    stopping, p1, d = await engines("p0"), await engines("p1"), await engines("d0")
    stopping.prefill_finish = "abort"
    r = await start_router("dllm", [stopping, p1], [d])
    r.router.prefill.endpoints[("127.0.0.1", p1.port)].inflight += 100  # the stopping pod is picked first
    status, text = await r.text_of(COMPLETIONS, body)
    assert status == 200, text
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    assert sorted(s.body["prompt"] for s in p1.generations) == sorted(prompts)
    assert not r.router.prefill.endpoints[("127.0.0.1", stopping.port)].healthy
    assert r.router.metrics.retries >= 1


async def test_with_every_prefill_answering_abort_the_client_gets_503_without_waiting_on_decode(
    engines: EngineFactory, start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The only prefill is taken out, so the retry finds none: 503 at once (what a client meets while no
    prefill pod is ready), not decode's 500 after prefillWaitMs."""
    p, d = await engines("p0"), await engines("d0")
    p.prefill_finish = "abort"
    d.hold = asyncio.Event()  # decode waits for KV that never comes, as the real one would
    r = await start_router("dllm", [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "abort", "max_tokens": 5})
    assert status == 503, text
    assert json.loads(text)["error"]["type"] == "no_prefill"
    assert "did not run the prompt" in caplog.text
    await wait_event(d.cancelled_event, "decode's call dropped")
