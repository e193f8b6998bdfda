"""What a route's handler is: a coroutine (`Handler`), or a `FastHandler` that may answer by callbacks
(its work in progress a `Pending`); and `ErrorPage`, which renders the server's own refusals."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from dllm_router.http_messages import Request, Response, StreamWriter

if TYPE_CHECKING:
    from dllm_router.httpserver.connection import Connection

Handler = Callable[[Request], Awaitable[Response | StreamWriter]]


class Pending:
    """Work on a request answered by callbacks instead of a task (see `FastHandler`). The connection
    calls `cancel()` when the client leaves before the answer."""

    __slots__ = ()

    def cancel(self) -> None:
        raise NotImplementedError


# Takes a complete request. Returns None when it took the request: it answers with
# `conn.reply(request, response)` (now or from a callback; `conn.pending` holds its work meanwhile), or
# `conn.reply_internal_error(request)`; or returns the awaitable to run as a task, as a `Handler`'s.
FastHandler = Callable[[Request, "Connection"], Awaitable[Response | StreamWriter] | None]
ErrorPage = Callable[[int, str, Request | None], Response]


def plain_error(status: int, message: str, _: Request | None) -> Response:
    return Response(message.encode(), status=status, content_type="text/plain; charset=utf-8")
