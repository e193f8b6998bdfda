"""`dllm-router` as a process: configured by flags and variables, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import sys

import aiohttp
import pytest
from router_engine_double import expected_text
from router_harness import EngineFactory

from dllm_contract.logs import LOG_FORMAT
from dllm_router.__main__ import BatchedStreamHandler, _Formatter, direct_access_line

pytestmark = pytest.mark.timeout(30)


async def wait_for_log(proc: asyncio.subprocess.Process, text: bytes) -> bytes:
    """Wait (bounded) until the router's stderr has a line containing `text`; returns the line."""

    async def read() -> bytes:
        assert proc.stderr is not None
        async for line in proc.stderr:
            if text in line:
                return line
        raise AssertionError(f"the router exited before logging {text!r}")

    return await asyncio.wait_for(read(), 15)


async def wait_for_listening(proc: asyncio.subprocess.Process) -> int:
    """The port the router bound: it is started with --port 0 (no port picked and released first)."""
    line = await wait_for_log(proc, b"dllm-router on 127.0.0.1:")
    found = re.search(rb"dllm-router on 127\.0\.0\.1:(\d+),", line)
    assert found, line
    return int(found.group(1))


@pytest.mark.parametrize(
    ("event_loop", "runs_on"), [("asyncio", "asyncio"), ("uvloop", "uvloop"), ("auto", "uvloop")]
)
async def test_router_process_serves_and_stops_on_sigterm(
    engines: EngineFactory, client: aiohttp.ClientSession, event_loop: str, runs_on: str
) -> None:
    p, d = await engines("p0"), await engines("d0")
    env = {**os.environ, "DLLM_ROUTER_DECODE_URL": d.url, "DLLM_ROUTER_LOG_LEVEL": "info"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dllm_router",
        "--host", "127.0.0.1", "--port", "0", "--flow", "dllm", "--prefill-url", p.url,
        "--event-loop", event_loop, env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = await wait_for_log(proc, f"event loop {runs_on},".encode())  # uvloop is in the pinned venv
        found = re.search(rb"dllm-router on 127\.0\.0\.1:(\d+),", line)
        assert found, line
        url = f"http://127.0.0.1:{int(found.group(1))}"
        async with client.get(url + "/ready") as r:
            assert r.status == 200
        headers = {"X-Request-Id": "cli-1"}
        body = {"prompt": "cli", "max_tokens": 2}
        async with client.post(url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert json.loads(await r.text())["choices"][0]["text"] == expected_text("cli", 2)
        access_line = (await wait_for_log(proc, b" cli-1 ")).decode()
        pods = f"prefill=127.0.0.1:{p.port} decode=127.0.0.1:{d.port}"
        stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
        access = stamp + rf" INFO dllm_router\.access: cli-1 /v1/completions 200 {pods} [\d.]+ms"
        assert re.fullmatch(access, access_line.rstrip("\n")), access_line
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_router_process_refuses_bad_config_with_exit_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dllm_router", "--flow", "dllm", "--prefill-dns", "p:8000",
        env={**os.environ, "DLLM_ROUTER_DECODE_DNS": "bad"}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 2
    assert err.decode().strip() == (
        "dllm-router: --decode-dns (or DLLM_ROUTER_DECODE_DNS): 'bad' is not HOST:PORT"
        " (e.g. llm-prefill:8000)"
    )


async def test_sigterm_lets_in_flight_requests_finish(
    engines: EngineFactory, client: aiohttp.ClientSession
) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.hold = asyncio.Event()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dllm_router", "--host", "127.0.0.1", "--port", "0",
        "--flow", "dllm", "--prefill-url", p.url, "--decode-url", d.url,
        env={**os.environ, "DLLM_ROUTER_LOG_LEVEL": "info"}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        port = await wait_for_listening(proc)
        body = {"prompt": "drain", "max_tokens": 2}
        pending = asyncio.create_task(client.post(f"http://127.0.0.1:{port}/v1/completions", json=body))
        await asyncio.wait_for(d.arrived.wait(), 10)
        proc.send_signal(signal.SIGTERM)  # a rolling update stops the router mid-request
        await wait_for_log(proc, b"stopping: no new connections")
        d.hold.set()
        async with await pending as r:
            assert r.status == 200
            assert json.loads(await r.text())["choices"][0]["text"] == expected_text("drain", 2)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_drain_seconds_bounds_how_long_sigterm_waits(
    engines: EngineFactory, client: aiohttp.ClientSession
) -> None:
    """M4: --drain-seconds (its variable here, as the operator may set either) replaces the fixed 25 s."""
    p, d = await engines("p0"), await engines("d0")
    d.hold = asyncio.Event()  # never set: the request outlives the drain
    env = {**os.environ, "DLLM_ROUTER_LOG_LEVEL": "info", "DLLM_ROUTER_DRAIN_SECONDS": "0.5"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dllm_router", "--host", "127.0.0.1", "--port", "0",
        "--flow", "dllm", "--prefill-url", p.url, "--decode-url", d.url,
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        port = await wait_for_listening(proc)
        body = {"prompt": "cut", "max_tokens": 2}
        pending = asyncio.create_task(client.post(f"http://127.0.0.1:{port}/v1/completions", json=body))
        await asyncio.wait_for(d.arrived.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        line = await wait_for_log(proc, b"stopping: no new connections")
        assert b"in-flight requests get up to 0.5 s" in line
        assert await asyncio.wait_for(proc.wait(), 10) == 0  # cut after 0.5 s, not 25 s
        with pytest.raises(aiohttp.ClientError):
            await pending
        await asyncio.wait_for(d.cancelled_event.wait(), 10)  # the engine's call was abandoned too
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_direct_access_line_is_what_logging_would_write() -> None:
    stream = io.StringIO()
    handler = BatchedStreamHandler(stream)
    handler.setFormatter(_Formatter(LOG_FORMAT))
    record = logging.LogRecord("dllm_router.access", logging.INFO, "", 0, "%s done", ("r1",), None)
    via_logging = handler.format(record)
    standard = logging.Formatter(LOG_FORMAT).format(record)  # logging's own asctime, uncached
    assert via_logging == standard
    formatter = handler.formatter
    assert isinstance(formatter, _Formatter)
    assert formatter.stamp(record.created) == standard[:23]
    handler.info_line("dllm_router.access", "r1 done")
    handler.flush()
    assert stream.getvalue()[23:] == standard[23:] + "\n"


def test_direct_access_line_only_when_logging_would_write_the_same() -> None:
    root, logger = logging.getLogger(), logging.getLogger("dllm_router.access")
    saved = root.handlers[:]
    handler = BatchedStreamHandler(io.StringIO())
    handler.setFormatter(_Formatter(LOG_FORMAT))
    try:
        root.handlers = [handler]
        assert direct_access_line(logger) is not None
        extra = logging.StreamHandler(io.StringIO())
        logger.addHandler(extra)  # another handler on the way: logging must see the record
        assert direct_access_line(logger) is None
        logger.removeHandler(extra)
        handler.setFormatter(logging.Formatter("%(message)s"))  # another format
        assert direct_access_line(logger) is None
    finally:
        root.handlers = saved
