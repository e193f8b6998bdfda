"""dllm-router's request path behind a library HTTP server: a raw ASGI app (and RSGI, granian's own).

For bench/router.py's library rows (issue 19, item 4). Only the HTTP layer differs from `dllm-router`:
the app drives the same `Router` object, so the same pod choice, the same upstream client
(`UpstreamPool`), the same callback fast path (`FastExchange`) for a non-streamed single prompt, the
same JSON handling, metrics and access line (logging set up as the router's CLI does). The router's
fast path answers through a connection's `reply()`; `Reply` stands in for that connection and hands the
answer to the awaiting ASGI call.

What the app adds, because the library does not do it and the router must: the body limit
(`--max-body-mb`, 413 before reading when declared), and a client that leaves cancelling the upstream
calls (a task per request waits for the server's disconnect message; our server gets that from
`connection_lost` at no per-request cost). Streamed answers are not served here (501): the benchmark
does not stream, and a switch would write them with `http.response.body` pieces.

    .venv/bin/python bench/router_asgi.py uvicorn|granian|granian-rsgi PORT -- <dllm-router flags>
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from dllm_router.__main__ import configure_logging, direct_access_line
from dllm_router.config import parse_config
from dllm_router.httpserver import MAX_HEAD, Pending, Request, Response, StreamWriter
from dllm_router.server import Router

ARGV_ENV = "DLLM_BENCH_ROUTER_ARGV"  # the dllm-router flags, as JSON (granian's workers inherit it)
# "1": no task per request waiting for the client to leave (what that costs; a client that leaves then
# does not cancel the upstream calls, unlike on dllm-router)
NO_WATCH_ENV = "DLLM_BENCH_NO_DISCONNECT_WATCH"
TASK_IMPL_ENV = "DLLM_BENCH_GRANIAN_TASK_IMPL"  # granian's --task-impl: asyncio (its default) or rust
SERVERS = ("uvicorn", "granian", "granian-rsgi")
log = logging.getLogger("dllm.router")
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")


class Reply:
    """What the fast path sees as its connection: `reply()` resolves the future the app awaits."""

    __slots__ = ("future", "pending")

    def __init__(self, future: asyncio.Future[Response | None]) -> None:
        self.future = future
        self.pending: Pending | None = None  # the fast path's work in flight

    def reply(self, _: Request, response: Response) -> None:
        self.pending = None
        if not self.future.done():
            self.future.set_result(response)

    def reply_internal_error(self, request: Request) -> None:
        page = Response(b"internal server error", status=500, content_type="text/plain; charset=utf-8")
        self.reply(request, page)

    def gone(self, _: object) -> None:
        """The client left before the answer: the fast path drops both calls, as on our server."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.cancel()
        if not self.future.done():
            self.future.set_result(None)


class RouterApp:
    """The router's routes (and fast routes) as one ASGI and RSGI application."""

    def __init__(self) -> None:
        self._router: Router | None = None
        self.max_body = 0

    @property
    def router(self) -> Router:
        assert self._router is not None, "the server did not run the app's startup"
        return self._router

    async def startup(self) -> None:
        config = parse_config(json.loads(os.environ[ARGV_ENV]), os.environ)
        configure_logging(config.log_level)
        router = Router(config)
        router.access_line = direct_access_line(log)
        await router.start()
        self._router, self.max_body = router, config.max_body_mb * 1024 * 1024

    async def shutdown(self) -> None:
        if self._router is not None:
            await self._router.close()

    # ---- one request, whatever the interface ----

    async def answer(self, request: Request, gone: Callable[[], Awaitable[Any]]) -> Response | None:
        """The router's answer to a complete request; None when the client left before it (`gone`
        waits for the server's word that the client left)."""
        router = self.router
        key = (request.method, request.path)
        fast = router.fast_routes.get(key)
        loop = asyncio.get_running_loop()
        if fast is not None:
            reply = Reply(loop.create_future())
            work = fast(request, reply)  # type: ignore[arg-type]  # Reply has what the fast path uses
            if work is None:
                return await _until_gone(reply.future, gone, reply.gone)
        else:
            handler = router.routes.get(key)
            if handler is None:
                return router.error_page(404, "not found", request)
            work = handler(request)
        task = asyncio.ensure_future(work)
        result = await _until_gone(task, gone, lambda _: task.cancel())
        if isinstance(result, StreamWriter):
            return router.error_page(501, "streams are not served by the bench app", request)
        return result

    def refusal(self, declared: bytes | None, request: Request) -> Response | None:
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return self.router.error_page(413, self.router.body_limit_message, request)
        return None

    # ---- ASGI ----

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        request = new_request(scope["method"], scope["path"], scope["headers"])
        response = self.refusal(request.header(b"content-length"), request)
        if response is None:
            pieces, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                piece = message.get("body", b"")
                size += len(piece)
                if size > self.max_body:
                    response = self.router.error_page(413, self.router.body_limit_message, request)
                    break
                pieces.append(piece)
                more = message.get("more_body", False)
        if response is None:
            request.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            request.complete = True
            response = await self.answer(request, receive)
            if response is None:
                return
        headers = [(b"content-type", response.content_type.encode()), *header_pairs(response)]
        headers.append((b"content-length", b"%d" % len(response.body)))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- RSGI (granian's own interface) ----

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.startup())

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.shutdown())

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        headers = ((k.encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items())
        request = new_request(scope.method, scope.path, headers)
        response = self.refusal(request.header(b"content-length"), request)
        if response is None:
            pieces, size = [], 0
            async for piece in proto:  # granian's whole-body read (`await proto()`) has no limit
                size += len(piece)
                if size > self.max_body:
                    response = self.router.error_page(413, self.router.body_limit_message, request)
                    break
                pieces.append(piece)
            request.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            request.complete = True
        if response is None:
            response = await self.answer(request, proto.client_disconnect)
            if response is None:
                return
        pairs = [("content-type", response.content_type)]
        pairs += [(k.decode("latin-1"), v.decode("latin-1")) for k, v in header_pairs(response)]
        proto.response_bytes(response.status, pairs, response.body)


def new_request(method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Request:
    """Our server's request object, from a library's request head (names lowercased, repeats joined)."""
    request = Request(None)
    request.method, request.path = method, path
    joined = request.headers
    for name, value in headers:
        name = name.lower()
        joined[name] = joined[name] + b", " + value if name in joined else value
    return request


def header_pairs(response: Response) -> list[tuple[bytes, bytes]]:
    """A Response's extra headers as pairs (`header_lines` is `Name: value\\r\\n` lines)."""
    pairs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (response.headers or {}).items()]
    for line in response.header_lines.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b": ")
            pairs.append((name, value))
    return pairs


async def _until_gone(
    work: asyncio.Future[T], gone: Callable[[], Awaitable[Any]], on_gone: Callable[[Any], object]
) -> T | None:
    """`work`'s result; if `gone` (the client's disconnect) resolves first, `on_gone` runs (a no-op
    once the work is done)."""
    if NO_WATCH:
        return await work
    watch = asyncio.ensure_future(gone())
    watch.add_done_callback(on_gone)
    work.add_done_callback(lambda _: watch.cancel())
    try:
        return await work
    except asyncio.CancelledError:
        if watch.done() and not watch.cancelled():
            return None  # the client left: the work was cancelled for it
        raise


app = RouterApp()
NO_WATCH = os.environ.get(NO_WATCH_ENV) == "1"


def main(argv: list[str]) -> None:
    """Serve `app` with one library server; the router's own limits map onto that server's knobs where
    it has one (uvicorn: --max-connections as limit_concurrency; granian: that as backpressure, the head
    deadline as header_read_timeout, the head size as max_buffer_size). The rest the app does, or
    nothing does: bench/http_abuse.py probes which."""
    server, port, router_argv = argv[0], int(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:]
    if server not in SERVERS:
        raise SystemExit(f"router_asgi.py: the server is one of {', '.join(SERVERS)}")
    config = parse_config(router_argv, os.environ)  # refused here as dllm-router would refuse it
    os.environ[ARGV_ENV] = json.dumps(router_argv)
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(
            app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", ws="none",
            lifespan="on", access_log=False, log_config=None, server_header=False, interface="asgi3",
            limit_concurrency=config.max_connections,
        )  # fmt: skip
        return
    from granian.constants import HTTPModes, Interfaces, Loops, TaskImpl
    from granian.http import HTTP1Settings
    from granian.server import Server

    interface = Interfaces.RSGI if server == "granian-rsgi" else Interfaces.ASGI
    http1 = HTTP1Settings(header_read_timeout=int(config.head_timeout_s * 1000), max_buffer_size=MAX_HEAD)
    Server(
        "router_asgi:app", address="127.0.0.1", port=port, interface=interface, workers=1,
        loop=Loops.uvloop, http=HTTPModes.http1, websockets=False, log_enabled=False,
        task_impl=TaskImpl(os.environ.get(TASK_IMPL_ENV, "asyncio")),
        backpressure=config.max_connections, http1_settings=http1,
        working_dir=Path(__file__).resolve().parent,
    ).serve()  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
