"""The router's KV check (kv_check.py) against TEST DOUBLES of the engines (router_engine_double.py;
decode with dllm-serve's end and record routes): what the canary sends, that it counts in no user
metric, the verdict and where it shows (GET /dllm/kv-check, /metrics), ending the transfer when a call
fails, and which pair is checked when. The real engines' answers are in e2e/dataplane/test_kv_check.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from router_engine_double import FakeVllmEngine
from router_harness import RouterFactory, RunningRouter
from test_router_end_transfer import KEY, EndRouteEngineDouble

from dllm_router.kv_check import REQUEST_PREFIX

LOADED = {"state": "loaded", "reason": "", "blocks": 1, "kv_bytes": 4096, "wire_bytes": 4096,
          "seconds": 0.01, "transport": "mooncake (tcp)", "ranks": 1}  # fmt: skip
INTERVAL_S = 60.0


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeVllmEngine, EndRouteEngineDouble]]:
    p = await FakeVllmEngine("p0").start()
    d = await EndRouteEngineDouble("d0").start()
    p.api_key = d.api_key = KEY
    d.record_answer = dict(LOADED)
    yield p, d
    await p.stop()
    await d.stop()


async def checking_router(start_router: RouterFactory, p: FakeVllmEngine, d: FakeVllmEngine) -> RunningRouter:
    r = await start_router("dllm", [p], [d], engine_api_key=KEY, kv_check_interval_s=INTERVAL_S)
    assert r.router.kv_check.enabled
    return r


async def kv_check_page(r: RunningRouter) -> dict[str, Any]:
    async with r.client.get(r.url + "/dllm/kv-check") as answer:
        assert answer.status == 200
        return dict(await answer.json())


async def test_a_canary_moves_through_the_pair_under_one_transfer_id_and_is_verified(
    engines: tuple[FakeVllmEngine, EndRouteEngineDouble], start_router: RouterFactory
) -> None:
    p, d = engines
    r = await checking_router(start_router, p, d)
    pair = r.router.kv_check.due()
    assert pair is not None
    verdict = await r.router.kv_check.check(*pair)
    assert verdict.reason == "Verified"
    [prefill_call], [decode_call] = p.generations, d.generations
    tid = prefill_call.kv["transfer_id"]
    assert decode_call.kv["transfer_id"] == tid
    assert prefill_call.kv["decode_host"] == "127.0.0.1"
    assert prefill_call.headers["X-Request-Id"].startswith(REQUEST_PREFIX + "-")
    assert prefill_call.headers["Authorization"] == decode_call.headers["Authorization"] == f"Bearer {KEY}"
    assert prefill_call.body["model"] == "fake-model"  # what decode serves
    assert [body for body, _ in d.records_asked] == [{"transfer_id": tid}]
    assert d.ends == []  # nothing failed: nothing to end
    page = await kv_check_page(r)
    assert page["reason"] == "Verified"
    assert [(x["prefill"], x["decode"], x["reason"]) for x in page["pairs"]] == [
        (f"127.0.0.1:{p.port}", f"127.0.0.1:{d.port}", "Verified")
    ]
    async with r.client.get(r.url + "/metrics") as answer:
        text = await answer.text()
    labels = f'decode="127.0.0.1:{d.port}",prefill="127.0.0.1:{p.port}",reason="Verified"'
    assert f"dllm_router_kv_check{{{labels}}} 1.0" in text
    assert 'dllm_router_kv_checks_total{reason="Verified"} 1.0' in text
    assert "dllm_router_requests_total{" not in text  # the canary is no user request
    # what it added to the engines' own counters, so a reader can tell it from users' traffic
    totals = r.router.kv_check.engine_totals
    decode, prefill = f"127.0.0.1:{d.port}", f"127.0.0.1:{p.port}"
    assert totals[("prefill", prefill, "requests")] == totals[("decode", decode, "requests")] == 1
    assert totals[("decode", decode, "kv_bytes")] == totals[("decode", decode, "wire_bytes")] == 4096
    assert totals[("decode", decode, "loaded_tokens")] > 0
    assert f'dllm_router_kv_check_engine_total{{kind="kv_bytes",pod="{decode}",role="decode"}} 4096.0' in text
    assert r.router.metrics.prefill_seconds.counts == [0] * len(r.router.metrics.prefill_seconds.counts)


async def test_a_decode_that_fails_gets_the_transfer_ended_and_the_pair_fails_with_decodes_reason(
    engines: tuple[FakeVllmEngine, EndRouteEngineDouble], start_router: RouterFactory
) -> None:
    p, d = engines
    r = await checking_router(start_router, p, d)
    d.fail_status = 500
    d.record_answer = {
        "state": "failed",
        "reason": "KV load failed: layout differs",
        "transport": "mooncake (tcp)",
    }
    pair = r.router.kv_check.due()
    assert pair is not None
    verdict = await r.router.kv_check.check(*pair)
    [(end_body, _)] = d.ends
    assert ("decode", f"127.0.0.1:{d.port}", "kv_bytes") not in r.router.kv_check.engine_totals
    assert end_body == {"transfer_id": p.generations[0].kv["transfer_id"]}
    assert verdict.reason == "TransferFailed"
    assert verdict.message.startswith(
        "decode's connector failed the load: KV load failed: layout differs (decode"
    )
    assert (await kv_check_page(r))["reason"] == "TransferFailed"


async def test_each_pair_is_checked_when_new_then_once_per_interval_and_forgotten_when_gone(
    engines: tuple[FakeVllmEngine, EndRouteEngineDouble], start_router: RouterFactory
) -> None:
    p, d = engines
    r = await checking_router(start_router, p, d)
    check = r.router.kv_check
    now = [1000.0]
    check._clock = lambda: now[0]
    assert (await kv_check_page(r))["reason"] == "NoCompletePair"  # none checked yet
    pair = check.due()
    assert pair is not None
    await check.check(*pair)
    assert check.due() is None  # checked: not due again before the interval
    now[0] += INTERVAL_S - 1
    assert check.due() is None
    now[0] += 1
    assert check.due() == pair
    pair[1].healthy = False  # decode left the ready set: its pair is no more
    assert check.due() is None
    assert check.verdicts == {}
    assert (await kv_check_page(r))["reason"] == "NoCompletePair"


async def test_off_by_default_and_for_vllms_own_connectors(
    engines: tuple[FakeVllmEngine, EndRouteEngineDouble], start_router: RouterFactory
) -> None:
    p, d = engines
    assert not (await start_router("dllm", [p], [d], engine_api_key=KEY)).router.kv_check.enabled
    nixl = await start_router("nixl", [p], [d], engine_api_key=KEY, kv_check_interval_s=INTERVAL_S)
    assert not nixl.router.kv_check.enabled
    assert (await kv_check_page(nixl))["enabled"] is False


async def test_an_engine_answer_past_the_bound_is_not_read_and_fails_the_check(
    engines: tuple[FakeVllmEngine, EndRouteEngineDouble], start_router: RouterFactory
) -> None:
    """An engine's answer is read, never trusted: a record of a megabyte is cut at the bound."""
    p, d = engines
    r = await checking_router(start_router, p, d)
    d.record_answer = dict(LOADED) | {"reason": "x" * (1 << 20)}
    pair = r.router.kv_check.due()
    assert pair is not None
    verdict = await r.router.kv_check.check(*pair)
    assert (verdict.reason, verdict.message) == (
        "TransferFailed",
        "decode's record of the transfer could not be read",
    )
