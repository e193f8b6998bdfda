"""The autoscaler's reads of metrics pages (autoscale/scrape.py) against `MetricsPageDouble`, a local
HTTP server standing in for an engine's or router's /metrics: a page is read and checked, anything
else (an error status, an oversized or non-UTF-8 body, an unreachable pod) is no page; each pod's
scrape pairs with its previous one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from e2e.ports import free_port
from page_server import serving

from dllm_operator.autoscale.scrape import MAX_METRICS_BYTES, METRICS_PATH, ScrapeMemory, read_metrics
from dllm_operator.autoscale.signals import KV_USAGE, WAITING, Page

PAGE = (
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
)


class MetricsPageDouble:
    """An engine's /metrics on 127.0.0.1 (a double: the operator only reads it)."""

    def __init__(self) -> None:
        self.status, self.body = 200, PAGE.encode()

    async def page(self, _: web.Request) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type="text/plain")


@pytest.fixture
async def engine() -> AsyncIterator[tuple[MetricsPageDouble, int]]:
    double = MetricsPageDouble()
    async with serving(METRICS_PATH, double.page) as port:
        yield double, port


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
        yield s


async def test_a_page_is_read_and_anything_else_is_no_page(
    engine: tuple[MetricsPageDouble, int], session: aiohttp.ClientSession
) -> None:
    double, port = engine
    page = await read_metrics(session, "127.0.0.1", port)
    assert page is not None
    assert (page.gauges[WAITING], page.gauges[KV_USAGE]) == (3, 0.25)
    double.status = 503
    assert await read_metrics(session, "127.0.0.1", port) is None
    double.status, double.body = 200, b"x" * (MAX_METRICS_BYTES + 1)
    assert await read_metrics(session, "127.0.0.1", port) is None
    double.body = b"vllm:num_requests_waiting \xff\xfe\n"
    assert await read_metrics(session, "127.0.0.1", port) is None
    assert await read_metrics(session, "127.0.0.1", free_port()) is None


def test_each_pod_pairs_with_its_last_page_and_a_gone_pod_is_forgotten() -> None:
    memory = ScrapeMemory()
    first, second = Page({WAITING: 1}, {}), Page({WAITING: 2}, {})
    assert memory.pair("cr", {"p-0": first, "p-1": None}) == [(None, first), (None, None)]
    assert memory.pair("cr", {"p-0": second}) == [(first, second)]
    assert memory.pair("cr", {"p-0": first, "p-1": first}) == [(second, first), (None, first)]
    memory.pair("other", {"p-0": first})
    memory.forget({"other"})
    assert memory.pair("cr", {"p-0": second}) == [(None, second)]
