"""The fast path: one non-streamed, single-prompt request of the nixl or dllm flow, driven by callbacks.

The coroutine path (`CoroutinePath.generate`) costs a task, several coroutines and futures per
request. Here the HTTP server's parser callback starts the exchange, the upstream connections'
`data_received` callbacks move it on, and the answer goes to the client with one write:

    client request complete -> pick pods -> prefill call (dllm: and decode call at once)
    prefill answered -> nixl: decode call with prefill's kv_transfer_params
    decode answered (and prefill, for dllm) -> decode's bytes to the client

Every behaviour of the coroutine path is kept: retries on other pods after a connection failure (no
byte has reached the client before decode's whole answer is in), the upstream timeout, errors as
OpenAI JSON, answers from prefill alone, X-Request-Id, metrics, the access line, in-flight counts, and a
client that leaves cancelling both calls. Streams, several prompts and the mooncake flow stay on the
coroutine path.
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import Any

from dllm_router import openai as oa
from dllm_router.endpoints import Endpoint
from dllm_router.errors import RouterError, Unreachable, pod_failure, prefill_answer
from dllm_router.exchange import ExchangeHost
from dllm_router.http_messages import Request, Response
from dllm_router.httpserver import Connection, Pending
from dllm_router.memory_budget import RequestBytes
from dllm_router.upstream import Call, ConnectFailed

log = logging.getLogger(__name__)
JsonObject = dict[str, Any]


class FastExchange(Pending):
    """One request on the fast path, from its first attempt to the answer (see the module docstring)."""

    __slots__ = (
        "_attempt",
        "_conn",
        "_d",
        "_dcall",
        "_decode_ok",
        "_decoded",
        "_end_id",
        "_ledger",
        "_p",
        "_pcall",
        "_prefill_at",
        "_prefill_done",
        "_prefill_refused",
        "_replied",
        "_request",
        "_router",
        "_tried",
        "body",
        "headers",
        "path",
        "rid",
        "rid_line",
        "route",
        "started",
    )

    def __init__(
        self,
        router: ExchangeHost,
        conn: Connection,
        request: Request,
        route: str,
        body: JsonObject,
        rid: str,
        rid_line: bytes,
        headers: bytes,
        started: float,
        ledger: RequestBytes,
    ) -> None:
        self._router, self._conn, self._request = router, conn, request
        self._ledger = ledger  # its body and answers held (NEW-1), given back when it ends
        self.route, self.path, self.body = route, route.encode(), body
        self.rid, self.rid_line, self.headers, self.started = rid, rid_line, headers, started
        self._tried: list[Endpoint] = []
        self._attempt = 0
        self._p: Endpoint | None = None  # this attempt's pods; None: not picked (or prefill answered alone)
        self._d: Endpoint | None = None
        self._pcall: Call | None = None  # the calls in flight
        self._dcall: Call | None = None
        self._decoded: bytes | None = None  # decode's answer when it came before prefill's (dllm)
        # dllm: this attempt's transfer id, ended on decode when decode fails after prefill may have
        # run (M2): unless decode answered 200 or prefill answered an error or was never reached
        self._end_id: str | None = None
        self._decode_ok = self._prefill_refused = False
        self._prefill_at = self._prefill_done = started
        self._replied = False
        conn.pending = self

    # ---- the steps ----

    def start(self) -> None:
        """Pick the pods and send this attempt's first call (the dllm flow: both calls)."""
        self._guarded(self._send_first, None)

    def _send_first(self, _: None) -> None:
        router, body = self._router, self.body
        self._decoded = self._end_id = None
        self._decode_ok = self._prefill_refused = False
        p = router.pick(router.prefill, self._tried, router.decode)
        if oa.asks_one_token(body):  # prefill alone answers; no KV moves
            router.metrics.prefill_answers += 1
            self._p = self._d = p
            self._dcall = self._call(p, self.headers, oa.decode_payload(body, self._request.body, None), True)
            return
        d = router.pick(router.decode, self._tried, p)
        plan = router.plan(self.rid, 0, p, d)
        self._p, self._d, self._end_id = p, d, plan.end_id
        self._prefill_done = self._prefill_at = perf_counter()
        prefill_body = oa.dumps(oa.prefill_request(body, plan.prefill_kv))
        self._pcall = self._call(p, self.headers + plan.prefill_headers, prefill_body, False)
        if plan.concurrent:
            decode_body = oa.decode_payload(body, self._request.body, plan.decode_kv)
            self._dcall = self._call(d, self.headers, decode_body, True)

    def _call(self, ep: Endpoint, headers: bytes, payload: bytes, answering: bool) -> Call:
        assert ep.upstream is not None, "discover() attaches a pool to every endpoint"
        ep.inflight += 1
        done = self._on_answer if answering else self._on_prefill
        return ep.upstream.call(self.path, headers, payload, self._router.deadlines, done, self._ledger)

    def _on_prefill(self, call: Call) -> None:
        self._guarded(self._prefill_answered, call)

    def _prefill_answered(self, call: Call) -> None:
        router, p = self._router, self._p
        assert p is not None
        p.inflight -= 1
        self._pcall = None
        error = call.error
        self._prefill_refused = isinstance(error, ConnectFailed) or (error is None and call.status != 200)
        self._raise_unless_ok(call, p)
        now = perf_counter()
        router.metrics.observe("prefill", p.name, self._decode_name, now - self._prefill_at)
        try:
            finished = prefill_answer(call.body, p)
        except Unreachable:
            self._prefill_refused = True  # it ran nothing: nothing of it to end on decode
            raise
        self._prefill_done = now
        if oa.finished_at_prefill(finished, self.body):  # EOS at the first token: decode has nothing
            router.metrics.prefill_answers += 1
            self._drop_calls()
            self._d = None
            self._answer(finished.public())
        elif self._decoded is not None:  # dllm: decode was first
            self._answer(self._decoded)
        elif self._dcall is None:  # nixl: decode now, with what prefill returned
            assert self._d is not None
            kv = finished.value(oa.CLIENT_KV) or None
            payload = oa.decode_payload(self.body, self._request.body, kv)
            self._dcall = self._call(self._d, self.headers, payload, True)

    def _on_answer(self, call: Call) -> None:
        self._guarded(self._answered, call)

    def _answered(self, call: Call) -> None:
        """Decode's answer (prefill's, for a one-token request): relayed as it came, once prefill is in."""
        router, ep = self._router, self._d
        assert ep is not None
        ep.inflight -= 1
        self._dcall = None
        self._raise_unless_ok(call, ep)
        self._decode_ok = True
        assert self._p is not None
        router.metrics.observe(
            "decode_first_byte", self._p.name, ep.name, max(perf_counter() - self._prefill_done, 0.0)
        )
        if self._pcall is not None:
            self._decoded = call.body  # prefill has not answered yet: its answer decides
        else:
            self._answer(call.body)

    @property
    def _decode_name(self) -> str:
        """The decode pod of this attempt, "-" when prefill answered alone."""
        return self._d.name if self._d is not None else "-"

    def _raise_unless_ok(self, call: Call, ep: Endpoint) -> None:
        """A call that failed or answered an error status ends the attempt (Unreachable: retried)."""
        if call.error is not None:
            raise self._router.upstream_failure(ep, call.error)
        if call.status != 200:
            raise pod_failure(ep, call.status, call.body)

    # ---- endings ----

    def _answer(self, payload: bytes) -> None:
        router = self._router
        assert self._p is not None
        decode = self._decode_name
        router.metrics.observe("ttft", self._p.name, decode, perf_counter() - self.started)
        self._reply(Response(payload, header_lines=self.rid_line), self._p.name, decode)

    def _reply(self, response: Response, prefill: str, decode: str) -> None:
        self._replied = True
        self._ledger.release()
        self._conn.reply(self._request, response)
        self._router.account(self.route, self.rid, response.status, prefill, decode, self.started, sent=True)

    def _guarded(self, step: Any, arg: Any) -> None:
        """Run one step; a failure ends the request as the coroutine path would."""
        try:
            step(arg)
        except RouterError as e:
            self._drop_calls()
            self._reply(self._router.error_response(e, self.rid), "-", "-")
        except Unreachable as e:
            self._drop_calls()
            self._retry_or_fail(e)
        except Exception:
            log.exception("%s %s failed", self._request.method, self._request.path)
            self._drop_calls()
            if not self._replied:  # else the answer is out: nothing more to send
                self._replied = True
                self._ledger.release()
                self._conn.reply_internal_error(self._request)

    def _retry_or_fail(self, error: Unreachable) -> None:
        router = self._router
        router.note_unreachable(error, self.rid, self._tried)
        if self._attempt < router.config.retries:
            self._attempt += 1
            router.metrics.retries += 1
            self.start()
            return
        self._reply(router.error_response(error.final(), self.rid), "-", "-")

    def _drop_calls(self) -> None:
        """Abandon the calls in flight (their connections close, so the engines abort them)."""
        call, self._pcall = self._pcall, None
        if call is not None and self._p is not None:
            call.close()
            self._p.inflight -= 1
        call, self._dcall = self._dcall, None
        if call is not None and self._d is not None:
            call.close()
            self._d.inflight -= 1
        tid, self._end_id = self._end_id, None
        if tid is not None and self._d is not None and not (self._decode_ok or self._prefill_refused):
            self._router.end_transfer(self._d, tid, self.headers)

    def cancel(self) -> None:
        """The client left: both calls are abandoned, as the coroutine path's cancellation does."""
        self._drop_calls()
        self._ledger.release()
        self._router.metrics.errors["client_disconnect"] += 1
        log.info("%s %s client went away; upstream requests cancelled", self.rid, self.route)
