"""Fixtures: engine doubles on 127.0.0.1, a router serving real HTTP in front of them, a client."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from router_engine_double import FakeBootstrapServer, FakeVllmEngine

from dllm_connector.router.config import Address, Flow, RouterConfig, Upstreams
from dllm_connector.router.endpoints import AddressSource
from dllm_connector.router.httpserver import HttpServer
from dllm_connector.router.server import Router, serve

WAIT_S = 5.0


async def wait_until(condition: Callable[[], bool], what: str, limit_s: float = WAIT_S) -> None:
    """Wait for `condition`, re-checked on every turn of the event loop, for at most `limit_s`."""
    try:
        async with asyncio.timeout(limit_s):
            while not condition():  # noqa: ASYNC110  # one loop turn per check, no fixed delay
                await asyncio.sleep(0)
    except TimeoutError:
        raise AssertionError(f"timed out after {limit_s}s waiting for {what}") from None


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


@pytest.fixture
async def engines() -> AsyncIterator[EngineFactory]:
    made: list[FakeVllmEngine] = []

    async def make(name: str, **kwargs: Any) -> FakeVllmEngine:
        engine = await FakeVllmEngine(name, **kwargs).start()
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.stop()


@pytest.fixture
async def bootstrap() -> AsyncIterator[Callable[[list[str]], Awaitable[FakeBootstrapServer]]]:
    made: list[FakeBootstrapServer] = []

    async def make(engine_ids: list[str]) -> FakeBootstrapServer:
        server = await FakeBootstrapServer(engine_ids).start()
        made.append(server)
        return server

    yield make
    for server in made:
        await server.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S * 2)) as session:
        yield session


@pytest.fixture
async def start_router(client: aiohttp.ClientSession) -> AsyncIterator[RouterFactory]:
    made: list[tuple[Router, HttpServer]] = []

    async def start(
        flow: Flow,
        prefill_pods: list[FakeVllmEngine],
        decode_pods: list[FakeVllmEngine],
        *,
        prefill_source: AddressSource | None = None,
        decode_source: AddressSource | None = None,
        background: bool = False,
        **overrides: Any,
    ) -> RunningRouter:
        config = RouterConfig(
            flow=flow,
            prefill=Upstreams(urls=tuple(e.url for e in prefill_pods)),
            decode=Upstreams(urls=tuple(e.url for e in decode_pods)),
            host="127.0.0.1",
            port=0,
            connect_timeout_s=2.0,
            request_timeout_s=WAIT_S,
        )
        router = Router(
            replace(config, **overrides), prefill_source=prefill_source, decode_source=decode_source
        )
        await router.start(background=background)
        runner = await serve(router, "127.0.0.1", 0, drain_s=0.2)
        made.append((router, runner))
        return RunningRouter(router, f"http://127.0.0.1:{runner.addresses[0][1]}", client, runner)

    yield start
    for router, runner in made:
        await runner.cleanup()
        await router.close()
