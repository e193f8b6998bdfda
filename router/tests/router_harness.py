"""What the router tests share: waits on a condition, a mutable address source, a running router.

Its own module, not the conftest: several suites have a conftest.py, and `from conftest import` would
take whichever of them was imported first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from e2e.waiting import wait_until_async
from router_engine_double import FakeVllmEngine

from dllm_router.config import Address
from dllm_router.httpserver import HttpServer
from dllm_router.server import Router

WAIT_S = 5.0


async def wait_until(condition: Callable[[], bool], what: str, limit_s: float = WAIT_S) -> None:
    """Wait for `condition`, re-checked on every turn of the event loop, for at most `limit_s`."""
    await wait_until_async(condition, what, limit_s)


async def wait_event(event: asyncio.Event, what: str, limit_s: float = WAIT_S) -> None:
    try:
        async with asyncio.timeout(limit_s):
            await event.wait()
    except TimeoutError:
        raise AssertionError(f"timed out after {limit_s}s waiting for {what}") from None


class MutableSource:
    """An address source a test edits, standing in for a headless Service whose pods come and go."""

    def __init__(self, engines: Iterable[FakeVllmEngine]) -> None:
        self.addresses: set[Address] = {("127.0.0.1", e.port) for e in engines}

    def add(self, engine: FakeVllmEngine) -> None:
        self.addresses.add(("127.0.0.1", engine.port))

    def remove(self, engine: FakeVllmEngine) -> None:
        self.addresses.discard(("127.0.0.1", engine.port))

    async def __call__(self) -> frozenset[Address]:
        return frozenset(self.addresses)


@dataclass
class RunningRouter:
    router: Router
    url: str
    client: aiohttp.ClientSession
    server: HttpServer

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        return await self.client.post(self.url + path, json=body, headers=headers)

    async def text_of(self, path: str, body: Any) -> tuple[int, str]:
        async with await self.post(path, body) as r:
            return r.status, await r.text()


EngineFactory = Callable[..., Awaitable[FakeVllmEngine]]
RouterFactory = Callable[..., Awaitable[RunningRouter]]
