"""Streamed answers relayed to the client: one prompt's stream as it comes, or several prompts' streams
interleaved into one (choices renumbered, one usage chunk, one [DONE]).

A stream that breaks after its head ends with an OpenAI error event, not a dropped connection, so the
client learns why it stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from time import perf_counter
from typing import Any

from dllm_router import openai as oa
from dllm_router.metrics import Metrics
from dllm_router.prompt_exchange import Answer, decode_name, observe_first_byte
from dllm_router.upstream import UpstreamError

log = logging.getLogger(__name__)
JsonObject = dict[str, Any]
RELAY_QUEUE = 64  # L7: events of several prompts' streams waiting for a slow client


async def relay_one(route: str, answer: Answer, body: JsonObject, metrics: Metrics) -> AsyncGenerator[bytes]:
    if answer.finished is not None:
        yield oa.sse(oa.answer_as_events(route, answer.finished, body))
        return
    assert answer.stream is not None
    last: float | None = None
    try:
        async for chunk in answer.stream.chunks():
            now = perf_counter()
            if last is None:
                observe_first_byte(metrics, answer)
            elif events := chunk.count(b"data: "):  # the gap shared by the events (tokens) it brings
                pair = (answer.prefill.name, decode_name(answer))
                metrics.pairs.observe("inter_token", *pair, (now - last) / events, count=events)
            last = now
            yield chunk
    except (UpstreamError, TimeoutError) as e:
        yield broken_stream(answer, e, metrics)


def broken_stream(answer: Answer, error: BaseException, metrics: Metrics) -> bytes:
    metrics.errors["stream_broken"] += 1
    name = answer.decode.name if answer.decode else answer.prefill.name
    log.warning("stream from %s broke: %r", name, error)
    return (
        b"data: " + oa.error_body(f"upstream {name} stream broke: {error!r}", "stream_broken", 502) + b"\n\n"
    )


async def relay_many(
    route: str, answers: list[Answer], body: JsonObject, metrics: Metrics
) -> AsyncGenerator[bytes]:
    """Several prompts' streams interleaved, choices renumbered, one usage chunk and one [DONE]."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(RELAY_QUEUE)  # pumps wait for a slow client
    usage: JsonObject = {}
    n = oa.choices_per_prompt(body)

    async def pump(i: int, answer: Answer) -> None:
        try:
            async for payload in _payloads(route, answer, body):
                if payload == oa.DONE:
                    continue
                event = oa.loads(payload)
                if event.get("choices"):
                    await queue.put(b"data: " + oa.dumps(oa.shift_choices(event, i * n)) + b"\n\n")
                else:
                    oa.add_usage(usage, event.get("usage"))
        except (UpstreamError, TimeoutError, ValueError) as e:  # ValueError: an event that is not JSON
            await queue.put(broken_stream(answer, e, metrics))
        finally:
            await queue.put(None)

    pumps = [asyncio.create_task(pump(i, a)) for i, a in enumerate(answers)]
    try:
        open_streams = len(pumps)
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            else:
                yield item
        if usage:
            yield b"data: " + oa.dumps({"object": "usage", "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _payloads(route: str, answer: Answer, body: JsonObject) -> AsyncGenerator[bytes]:
    if answer.finished is not None:
        for payload in oa.answer_as_events(route, answer.finished, body):
            yield payload
        return
    assert answer.stream is not None
    splitter = oa.SseSplitter()
    async for chunk in answer.stream.chunks():
        for payload in splitter.feed(chunk):
            yield payload
