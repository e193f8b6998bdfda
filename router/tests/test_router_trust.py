"""What the router lets a client put into an engine call, over real HTTP against engine doubles.

C1, NEW-2: a client's own `kv_transfer_params` never reach an engine, top-level or inside
`vllm_xargs`, on any flow or path (one-token to prefill, nixl when prefill returns none, dllm, mooncake,
several prompts, streams; the fast path and the coroutine path), while its other `vllm_xargs` do. H9: mooncake
transfer ids stay unique when clients reuse X-Request-Id. Engine authentication: with
DLLM_ENGINE_API_KEY every engine call (generations, /v1/models, health probes) carries the engines'
key instead of the client's Authorization, and the key shows in no log line or metric.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from router_engine_double import FakeVllmEngine, expected_text
from router_harness import EngineFactory, RouterFactory, RunningRouter

from dllm_router.config import FLOWS, Flow
from dllm_router.openai import CHAT, COMPLETIONS

pytestmark = pytest.mark.timeout(20)

# C1's crash body and an SSRF one: a client naming the decode host prefill should push to
CLIENT_KV: dict[str, Any] = {
    "dllm": 1,
    "do_remote_decode": True,
    "do_remote_prefill": True,
    "transfer_id": "x",
    "decode_host": "evil.example",
    "decode_kv_port": 1,
}


async def pipeline(
    flow: Flow, engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, **kw: Any
) -> tuple[RunningRouter, FakeVllmEngine, FakeVllmEngine]:
    p, d = await engines("p0"), await engines("d0")  # p0 returns no kv_transfer_params, even for nixl
    boot = await bootstrap(["e0"])
    r = await start_router(flow, [p], [d], mooncake_bootstrap_port=boot.port, **kw)
    return r, p, d


# NEW-2: vLLM reads kv_transfer_params from vllm_xargs when the top-level key is absent or empty; a
# string there is what crashes vLLM's own connectors (`params.get` on a str).
XARGS = {"kv_transfer_params": "x", "keep": 1}
WHERE = ["top-level", "vllm_xargs", "both"]


def with_client_kv(body: dict[str, Any], where: str) -> dict[str, Any]:
    """The body with the client's own KV params where the case puts them."""
    if where != "vllm_xargs":
        body = {**body, "kv_transfer_params": CLIENT_KV}
    if where != "top-level":
        body = {**body, "vllm_xargs": XARGS}
    return body


def assert_no_client_kv(*pods: FakeVllmEngine, where: str = "top-level") -> None:
    bodies = [seen.body for pod in pods for seen in pod.generations]
    assert bodies, "no engine call was made"
    for body in bodies:
        kv = body.get("kv_transfer_params")
        assert kv is None or kv.get("decode_host") != "evil.example", body
        assert kv is None or kv.get("transfer_id") != "x", body
        if where != "top-level":  # the other extra args still reach the engine
            assert body["vllm_xargs"] == {"keep": 1}, body


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tokens_key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("where", WHERE)
async def test_one_token_request_reaches_prefill_without_the_clients_kv_params(
    engines: EngineFactory,
    start_router: RouterFactory,
    bootstrap: Any,
    flow: Flow,
    stream: bool,
    tokens_key: str,
    where: str,
) -> None:
    r, p, d = await pipeline(flow, engines, start_router, bootstrap)
    body = with_client_kv({"prompt": "hello there world", tokens_key: 1, "stream": stream}, where)
    status, _ = await r.text_of(COMPLETIONS, body)
    assert status == 200
    [seen] = p.generations
    assert "kv_transfer_params" not in seen.body  # the one-token path: the body goes to prefill alone
    assert seen.body["prompt"] == "hello there world"
    assert_no_client_kv(p, where=where)
    assert d.generations == []


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])  # non-streamed dllm and nixl: the fast path
@pytest.mark.parametrize("where", WHERE)
async def test_generation_carries_only_the_routers_kv_params(
    engines: EngineFactory,
    start_router: RouterFactory,
    bootstrap: Any,
    flow: Flow,
    route: str,
    stream: bool,
    where: str,
) -> None:
    r, p, d = await pipeline(flow, engines, start_router, bootstrap)
    ask: dict[str, Any] = {"prompt": "p"} if route == COMPLETIONS else {"messages": [{"role": "user"}]}
    status, _ = await r.text_of(route, with_client_kv({**ask, "max_tokens": 3, "stream": stream}, where))
    assert status == 200
    assert_no_client_kv(p, d, where=where)
    [dec] = d.generations
    if flow == "nixl":  # prefill (the double) returned no kv_transfer_params: decode gets none at all
        assert "kv_transfer_params" not in dec.body
    else:
        assert dec.kv["transfer_id"] == p.generations[0].kv["transfer_id"] != "x"


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("where", WHERE)
async def test_several_prompts_each_drop_the_clients_kv_params(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, flow: Flow, where: str
) -> None:
    r, p, d = await pipeline(flow, engines, start_router, bootstrap)
    body = with_client_kv({"prompt": ["a", "b", "c"], "max_tokens": 2}, where)
    status, _ = await r.text_of(COMPLETIONS, body)
    assert status == 200
    assert len(d.generations) == 3
    if flow == "nixl":  # prefill (the double) returned none: decode gets none at all
        assert all("kv_transfer_params" not in seen.body for seen in d.generations)
    assert_no_client_kv(p, d, where=where)


async def test_mooncake_requests_sharing_an_id_get_different_transfers(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any
) -> None:
    """H9: a retry, an SDK's constant id or a copied id never makes two requests share a transfer."""
    r, p, d = await pipeline("mooncake", engines, start_router, bootstrap)
    for _ in range(2):
        async with await r.post(COMPLETIONS, {"prompt": "q", "max_tokens": 2}, {"X-Request-Id": "same"}) as a:
            assert a.status == 200
    ids = [seen.kv["transfer_id"] for seen in d.generations]
    assert len(set(ids)) == 2
    assert [seen.kv["transfer_id"] for seen in p.generations] == ids


@pytest.mark.parametrize("flow", FLOWS)
async def test_engine_key_replaces_the_clients_authorization_everywhere(
    engines: EngineFactory,
    start_router: RouterFactory,
    bootstrap: Any,
    flow: Flow,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = "engine-secret-4f9c"
    caplog.set_level(logging.DEBUG)
    p, d = await engines("p0", nixl=flow == "nixl"), await engines("d0")
    p.api_key = d.api_key = key  # as vLLM with VLLM_API_KEY: /v1 refuses anything else
    boot = await bootstrap(["e0"])
    r = await start_router(flow, [p], [d], mooncake_bootstrap_port=boot.port, engine_api_key=key)
    client_auth = {"Authorization": "Bearer the-clients-own"}
    for body in (
        {"prompt": "x", "max_tokens": 3},
        {"prompt": "x", "max_tokens": 3, "stream": True},
        {"prompt": ["x", "y"], "max_tokens": 2},
        {"prompt": "x", "max_tokens": 1},
    ):
        async with await r.post(COMPLETIONS, body, client_auth) as answer:
            assert answer.status == 200, await answer.text()
    async with r.client.get(r.url + "/v1/models", headers=client_auth) as models:
        assert models.status == 200
        assert (await models.json())["data"][0]["id"] == "fake-model"
    await r.router.check_health()
    seen = p.authorizations + d.authorizations
    assert {path for path, _ in seen} >= {"/v1/completions", "/v1/models", "/health"}
    assert {auth for _, auth in seen} == {f"Bearer {key}"}
    async with r.client.get(r.url + "/metrics") as metrics:
        assert key not in await metrics.text()
    assert key not in caplog.text
    assert key not in repr(r.router.config)


async def test_without_an_engine_key_the_clients_authorization_is_forwarded(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    """L5: /v1/models forwards it too (it used to drop it, so it failed once engines had a key)."""
    p, d = await engines("p0"), await engines("d0")
    p.api_key = d.api_key = "tenant-key"
    r = await start_router("dllm", [p], [d])
    auth = {"Authorization": "Bearer tenant-key"}
    async with await r.post(COMPLETIONS, {"prompt": "z", "max_tokens": 2}, auth) as answer:
        assert answer.status == 200
        assert (await answer.json())["choices"][0]["text"] == expected_text("z", 2)
    async with r.client.get(r.url + "/v1/models", headers=auth) as models:
        assert models.status == 200
    async with r.client.get(r.url + "/v1/models") as anonymous:
        assert anonymous.status == 401  # the engine's own refusal, relayed
    v1 = [auth for path, auth in p.authorizations + d.authorizations if path.startswith("/v1")]
    assert v1.count("Bearer tenant-key") == len(v1) - 1
