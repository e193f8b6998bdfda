"""The loop both of the operator's readers of pod pages run (kv_poll.py, autoscale/poller.py): one
HTTP session, bounded in time and in reads at once, and a poll every interval."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp


async def poll_forever(
    interval_s: float,
    poll: Callable[[aiohttp.ClientSession], Awaitable[None]],
    read_timeout_s: float,
    parallel_reads: int,
) -> None:
    timeout = aiohttp.ClientTimeout(total=read_timeout_s)
    connector = aiohttp.TCPConnector(limit=parallel_reads, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        while True:
            await poll(session)
            await asyncio.sleep(interval_s)
