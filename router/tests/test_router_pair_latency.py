"""Latencies per prefill/decode pair on the router's /metrics (pair_latency.py), through TEST DOUBLES of
the engines (router_engine_double.py): each of a request's observations lands under its pair, on the
fast path and the coroutine path, streamed answers add inter-token times, and a pair whose pod left
is dropped."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from router_engine_double import FakeVllmEngine
from router_harness import RouterFactory, RunningRouter


async def pair_counts(r: RunningRouter) -> dict[tuple[str, str, str], float]:
    """(metric, prefill, decode) -> its histogram's count."""
    async with r.client.get(r.url + "/metrics") as answer:
        text = await answer.text()
    return {
        (point.name.removesuffix("_count"), point.labels["prefill"], point.labels["decode"]): point.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("dllm_router_pair_")
        for point in family.samples
        if point.name.endswith("_count")
    }


async def test_each_request_is_timed_under_its_pair_on_both_paths_and_streams_add_inter_token_times(
    start_router: RouterFactory,
) -> None:
    p = await FakeVllmEngine("p0").start()
    d1, d2 = await FakeVllmEngine("d1").start(), await FakeVllmEngine("d2").start()
    try:
        r = await start_router("dllm", [p], [d1, d2])
        for _ in range(2):  # least outstanding: one request to each decode
            status, text = await r.text_of("/v1/completions", {"prompt": "fast", "max_tokens": 4})
            assert status == 200, text
        # the stream's first event, then the rest after a pause: the later events are inter-token times
        for d in (d1, d2):
            d.hold_after_first_chunk = asyncio.Event()
        streamed = {"prompt": "s", "max_tokens": 6, "stream": True}
        async with await r.post("/v1/completions", streamed) as answer:
            assert answer.status == 200
            assert (await answer.content.readline()).startswith(b"data: ")
            for d in (d1, d2):
                assert d.hold_after_first_chunk is not None
                d.hold_after_first_chunk.set()
            await answer.read()
        counts = await pair_counts(r)
        pairs = [(f"127.0.0.1:{p.port}", f"127.0.0.1:{d.port}") for d in (d1, d2)]
        for kind in ("prefill", "decode_first_byte", "ttft"):
            served = [counts[(f"dllm_router_pair_{kind}_seconds", *pair)] for pair in pairs]
            assert sorted(served) == [1.0, 2.0], (kind, counts)  # three requests over the two pairs
        inter_token = [counts[("dllm_router_pair_inter_token_seconds", *pair)] for pair in pairs]
        assert min(inter_token) == 0  # the non-streamed request's pair has none of its own
        assert max(inter_token) >= 5  # the stream's events after its first
        # a decode pod that leaves takes its pair's series with it
        r.router.decode.update([("127.0.0.1", d1.port)])
        left = {(prefill, decode) for _, prefill, decode in await pair_counts(r)}
        assert left == {(pairs[0][0], pairs[0][1])}
    finally:
        for engine in (p, d1, d2):
            await engine.stop()
