"""Fixtures: engine doubles on 127.0.0.1, a router serving real HTTP in front of them, a client."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from router_engine_double import FakeBootstrapServer, FakeVllmEngine
from router_harness import (  # after the sys.path line above
    WAIT_S,
    EngineFactory,
    RouterFactory,
    RunningRouter,
)

from dllm_router.config import Flow, RouterConfig, Upstreams
from dllm_router.endpoints import AddressSource
from dllm_router.httpserver import HttpServer
from dllm_router.server import Router, serve


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
        config = RouterConfig.model_validate({**dict(config), **overrides})  # validated, as flags are
        router = Router(config, prefill_source=prefill_source, decode_source=decode_source)
        await router.start(background=background)
        runner = await serve(router, "127.0.0.1", 0, drain_s=0.2)
        made.append((router, runner))
        return RunningRouter(router, f"http://127.0.0.1:{runner.addresses[0][1]}", client, runner)

    yield start
    for router, runner in made:
        await runner.cleanup()
        await router.close()
