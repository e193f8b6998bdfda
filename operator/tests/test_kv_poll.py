"""The operator's reads of the routers' KV check pages (kv_poll.py): which pods it reads, what it makes
of an answer that is not a page, and that only a change reconciles.

The pages are served by `RouterPageDouble`, a local HTTP server standing in for a router's
`/dllm/kv-check` (the real router and engines answer it in the node tier, e2e/tests/test_node_serving.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from e2e.ports import free_port
from page_server import serving

from dllm_contract.kv_check import PAGE_PATH
from dllm_operator.kv_poll import KVPoller, Page, read_page, router_pods
from dllm_operator.kv_transfer import MAX_PAGE_BYTES, RouterPage

VERIFIED = {
    "enabled": True,
    "reason": "Verified",
    "message": "1 of 1 pairs verified",
    "pairs": [{"prefill": "p", "decode": "d", "reason": "Verified", "message": "ok", "checkedAt": 1.0}],
}


class RouterPageDouble:
    """A router's KV check page on 127.0.0.1 (a double: the operator side only reads it)."""

    def __init__(self) -> None:
        self.status, self.body, self.reads = 200, json.dumps(VERIFIED).encode(), 0

    async def page(self, _: web.Request) -> web.Response:
        self.reads += 1
        return web.Response(status=self.status, body=self.body, content_type="application/json")


@pytest.fixture
async def router() -> AsyncIterator[tuple[RouterPageDouble, int]]:
    double = RouterPageDouble()
    async with serving(PAGE_PATH, double.page) as port:
        yield double, port


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
        yield s


def router_pod(name: str, ready: bool = True, ip: str = "127.0.0.1", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, **meta},
        "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_only_ready_router_pods_with_an_address_are_read() -> None:
    pods = [
        router_pod("ready"),
        router_pod("starting", ready=False),
        router_pod("leaving", deletionTimestamp="2026-12-06T00:00:00Z"),
        router_pod("unplaced", ip=""),
    ]
    assert router_pods(pods) == [("ready", "127.0.0.1", 8000)]


async def test_a_page_is_read(router: tuple[RouterPageDouble, int], session: aiohttp.ClientSession) -> None:
    page = await read_page(session, "127.0.0.1", router[1])
    assert isinstance(page, RouterPage)
    assert page.pairs[0].reason == "Verified"


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (503, b"busy", "HTTP 503"),
        (200, b"{}", "the page is not a KV check page: enabled: Field required"),
        (200, b"[" * (MAX_PAGE_BYTES + 10), f"the page is over {MAX_PAGE_BYTES} bytes"),
    ],
)
async def test_an_answer_that_is_not_a_page_says_why(
    router: tuple[RouterPageDouble, int], session: aiohttp.ClientSession, status: int, body: bytes, said: str
) -> None:
    router[0].status, router[0].body = status, body
    assert await read_page(session, "127.0.0.1", router[1]) == said


async def test_a_router_that_is_gone_is_unreachable(session: aiohttp.ClientSession) -> None:
    assert await read_page(session, "127.0.0.1", free_port()) == "unreachable (ClientConnectorError)"


async def test_only_a_change_of_the_pages_is_told(
    router: tuple[RouterPageDouble, int], session: aiohttp.ClientSession
) -> None:
    double, port = router
    told: list[dict[str, Page]] = []
    poller = KVPoller(1.0, lambda: {"cr": [("r-0", "127.0.0.1", port)]}, lambda _, pages: told.append(pages))
    await poller.poll(session)
    await poller.poll(session)
    assert double.reads == 2
    assert len(told) == 1
    double.status = 500
    await poller.poll(session)
    assert [pages["r-0"] for pages in told[1:]] == ["HTTP 500"]
