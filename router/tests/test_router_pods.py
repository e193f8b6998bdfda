"""Pods coming and going, least-outstanding balancing, concurrency, metrics: real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_engine_double import expected_text
from router_harness import EngineFactory, MutableSource, RouterFactory, wait_until

from dllm_router.config import Upstreams
from dllm_router.endpoints import DnsSource
from dllm_router.openai import COMPLETIONS

pytestmark = pytest.mark.timeout(30)


async def test_pod_added_gets_traffic_and_removed_pod_gets_none(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    decode = MutableSource([d0])
    r = await start_router("dllm", [p], [], decode_source=decode)
    assert (await r.text_of(COMPLETIONS, {"prompt": "a"}))[0] == 200
    assert len(d0.generations) == 1

    decode.add(d1)
    await r.router.discover()
    for i in range(4):
        assert (await r.text_of(COMPLETIONS, {"prompt": f"b{i}"}))[0] == 200
    assert (len(d0.generations), len(d1.generations)) == (3, 2)  # idle pods share sequential load

    decode.remove(d0)
    await r.router.discover()
    for i in range(3):
        assert (await r.text_of(COMPLETIONS, {"prompt": f"c{i}"}))[0] == 200
    assert (len(d0.generations), len(d1.generations)) == (3, 5)

    decode.remove(d1)
    await r.router.discover()
    status, text = await r.text_of(COMPLETIONS, {"prompt": "d"})
    assert status == 503
    assert json.loads(text)["error"]["message"] == "no ready decode pod"


async def test_new_pod_joins_only_after_its_health_check(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    d1.healthy = False
    decode = MutableSource([d0])
    r = await start_router("dllm", [p], [], decode_source=decode)
    decode.add(d1)
    await r.router.discover()
    for _ in range(3):
        await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert len(d1.generations) == 0


async def test_least_outstanding_pod_is_chosen(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    hold = asyncio.Event()
    d0.hold = d1.hold = hold
    r = await start_router("dllm", [p], [d0, d1])
    stuck = asyncio.create_task(r.text_of(COMPLETIONS, {"prompt": "stuck"}))
    await wait_until(lambda: len(d0.generations) + len(d1.generations) == 1, "first request at a decode pod")
    busy, idle = (d0, d1) if d0.generations else (d1, d0)
    idle.hold = None  # the busy pod keeps its one request outstanding
    for i in range(3):
        assert (await r.text_of(COMPLETIONS, {"prompt": f"q{i}"}))[0] == 200
    assert len(idle.generations) == 3
    assert len(busy.generations) == 1
    hold.set()
    assert (await stuck)[0] == 200


async def test_200_requests_at_concurrency_50_none_lost_none_duplicated(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    prefill = [await engines(f"p{i}") for i in range(2)]
    decode = [await engines(f"d{i}") for i in range(2)]
    r = await start_router("dllm", prefill, decode)
    gate = asyncio.Semaphore(50)

    async def one(i: int) -> tuple[int, str]:
        async with gate:
            body = {"prompt": f"prompt-{i}", "max_tokens": 3, "stream": i % 2 == 0}
            return await r.text_of(COMPLETIONS, body)

    results = await asyncio.gather(*(one(i) for i in range(200)))
    for i, (status, text) in enumerate(results):
        assert status == 200
        if i % 2:
            assert json.loads(text)["choices"][0]["text"] == expected_text(f"prompt-{i}", 3)
        else:
            pieces = [json.loads(x[6:]) for x in text.split("\n") if x.startswith("data: {")]
            assert "".join(c["text"] for x in pieces for c in x["choices"]) == expected_text(f"prompt-{i}", 3)
    prefill_seen = [s for e in prefill for s in e.generations]
    decode_seen = [s for e in decode for s in e.generations]
    assert Counter(s.body["prompt"] for s in prefill_seen) == Counter(f"prompt-{i}" for i in range(200))
    assert Counter(s.body["prompt"] for s in decode_seen) == Counter(f"prompt-{i}" for i in range(200))
    assert len({s.kv["transfer_id"] for s in prefill_seen}) == 200
    assert all(len(e.generations) > 40 for e in (*prefill, *decode))  # both pods of each role worked
    pods = [*r.router.prefill.endpoints.values(), *r.router.decode.endpoints.values()]
    assert all(ep.inflight == 0 for ep in pods)
    assert r.router.metrics.requests[(COMPLETIONS, 200)] == 200


async def test_metrics_count_requests_errors_ttft_and_inflight(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    for _ in range(3):
        await r.text_of(COMPLETIONS, {"prompt": "m", "stream": True})
    await r.text_of(COMPLETIONS, {"prompt": "m", "n": -1})
    d.hold = asyncio.Event()
    held = asyncio.create_task(r.text_of(COMPLETIONS, {"prompt": "m"}))
    await wait_until(lambda: len(d.generations) == 4, "held request at decode")
    async with r.client.get(r.url + "/metrics") as resp:
        text = await resp.text()
    d.hold.set()
    await held
    seen = samples(text)
    assert seen["dllm_router_requests_total", (("code", "200"), ("route", "/v1/completions"))] == 3
    assert seen["dllm_router_requests_total", (("code", "400"), ("route", "/v1/completions"))] == 1
    assert seen["dllm_router_errors_total", (("kind", "bad_request"),)] == 1
    assert seen["dllm_router_errors_total", (("kind", "no_decode"),)] == 0
    assert seen["dllm_router_prefill_seconds_count", ()] == 4
    assert seen["dllm_router_decode_first_byte_seconds_count", ()] == 3
    assert seen["dllm_router_ttft_seconds_count", ()] == 3
    assert seen["dllm_router_inflight", (("pod", f"127.0.0.1:{d.port}"), ("role", "decode"))] == 1
    assert seen["dllm_router_inflight", (("pod", f"127.0.0.1:{p.port}"), ("role", "prefill"))] == 0
    assert seen["dllm_router_pod_ready", (("pod", f"127.0.0.1:{d.port}"), ("role", "decode"))] == 1
    assert "# HELP dllm_router_ttft_seconds " in text  # every family says what it counts


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The page's samples, parsed as Prometheus does: (name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_health_reports_pods_per_role(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    d1.healthy = False
    r = await start_router("nixl", [p], [d0, d1])
    async with r.client.get(r.url + "/health") as resp:
        assert await resp.json() == {
            "status": "ok",
            "flow": "nixl",
            "prefill": {"ready": 1, "pods": 1},
            "decode": {"ready": 1, "pods": 2},
        }
    async with r.client.get(r.url + "/ready") as resp:
        assert resp.status == 200


async def test_dns_discovery_drives_the_pools(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    answers: list[frozenset[str]] = [frozenset({"127.0.0.1"})]

    async def resolver(host: str) -> frozenset[str]:
        assert host == "llm-decode.serving.svc"
        return answers[-1]

    source = DnsSource("llm-decode.serving.svc", d.port, resolve=resolver)
    r = await start_router("dllm", [p], [], decode_source=source)
    assert (await r.text_of(COMPLETIONS, {"prompt": "a"}))[0] == 200
    answers.append(frozenset())  # the Service lost its last ready pod
    await r.router.discover()
    assert (await r.text_of(COMPLETIONS, {"prompt": "b"}))[0] == 503
    answers.append(frozenset({"127.0.0.1"}))
    await r.router.discover()
    assert (await r.text_of(COMPLETIONS, {"prompt": "c"}))[0] == 200
    assert [s.body["prompt"] for s in d.generations] == ["a", "c"]


async def test_real_resolver_from_the_command_line_config(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [], decode=Upstreams(dns=("localhost", d.port)))
    status, text = await r.text_of(COMPLETIONS, {"prompt": "dns", "max_tokens": 2})
    assert status == 200
    assert json.loads(text)["choices"][0]["text"] == expected_text("dns", 2)


async def test_background_loops_follow_pods_and_health(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    decode = MutableSource([d0])
    r = await start_router(
        "dllm",
        [p],
        [],
        decode_source=decode,
        resolve_interval_s=0.02,
        health_interval_s=0.02,
        background=True,
    )
    decode.add(d1)
    await wait_until(lambda: len(r.router.decode.ready()) == 2, "d1 discovered and ready")
    d0.healthy = False
    await wait_until(lambda: len(r.router.decode.ready()) == 1, "d0 taken out")
    d0.healthy = True
    await wait_until(lambda: len(r.router.decode.ready()) == 2, "d0 put back")
    decode.remove(d1)
    await wait_until(lambda: len(r.router.decode.endpoints) == 1, "d1 gone")


async def test_a_pod_whose_health_check_times_out_is_taken_out_only_after_three_in_a_row(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    """The only decode pod, busy: its /health answers past the timeout. Two late answers keep it
    serving; the third in a row takes it out, and an answer on time puts it back."""
    p, d0 = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d0], connect_timeout_s=0.05)
    d0.health_hold = asyncio.Event()  # never set until the end: every probe times out
    for probe in (1, 2):
        await r.router.pods.check_health()
        assert r.router.decode.ready() != [], f"taken out after {probe} late answer(s)"
    await r.router.pods.check_health()
    assert r.router.decode.ready() == []
    d0.health_hold = None
    await r.router.pods.check_health()
    assert len(r.router.decode.ready()) == 1
    d0.healthy = False  # a draining engine answers 503: out at once, no strikes
    await r.router.pods.check_health()
    assert r.router.decode.ready() == []


async def test_removed_pod_finishes_its_in_flight_request(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    d0.hold = asyncio.Event()
    decode = MutableSource([d0])
    r = await start_router("dllm", [p], [], decode_source=decode)
    in_flight = asyncio.create_task(r.text_of(COMPLETIONS, {"prompt": "old", "max_tokens": 2}))
    await wait_until(lambda: len(d0.generations) == 1, "request at d0")
    gone = r.router.decode.endpoints[("127.0.0.1", d0.port)]
    decode.remove(d0)
    decode.add(d1)
    await r.router.discover()  # d0 leaves the Service (scale-down) while serving
    assert (await r.text_of(COMPLETIONS, {"prompt": "new"}))[0] == 200
    assert [s.body["prompt"] for s in d1.generations] == ["new"]
    d0.hold.set()
    status, text = await in_flight
    assert status == 200
    assert json.loads(text)["choices"][0]["text"] == expected_text("old", 2)
    assert gone.upstream is not None
    assert gone.upstream.idle == 0  # its last connection was closed, not kept for a pod that left
