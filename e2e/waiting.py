"""Waiting on a condition inside an event loop, for tests whose app runs on the same loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until_async(condition: Callable[[], bool], what: str, limit_s: float) -> None:
    """Wait for `condition`, re-checked on every turn of the event loop (the app's tasks run in
    between), for at most `limit_s` seconds; fail the test naming `what` past that."""
    try:
        async with asyncio.timeout(limit_s):
            while not condition():  # noqa: ASYNC110  # one loop turn per check, no fixed delay
                await asyncio.sleep(0)
    except TimeoutError:
        raise AssertionError(f"timed out after {limit_s}s waiting for {what}") from None
