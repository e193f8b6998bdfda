"""A local HTTP server for the doubles of pod pages the operator reads (a router's KV check page, an
engine's /metrics): one GET route on 127.0.0.1, an ephemeral port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serving(path: str, handler: Callable[[web.Request], Awaitable[web.Response]]) -> AsyncIterator[int]:
    """Serve GET `path` with `handler` while the block runs; yields the port."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
