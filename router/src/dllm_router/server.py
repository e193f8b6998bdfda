"""The router assembled: its parts, its routes, the front door of a generation request, and `serve`.

Requests arrive through the router's own HTTP/1.1 server (`httpserver/`). A generation request's
front door (`Router.fast_generate`) reads it and chooses its path: a non-streamed single prompt of the
nixl or dllm flow takes the fast path (`fastpath.py`: callbacks, no task), everything else the
coroutine path (`coroutine_path.py`). Both paths drive a request against the same `ExchangeHost`
(`exchange.py`), which the Router is: pods kept by `pod_watch.py`, pairs and retries from
`pairing.py`, counts, access lines and error answers from `accounting.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from time import perf_counter

from dllm_contract.kv_check import PAGE_PATH
from dllm_router import openai as oa
from dllm_router.accounting import Accounting
from dllm_router.admin_routes import AdminRoutes
from dllm_router.config import RouterConfig
from dllm_router.coroutine_path import CoroutinePath
from dllm_router.endpoints import AddressSource
from dllm_router.engine_auth import EngineAuth
from dllm_router.errors import RouterError, header_value, request_id, request_id_or_new
from dllm_router.fastpath import FastExchange
from dllm_router.http_messages import Request, Response, StreamWriter
from dllm_router.httpserver import Connection, FastHandler, Handler, HttpServer
from dllm_router.kv_check import KVCheck
from dllm_router.memory_budget import BudgetSpent, MemoryBudget
from dllm_router.metrics import Metrics
from dllm_router.pairing import Pairing
from dllm_router.pod_watch import PodWatch
from dllm_router.trace_context import trace_lines
from dllm_router.transfer_end import TransferEnds
from dllm_router.upstream import Deadlines

FAST_FLOWS = ("nixl", "dllm")  # the flows the fast path serves (mooncake's needs DP ranks: coroutine path)
Reply = Response | StreamWriter


class Router:
    """The ExchangeHost both request paths use, made of its parts' bound methods (assigned once here,
    so the request path makes no extra call through the Router)."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        prefill_source: AddressSource | None = None,
        decode_source: AddressSource | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics()
        self.deadlines = Deadlines(config.request_timeout_s)  # the fast path's calls
        self.limits = oa.Limits(
            max_prompts=config.max_prompts, max_n=config.max_n, max_logprobs=config.max_logprobs
        )
        self.engine_auth = EngineAuth(config.engine_api_key)
        self.budget = MemoryBudget(config.memory_budget_mb * 2**20, config.max_answer_mb * 2**20)
        self.metrics.budget_held, self.metrics.budget_limit = lambda: self.budget.held, self.budget.limit
        self.pods = PodWatch(
            config,
            self.engine_auth.probe_headers,
            prefill_source=prefill_source,
            decode_source=decode_source,
        )
        self.prefill, self.decode = self.pods.prefill, self.pods.decode
        self.discover, self.check_health = self.pods.discover, self.pods.check_health
        pairing = Pairing(config, self.metrics.fingerprint_pairs)
        self.pick, self.plan = pairing.pick, pairing.plan
        self.note_unreachable, self.upstream_failure = pairing.note_unreachable, pairing.upstream_failure
        self.accounting = Accounting(self.metrics)
        self.account, self.error_response = self.accounting.account, self.accounting.error_response
        self.error_page = self.accounting.error_page
        self.transfer_ends = TransferEnds(self.metrics)
        self.end_transfer = self.transfer_ends.end
        self.coroutine_path = CoroutinePath(self, self.engine_auth, self.limits, self.budget)
        pods = self.pods
        self.kv_check = KVCheck(
            config, self.prefill, self.decode, self.plan, lambda: pods.session, self.engine_auth.probe_headers
        )
        self.metrics.kv_check = self.kv_check.families
        self._kv_check_task: asyncio.Task[None] | None = None
        admin = AdminRoutes(self, self.pods, self.engine_auth)
        generate = self.coroutine_path.generate
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", oa.COMPLETIONS): partial(generate, oa.COMPLETIONS),
            ("POST", oa.CHAT): partial(generate, oa.CHAT),
            ("GET", "/v1/models"): admin.models,
            ("GET", "/health"): admin.health,
            ("GET", "/ready"): admin.ready,
            ("GET", "/metrics"): admin.metrics_page,
            ("GET", PAGE_PATH): self.kv_check_page,
        }
        self._fast = config.flow in FAST_FLOWS
        self.fast_routes: dict[tuple[str, str], FastHandler] = {
            ("POST", route): partial(self.fast_generate, route) for route in oa.GENERATION_ROUTES
        }

    @property
    def access_line(self) -> Callable[[str], None] | None:
        """Writes an access line as logging would, without a record (set by the CLI); None: logging."""
        return self.accounting.access_line

    @access_line.setter
    def access_line(self, writer: Callable[[str], None] | None) -> None:
        self.accounting.access_line = writer

    @property
    def body_limit_message(self) -> str:
        return f"request body over {self.config.max_body_mb} MiB (--max-body-mb)"

    async def start(self, *, background: bool = True) -> None:
        """Discover and probe pods once, then keep doing so in the background."""
        await self.pods.start(background=background)
        if background and self.kv_check.enabled:
            self._kv_check_task = asyncio.get_running_loop().create_task(self.kv_check.run())

    async def kv_check_page(self, _: Request) -> Response:
        """GET /dllm/kv-check: the KV check's verdict for the resource and for each pair (kv_check.py)."""
        return Response(oa.dumps(self.kv_check.summary()))

    async def close(self) -> None:
        if self._kv_check_task is not None:
            self._kv_check_task.cancel()
            await asyncio.wait((self._kv_check_task,))
        await self.transfer_ends.close()
        await self.pods.close()
        self.deadlines.close()

    def fast_generate(self, route: str, request: Request, conn: Connection) -> Awaitable[Reply] | None:
        """The HTTP server's first stop for a generation request (a FastHandler): a non-streamed single
        prompt of the nixl or dllm flow is answered by callbacks (`fastpath.py`); anything else is
        handed to the coroutine path, with the body already parsed."""
        started = perf_counter()
        rid = ""
        try:
            rid = request_id(request)
            body = oa.parse_request(request.body, route, self.limits)
        except (oa.BadRequest, RouterError) as e:
            rid = rid or request_id_or_new(None)
            error = e if isinstance(e, RouterError) else RouterError(400, "bad_request", str(e))
            response = self.error_response(error, rid)
            conn.reply(request, response)
            self.account(route, rid, response.status, "-", "-", started, sent=True)
            return None
        if not self._fast or body.get("stream") or len(oa.split_prompts(route, body)) != 1:
            return self.coroutine_path.generate(route, request, body=body, rid=rid, started=started)
        self.metrics.fast_requests += 1
        try:
            rid_line = b"X-Request-Id: " + header_value(rid) + b"\r\n"
        except RouterError as e:
            conn.reply(request, self.error_response(e, rid))
            self.account(route, rid, e.status, "-", "-", started, sent=True)
            return None
        headers = self.engine_auth.call_headers(request) + trace_lines(request) + rid_line
        ledger = self.budget.ledger()
        try:
            ledger.charge_body(len(request.body))
        except BudgetSpent as e:
            conn.reply(request, self.error_response(RouterError(503, "memory_budget", str(e)), rid))
            self.account(route, rid, 503, "-", "-", started, sent=True)
            return None
        FastExchange(self, conn, request, route, body, rid, rid_line, headers, started, ledger).start()
        return None


async def serve(router: Router, host: str, port: int, *, drain_s: float = 30.0) -> HttpServer:
    """Start listening; a client that disconnects cancels its handler, so both upstream calls stop.

    On `cleanup()`, in-flight requests get `drain_s` seconds to finish.
    """
    server = HttpServer(
        router.routes,
        fast_routes=router.fast_routes,
        max_body=router.config.max_body_mb * 1024 * 1024,
        too_large=router.body_limit_message,
        error_page=router.error_page,
        drain_s=drain_s,
        max_connections=router.config.max_connections,
        first_byte_timeout_s=router.config.first_byte_timeout_s,
        head_timeout_s=router.config.head_timeout_s,
        body_timeout_s=router.config.body_timeout_s,
        body_ledger=router.budget.ledger,
    )
    await server.start(host, port)
    router.metrics.open_connections = lambda: len(server.connections)
    router.metrics.evicted_connections = lambda: server.evicted_connections
    return server
