"""Failure behaviour over real HTTP: no pods, engine errors, disconnects, retries, timeouts."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from router_engine_double import expected_text
from router_harness import EngineFactory, RouterFactory, wait_event, wait_until

from dllm_router.errors import as_error
from dllm_router.openai import CHAT, COMPLETIONS

pytestmark = pytest.mark.timeout(20)


def error_of(text: str) -> dict[str, object]:
    error = json.loads(text)["error"]
    assert set(error) >= {"message", "type", "code"}
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_no_ready_pod_is_503_naming_the_role(
    engines: EngineFactory, start_router: RouterFactory, role: str
) -> None:
    p, d = await engines("p0"), await engines("d0")
    (p if role == "prefill" else d).healthy = False
    r = await start_router("dllm", [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert status == 503
    assert error_of(text)["message"] == f"no ready {role} pod"
    async with r.client.get(r.url + "/ready") as resp:
        assert resp.status == 503
        assert role in (await resp.text())
    async with r.client.get(r.url + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "degraded"


async def test_unhealthy_pod_is_taken_out_and_put_back(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    r = await start_router("dllm", [p], [d0, d1])
    d0.healthy = False
    await r.router.check_health()
    for _ in range(4):
        assert (await r.text_of(COMPLETIONS, {"prompt": "x"}))[0] == 200
    assert (len(d0.generations), len(d1.generations)) == (0, 4)
    d0.healthy = True
    await r.router.check_health()
    for _ in range(4):
        await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert len(d0.generations) == 2


@pytest.mark.parametrize("flow", ["dllm", "nixl"])
async def test_prefill_error_reaches_client_and_decode_is_cancelled(
    engines: EngineFactory, start_router: RouterFactory, flow: str
) -> None:
    p, d = await engines("p0", nixl=flow == "nixl"), await engines("d0")
    p.fail_status = 400
    d.hold = asyncio.Event()  # decode waits for KV that never comes
    r = await start_router(flow, [p], [d])
    status, text = await r.text_of(CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 400
    assert error_of(text)["message"] == "p0 refuses"
    if flow == "dllm":
        await wait_event(d.cancelled_event, "decode cancelled")
    else:
        assert d.generations == []
    assert r.router.metrics.errors["prefill_error"] == 1
    await wait_until(lambda: all(ep.inflight == 0 for ep in r.router.decode.endpoints.values()), "inflight 0")


async def test_decode_error_reaches_client(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.fail_status = 500
    r = await start_router("dllm", [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x", "stream": True})
    assert status == 500  # the one retry (the only pair again) failed too: decode's own error
    assert error_of(text)["message"] == "d0 refuses"
    assert r.router.metrics.errors["decode_error"] == 1
    assert (r.router.metrics.retries, len(d.generations)) == (1, 2)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_a_server_error_before_any_byte_is_retried_and_the_client_sees_the_answer(
    engines: EngineFactory, start_router: RouterFactory, stream: bool, failing: str
) -> None:
    """Issue 31: decode answers 500 when its KV load failed (a prefill that stalled past the transfer
    timeout); nothing reached the client, so the router tries the prompt again and answers it."""
    p, d = await engines("p0"), await engines("d0")
    engine = p if failing == "prefill" else d
    engine.fail_status, engine.fail_next = 500, 1
    r = await start_router("dllm", [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x", "stream": stream})
    assert status == 200, text
    assert "error" not in text
    assert r.router.metrics.retries == 1
    assert r.router.metrics.errors.get(f"{failing}_error", 0) == 0


async def test_a_client_error_is_not_retried(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.fail_status, d.fail_next = 400, 1
    r = await start_router("dllm", [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert (status, error_of(text)["message"]) == (400, "d0 refuses")
    assert (r.router.metrics.retries, len(d.generations)) == (0, 1)


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_cancels_both_upstream_requests(
    engines: EngineFactory, start_router: RouterFactory, stream: bool
) -> None:
    p, d = await engines("p0"), await engines("d0")
    p.hold, d.hold = asyncio.Event(), asyncio.Event()
    r = await start_router("dllm", [p], [d])
    task = asyncio.create_task(r.text_of(COMPLETIONS, {"prompt": "bye", "stream": stream}))
    await wait_event(p.arrived, "prefill request")
    await wait_event(d.arrived, "decode request")
    task.cancel()  # the client goes away
    await asyncio.gather(task, return_exceptions=True)
    await wait_event(p.cancelled_event, "prefill cancelled")
    await wait_event(d.cancelled_event, "decode cancelled")
    await wait_until(lambda: r.router.metrics.errors["client_disconnect"] == 1, "disconnect counted")
    pods = [*r.router.prefill.endpoints.values(), *r.router.decode.endpoints.values()]
    await wait_until(lambda: all(ep.inflight == 0 for ep in pods), "inflight back to 0")


async def test_client_disconnect_mid_stream_cancels_decode(
    engines: EngineFactory, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.hold_after_first_chunk = asyncio.Event()
    r = await start_router("dllm", [p], [d])
    resp = await r.post(COMPLETIONS, {"prompt": "long", "max_tokens": 50, "stream": True})
    first = await resp.content.readany()
    assert first.startswith(b"data: ")
    resp.close()  # drop the connection after the first chunk
    await wait_event(d.cancelled_event, "decode cancelled")
    await wait_until(lambda: r.router.metrics.errors["client_disconnect"] == 1, "disconnect counted")


async def test_unreachable_pod_is_retried_elsewhere_and_taken_out(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p0, p1, d = await engines("p0"), await engines("p1"), await engines("d0")
    r = await start_router("dllm", [p0, p1], [d])
    await p0.stop()  # dies after passing its health check: connections are refused now
    results = [await r.text_of(COMPLETIONS, {"prompt": f"r{i}", "max_tokens": 2}) for i in range(4)]
    assert [s for s, _ in results] == [200] * 4
    assert [json.loads(t)["choices"][0]["text"] for _, t in results] == [
        expected_text(f"r{i}", 2) for i in range(4)
    ]
    assert len(p1.generations) == 4
    # p0 is picked first (a tie goes to the first pod), refuses, and is taken out: one retry, no more
    assert r.router.metrics.retries == 1
    assert not r.router.prefill.endpoints[("127.0.0.1", p0.port)].healthy


async def test_no_retry_once_bytes_reached_the_client(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    for d in (d0, d1):
        d.break_after_first_chunk, d.hold_after_first_chunk = True, asyncio.Event()
    r = await start_router("dllm", [p], [d0, d1])
    async with await r.post(COMPLETIONS, {"prompt": "x", "max_tokens": 5, "stream": True}) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first[6:])["choices"][0]["text"] == expected_text("x", 1)
        for d in (d0, d1):
            d.hold_after_first_chunk.set()  # type: ignore[union-attr]  # now the decode pod breaks
        rest = (await resp.content.read()).decode()
    [event] = [line for line in rest.split("\n") if line.startswith("data: ")]
    assert json.loads(event[6:])["error"]["type"] == "stream_broken"
    assert len(d0.generations) + len(d1.generations) == 1
    assert r.router.metrics.retries == 0
    assert r.router.metrics.errors["stream_broken"] == 1


async def test_all_pods_refusing_ends_in_503_no_ready_pod(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d], retries=2)
    await d.stop()
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    # the refusing pod is taken out, so the retry finds no ready decode pod (502 is a pod that accepts
    # and drops: test_router_fastpath's test_only_pod_dropping_connections_is_502_after_the_retry)
    assert (status, error_of(text)["type"]) == (503, "no_decode")
    assert "decode" in str(error_of(text)["message"])
    assert r.router.metrics.retries == 1


async def test_upstream_timeout_is_504(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.hold = asyncio.Event()
    r = await start_router("dllm", [p], [d], request_timeout_s=0.3)
    status, text = await r.text_of(COMPLETIONS, {"prompt": "slow"})
    assert status == 504
    assert error_of(text)["type"] == "timeout"
    await wait_event(d.cancelled_event, "timed-out decode cancelled")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "request body is not JSON"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b'{"max_tokens": 3}', "'prompt' is required"),
        (b'{"prompt": "x", "n": 0}', "'n' must be a positive integer"),
    ],
)
async def test_bad_request_is_400(
    engines: EngineFactory, start_router: RouterFactory, body: bytes, message: str
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    async with r.client.post(r.url + COMPLETIONS, data=body) as resp:
        assert resp.status == 400
        assert str(error_of(await resp.text())["message"]).startswith(message)
    assert p.generations == d.generations == []


async def test_chat_without_messages_is_400(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    status, text = await r.text_of(CHAT, {"prompt": "x"})
    assert status == 400
    assert error_of(text)["message"] == "'messages' must be a list"


async def test_body_over_the_limit_is_413(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d], max_body_mb=1)
    async with r.client.post(r.url + COMPLETIONS, data=b" " * (1024 * 1024 + 1)) as resp:
        assert resp.status == 413
        assert error_of(await resp.text())["message"] == "request body over 1 MiB (--max-body-mb)"


def test_an_upstream_error_that_is_not_json_is_not_echoed_to_the_client() -> None:
    """L5: a pod's non-JSON error page (a proxy's, a traceback) reaches the client only as its size."""
    page = b"<html>Traceback (most recent call last): secret-internal-path</html>"
    body = json.loads(as_error(page))
    assert body["error"]["type"] == "upstream_error"
    assert b"secret" not in as_error(page)
    assert str(len(page)) in body["error"]["message"]
    assert as_error(b'{"error": {"message": "vLLM said"}}') == b'{"error": {"message": "vLLM said"}}'
