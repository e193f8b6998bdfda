"""What every answered request leaves behind: its count, its access line, and its error answer logged.

The access line is made after the answer is out (on the next loop turn when it is not yet), and goes
straight into the batching handler when the CLI has found that gives logging's own line (`access_line`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter

from dllm_router import memory_budget
from dllm_router import openai as oa
from dllm_router.errors import RouterError, request_id_or_new
from dllm_router.http_messages import Request, Response
from dllm_router.metrics import Metrics

log = logging.getLogger(__name__)
access_log = logging.getLogger("dllm_router.access")  # one line per answered request

# The HTTP server's own refusals by status; any other status is a malformed request.
_SERVER_ERROR_KINDS = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    500: "internal_error",
    503: "too_many_connections",
}


class Accounting:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        # writes an INFO line of dllm_router.access as logging would, without a record (set by the CLI
        # when its logging setup makes that exact); None: access lines go through logging
        self.access_line: Callable[[str], None] | None = None

    def account(
        self, route: str, rid: str, status: int, prefill: str, decode: str, started: float, sent: bool = False
    ) -> None:
        """Every answered generation request: its count, and its access line (`sent`: the answer is out
        already; else the line is made on the next loop turn, after the server has sent it)."""
        self.metrics.requests[(route, status)] += 1
        if not access_log.isEnabledFor(logging.INFO):
            return
        ms = (perf_counter() - started) * 1000
        direct = self.access_line
        if direct is None:
            args = ("%s %s %d prefill=%s decode=%s %.1fms", rid, route, status, prefill, decode, ms)
            asyncio.get_running_loop().call_soon(access_log.info, *args)
            return
        line = f"{rid} {route} {status} prefill={prefill} decode={decode} {ms:.1f}ms"
        if sent:
            direct(line)
        else:
            asyncio.get_running_loop().call_soon(direct, line)

    def error_response(self, error: RouterError, rid: str) -> Response:
        """A request's error answer, counted by kind and logged."""
        self.metrics.errors[error.kind] += 1
        log.warning("%s %s: %s", rid, error.kind, error)
        return Response(error.body, status=error.status, headers={"X-Request-Id": rid})

    def error_page(self, status: int, message: str, request: Request | None) -> Response:
        """The HTTP server's own refusals (malformed request 400, body over the limit 413, 404, ...)."""
        kind = _SERVER_ERROR_KINDS.get(status, "bad_request")
        if status == 503 and message.startswith(memory_budget.SPENT):  # a body read past the budget
            kind = "memory_budget"
        rid = request_id_or_new(request)
        if kind not in ("not_found", "method_not_allowed"):
            self.metrics.errors[kind] += 1
        if kind == "bad_request":  # the others come in floods (503, 408): counted, not logged
            log.warning("%s %s: %s", rid, kind, message)
        if request is not None and request.path in oa.GENERATION_ROUTES:
            self.metrics.requests[(request.path, status)] += 1
        return Response(oa.error_body(message, kind, status), status=status, headers={"X-Request-Id": rid})
