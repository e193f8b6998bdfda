"""The router's I/O: the HTTP server's handlers, the discovery and health loops, and the upstream calls.

Requests arrive through the router's own HTTP/1.1 server (`httpserver.py`); generation calls go through
keep-alive connection pools per pod (`upstream.py`); health checks, the bootstrap /query and /v1/models
use one aiohttp ClientSession.

Per prompt the router picks a prefill and a decode pod (least outstanding requests), sends the two calls
of the configured flow, and relays decode's answer. A non-streamed single prompt of the nixl or dllm
flow takes the fast path (`fastpath.py`: callbacks, no task); everything else the coroutine path here.
Nothing reaches the client before prefill has answered, so a prefill error, a prefill that already
finished, or an unreachable pod is still handled cleanly (with a retry on other pods when the failure was
a connection one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any

import aiohttp
import prometheus_client

from dllm_router import flows
from dllm_router import openai as oa
from dllm_router.config import RouterConfig
from dllm_router.endpoints import AddressSource, Endpoint, Pool, scheme_of, source_for
from dllm_router.errors import (
    RouterError,
    Unreachable,
    header_value,
    pod_error,
    prefill_answer,
    request_id,
    request_id_or_new,
)
from dllm_router.fastpath import FastExchange
from dllm_router.httpserver import (
    Connection,
    FastHandler,
    Handler,
    HttpServer,
    Request,
    Response,
    StreamWriter,
)
from dllm_router.metrics import Metrics, exposition
from dllm_router.upstream import ConnectFailed, Deadlines, UpstreamError, UpstreamPool
from dllm_router.upstream import Response as UpstreamResponse

log = logging.getLogger(__name__)
access_log = logging.getLogger("dllm_router.access")  # one line per answered request
JsonObject = dict[str, Any]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
GENERATION_ROUTES = (oa.COMPLETIONS, oa.CHAT)
FAST_FLOWS = ("nixl", "dllm")  # the flows the fast path serves (mooncake's needs DP ranks: coroutine path)
EXCHANGES_PER_REQUEST = 16  # H2: one request's prompts run at most this many pairs of calls at once
RELAY_QUEUE = 64  # L7: events of several prompts' streams waiting for a slow client
Reply = Response | StreamWriter


@dataclass
class Answer:
    """One prompt's answer: prefill's finished JSON, decode's full body, or decode's open stream."""

    prefill: Endpoint
    decode: Endpoint | None = None
    finished: JsonObject | None = None
    body: bytes | None = None
    stream: UpstreamResponse | None = None
    prefill_done: float = field(default_factory=perf_counter)

    def release(self) -> None:
        if self.stream is not None:
            self.stream.close()  # not read to the end: closing tells the engine to abort
            self.stream = None
            if self.decode is not None:
                self.decode.inflight -= 1


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its body, the client's bytes when the body is theirs unchanged, its ids."""

    body: JsonObject
    raw: bytes | None
    rid: str
    index: int


class Router:
    def __init__(
        self,
        config: RouterConfig,
        *,
        prefill_source: AddressSource | None = None,
        decode_source: AddressSource | None = None,
    ) -> None:
        self.config = config
        self.prefill = Pool("prefill", scheme_of(config.prefill))
        self.decode = Pool("decode", scheme_of(config.decode))
        self._sources = {
            "prefill": prefill_source or source_for(config.prefill),
            "decode": decode_source or source_for(config.decode),
        }
        self.metrics = Metrics()
        self._exposition = exposition(self.metrics, lambda: (self.prefill, self.decode))
        self.deadlines = Deadlines(config.request_timeout_s)  # the fast path's calls
        self.limits = oa.Limits(max_prompts=config.max_prompts, max_n=config.max_n)
        # The engines' key replaces the client's Authorization on every engine call; it is kept as
        # header bytes only and never logged (the repr of RouterConfig leaves it out).
        key = config.engine_api_key
        self._engine_auth = b"Authorization: Bearer " + key.encode("ascii") + b"\r\n" if key else None
        self._probe_headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._dllm_plans = flows.DllmPlans(config)
        # writes an INFO line of dllm.router as logging would, without a record (set by the CLI when its
        # logging setup makes that exact); None: access lines go through logging
        self.access_line: Callable[[str], None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._probe_timeout = aiohttp.ClientTimeout(total=config.connect_timeout_s)
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", oa.COMPLETIONS): partial(self.generate, oa.COMPLETIONS),
            ("POST", oa.CHAT): partial(self.generate, oa.CHAT),
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("GET", "/ready"): self.ready,
            ("GET", "/metrics"): self.metrics_page,
        }
        self._fast = config.flow in FAST_FLOWS
        self.fast_routes: dict[tuple[str, str], FastHandler] = {
            ("POST", route): partial(self.fast_generate, route) for route in GENERATION_ROUTES
        }

    # ---- lifecycle ----

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() was not called"
        return self._session

    async def start(self, *, background: bool = True) -> None:
        """Open the upstream pool, discover and probe pods once, then keep doing so in the background."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        await self.refresh()
        if background:
            self._loops = [
                asyncio.create_task(self._every(self.config.resolve_interval_s, self.discover)),
                asyncio.create_task(self._every(self.config.health_interval_s, self.check_health)),
            ]

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self.deadlines.close()
        for pool in (self.prefill, self.decode):
            for ep in pool.endpoints.values():
                if ep.upstream is not None:
                    ep.upstream.close()

    @staticmethod
    async def _every(seconds: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await job()
            except Exception:
                log.exception("background %s failed", getattr(job, "__name__", job))

    # ---- discovery and health ----

    async def refresh(self) -> None:
        await self.discover()
        await self.check_health()

    async def discover(self) -> None:
        """Re-read both sources; new pods are probed at once and join when healthy."""
        new: list[Endpoint] = []
        for pool in (self.prefill, self.decode):
            added, removed = pool.update(await self._sources[pool.role]())
            for ep in added:
                log.info("%s pod %s discovered", pool.role, ep.name)
                ep.upstream = UpstreamPool(
                    ep.host, ep.port, self.config.connect_timeout_s, ep.scheme == "https"
                )
            for ep in removed:
                log.info("%s pod %s gone (%d requests still in flight)", pool.role, ep.name, ep.inflight)
                if ep.upstream is not None:
                    ep.upstream.close()
            new += added
        await asyncio.gather(*(self._probe(ep) for ep in new))

    async def check_health(self) -> None:
        pods = [*self.prefill.endpoints.values(), *self.decode.endpoints.values()]
        await asyncio.gather(*(self._probe(ep) for ep in pods))

    async def _probe(self, ep: Endpoint) -> None:
        healthy, why = await self._is_healthy(ep)
        if healthy != ep.healthy:
            if healthy:
                log.info("%s pod %s is ready", ep.role, ep.name)
            else:
                log.warning("%s pod %s taken out: %s", ep.role, ep.name, why)
        ep.healthy = healthy

    async def _is_healthy(self, ep: Endpoint) -> tuple[bool, str]:
        try:
            timeout, headers = self._probe_timeout, self._probe_headers
            async with self.session.get(ep.url + "/health", timeout=timeout, headers=headers) as r:
                if r.status != 200:
                    return False, f"/health answered {r.status}"
            if ep.role == "prefill" and self.config.flow == "mooncake":
                url = flows.bootstrap_url(ep.host, self.config.mooncake_bootstrap_port) + "/query"
                async with self.session.get(url, timeout=self._probe_timeout) as r:
                    r.raise_for_status()
                    ep.engine_ids = flows.parse_bootstrap_query(await r.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            return False, repr(e)
        return True, ""

    # ---- the generation endpoints ----

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
            return self.generate(route, request, body=body, rid=rid, started=started)
        self.metrics.fast_requests += 1
        try:
            rid_line = b"X-Request-Id: " + header_value(rid) + b"\r\n"
        except RouterError as e:
            conn.reply(request, self.error_response(e, rid))
            self.account(route, rid, e.status, "-", "-", started, sent=True)
            return None
        headers = self.upstream_headers(request) + rid_line
        FastExchange(self, conn, request, route, body, rid, rid_line, headers, started).start()
        return None

    async def generate(
        self,
        route: str,
        request: Request,
        *,
        body: JsonObject | None = None,
        rid: str | None = None,
        started: float | None = None,
    ) -> Response | StreamWriter:
        """The coroutine path: every request the fast path does not take (streams, several prompts,
        the mooncake flow)."""
        started = perf_counter() if started is None else started
        answers: list[Answer] = []
        if rid is None:
            try:
                rid = request_id(request)
            except RouterError as e:
                rid = request_id_or_new(None)
                self.account(route, rid, e.status, "-", "-", started)
                return self.error_response(e, rid)
        try:
            raw = request.body
            if body is None:
                body = oa.parse_request(raw, route, self.limits)
            response = await self._serve(request, route, body, raw, rid, started, answers)
        except oa.BadRequest as e:
            response = self.error_response(RouterError(400, "bad_request", str(e)), rid)
        except RouterError as e:
            response = self.error_response(e, rid)
        except asyncio.CancelledError:
            self.metrics.errors["client_disconnect"] += 1
            log.info("%s %s client went away; upstream requests cancelled", rid, route)
            raise
        finally:
            for answer in answers:
                answer.release()
        prefill = ",".join(a.prefill.name for a in answers) or "-"
        decode = ",".join(a.decode.name if a.decode else "-" for a in answers) or "-"
        self.account(route, rid, response.status, prefill, decode, started)
        return response

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
        self.metrics.errors[error.kind] += 1
        log.warning("%s %s: %s", rid, error.kind, error)
        return Response(error.body, status=error.status, headers={"X-Request-Id": rid})

    def error_page(self, status: int, message: str, request: Request | None) -> Response:
        """The HTTP server's own refusals (malformed request 400, body over the limit 413, 404, ...)."""
        kind = _SERVER_ERROR_KINDS.get(status, "bad_request")
        rid = request_id_or_new(request)
        if kind not in ("not_found", "method_not_allowed"):
            self.metrics.errors[kind] += 1
        if kind == "bad_request":  # the others come in floods (503, 408): counted, not logged
            log.warning("%s %s: %s", rid, kind, message)
        if request is not None and request.path in GENERATION_ROUTES:
            self.metrics.requests[(request.path, status)] += 1
        return Response(oa.error_body(message, kind, status), status=status, headers={"X-Request-Id": rid})

    @property
    def body_limit_message(self) -> str:
        return f"request body over {self.config.max_body_mb} MiB (--max-body-mb)"

    async def _serve(
        self,
        request: Request,
        route: str,
        body: JsonObject,
        raw: bytes,
        rid: str,
        started: float,
        answers: list[Answer],
    ) -> Response | StreamWriter:
        stream = bool(body.get("stream"))
        prompts = oa.split_prompts(route, body)
        headers = self.upstream_headers(request)
        if len(prompts) == 1:
            answers.append(
                await self._exchange(route, Prompt(body, raw, rid, 0), headers, read_all=not stream)
            )
        else:
            answers += await self._exchange_all(route, prompts, rid, headers, read_all=not stream)
        if not stream:
            payload = self._joined_body(answers, body)
            self.metrics.ttft_seconds.observe(perf_counter() - started)
            return Response(payload, headers={"X-Request-Id": rid})
        response = request.stream({**SSE_HEADERS, "X-Request-Id": rid})
        if len(answers) == 1:
            chunks = self._relay_one(route, answers[0], body)
        else:
            chunks = self._relay_many(route, answers, body)
        first = True
        try:
            async for chunk in chunks:
                await response.write(chunk)
                if first:
                    self.metrics.ttft_seconds.observe(perf_counter() - started)
                    first = False
            await response.finish()
        except ConnectionResetError:
            self.metrics.errors["client_disconnect"] += 1
            log.info("%s %s client went away mid-stream; upstream requests cancelled", rid, route)
        finally:
            await chunks.aclose()
        return response

    async def _exchange_all(
        self, route: str, prompts: list[JsonObject], rid: str, headers: bytes, read_all: bool
    ) -> list[Answer]:
        gate = asyncio.Semaphore(EXCHANGES_PER_REQUEST)

        async def exchange(i: int, p: JsonObject) -> Answer:
            async with gate:  # until its answer (or its stream's head) is in
                return await self._exchange(route, Prompt(p, None, f"{rid}-{i}", i), headers, read_all)

        tasks = [asyncio.create_task(exchange(i, p)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            for result in done:
                if isinstance(result, Answer):
                    result.release()
            raise

    def _joined_body(self, answers: list[Answer], body: JsonObject) -> bytes:
        if len(answers) == 1:
            answer = answers[0]
            if answer.body is not None:
                return answer.body  # decode's bytes as they came: no re-encoding
            assert answer.finished is not None
            return oa.dumps(oa.public_answer(answer.finished))
        parsed = [a.finished if a.finished is not None else _json(a.body) for a in answers]
        return oa.dumps(oa.merge_answers(parsed, oa.choices_per_prompt(body)))

    # ---- one prompt: pick, call, retry ----

    async def _exchange(self, route: str, prompt: Prompt, headers: bytes, read_all: bool) -> Answer:
        tried: list[Endpoint] = []
        last: Unreachable | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.metrics.retries += 1
            try:
                return await self._attempt(route, prompt, headers, read_all, tried)
            except Unreachable as e:
                self.note_unreachable(e, prompt.rid, tried)
                last = e
        assert last is not None
        role = last.endpoint.role
        raise RouterError(502, f"{role}_unreachable", str(last))

    @staticmethod
    def note_unreachable(error: Unreachable, rid: str, tried: list[Endpoint]) -> None:
        """An attempt failed on a connection: that pod is not tried again for this prompt, and a pod
        that refused the connection is taken out at once."""
        ep = error.endpoint
        tried.append(ep)
        if error.connect_failed and ep.healthy:
            ep.healthy = False
            log.warning("%s %s pod %s taken out: %s", rid, ep.role, ep.name, error)

    def pick(self, pool: Pool, tried: list[Endpoint]) -> Endpoint:
        ep = pool.pick(tried)
        if ep is None:
            raise RouterError(503, f"no_{pool.role}", f"no ready {pool.role} pod", None)
        return ep

    async def _attempt(
        self, route: str, prompt: Prompt, headers: bytes, read_all: bool, tried: list[Endpoint]
    ) -> Answer:
        body = prompt.body
        p = self.pick(self.prefill, tried)
        up_headers = headers + b"X-Request-Id: " + header_value(prompt.rid) + b"\r\n"
        if oa.asks_one_token(body):  # prefill alone answers; no KV moves
            self.metrics.prefill_answers += 1
            answer = Answer(prefill=p, decode=p)
            await self._open(
                answer, p, route, oa.decode_payload(body, prompt.raw, None), up_headers, read_all
            )
            return answer
        d = self.pick(self.decode, tried)
        plan = self.plan(prompt.rid, prompt.index, p, d)
        prefill_call = self._call_prefill(
            p,
            route,
            oa.dumps(oa.prefill_request(body, plan.prefill_kv)),
            up_headers + plan.prefill_headers,
        )
        answer = Answer(prefill=p, decode=d)
        if plan.concurrent:
            assert plan.decode_kv is not None
            decode_call = self._open(
                answer, d, route, oa.decode_payload(body, prompt.raw, plan.decode_kv), up_headers, read_all
            )
            return await self._concurrently(answer, prefill_call, decode_call, body)
        finished = await prefill_call
        answer.prefill_done = perf_counter()
        if oa.finished_at_prefill(finished, body):
            self.metrics.prefill_answers += 1
            answer.finished, answer.decode = finished, None
            return answer
        kv = finished.get("kv_transfer_params")
        await self._open(
            answer, d, route, oa.decode_payload(body, prompt.raw, kv or None), up_headers, read_all
        )
        return answer

    def plan(self, rid: str, index: int, p: Endpoint, d: Endpoint) -> flows.PairPlan:
        flow = self.config.flow
        if flow == "dllm":
            return self._dllm_plans.plan(rid, index, p.host, d.host)
        if flow == "mooncake":
            rank = p.next_dp_rank % max(len(p.engine_ids), 1)
            p.next_dp_rank += 1
            addr = flows.bootstrap_url(p.host, self.config.mooncake_bootstrap_port)
            return flows.mooncake_plan(rid, index, addr, p.engine_ids[rank], rank, len(p.engine_ids))
        return flows.nixl_plan()

    async def _concurrently(
        self,
        answer: Answer,
        prefill_call: Awaitable[JsonObject],
        decode_call: Awaitable[None],
        body: JsonObject,
    ) -> Answer:
        """Prefill and decode at once; decode's answer is used only once prefill has answered well."""
        ptask = asyncio.ensure_future(prefill_call)
        dtask = asyncio.ensure_future(decode_call)
        try:
            done, _ = await asyncio.wait((ptask, dtask), return_when=asyncio.FIRST_COMPLETED)
            if ptask not in done and dtask.exception() is not None:
                await _cancel(ptask)
                dtask.result()  # raises decode's failure
            finished = await ptask
            answer.prefill_done = perf_counter()
            if oa.finished_at_prefill(finished, body):
                self.metrics.prefill_answers += 1
                await _cancel(dtask)
                answer.release()
                answer.finished, answer.decode, answer.body = finished, None, None
                return answer
            await dtask
            return answer
        except BaseException:
            await _cancel(ptask)
            await _cancel(dtask)
            answer.release()
            raise

    async def _call_prefill(self, ep: Endpoint, route: str, payload: bytes, headers: bytes) -> JsonObject:
        started = perf_counter()
        ep.inflight += 1
        try:
            response = await self._upstream(ep).post(route, headers, payload, self.config.request_timeout_s)
            try:
                data = await response.read()
            finally:
                response.close()
        except (UpstreamError, TimeoutError) as e:
            raise self.upstream_failure(ep, e) from e
        finally:
            ep.inflight -= 1
        if response.status != 200:
            raise pod_error(ep, response.status, data)
        self.metrics.prefill_seconds.observe(perf_counter() - started)
        return prefill_answer(data, ep)

    async def _open(
        self,
        answer: Answer,
        ep: Endpoint,
        route: str,
        payload: bytes,
        headers: bytes,
        read_all: bool,
    ) -> None:
        """Send the answering call (decode; prefill for one-token requests): read it all, or keep it open."""
        ep.inflight += 1
        response: UpstreamResponse | None = None
        try:
            response = await self._upstream(ep).post(route, headers, payload, self.config.request_timeout_s)
            if response.status != 200 or read_all:
                data = await response.read()
                if response.status != 200:
                    raise pod_error(ep, response.status, data)
                answer.body = data
                self._observe_first_byte(answer)
        except BaseException as e:
            ep.inflight -= 1
            if response is not None:
                response.close()
            if isinstance(e, UpstreamError | TimeoutError):
                raise self.upstream_failure(ep, e) from e
            raise
        if read_all:
            ep.inflight -= 1
        else:
            answer.stream = response

    @staticmethod
    def _upstream(ep: Endpoint) -> UpstreamPool:
        assert ep.upstream is not None, "discover() attaches a pool to every endpoint"
        return ep.upstream

    def upstream_failure(self, ep: Endpoint, error: BaseException) -> Exception:
        if isinstance(error, TimeoutError):
            limit = self.config.request_timeout_s
            return RouterError(504, "timeout", f"{ep.role} pod {ep.name} timed out after {limit}s")
        return Unreachable(ep, error, connect_failed=isinstance(error, ConnectFailed))

    def _observe_first_byte(self, answer: Answer) -> None:
        self.metrics.decode_first_byte_seconds.observe(max(perf_counter() - answer.prefill_done, 0.0))

    # ---- relaying streams ----

    async def _relay_one(self, route: str, answer: Answer, body: JsonObject) -> AsyncGenerator[bytes]:
        if answer.finished is not None:
            yield oa.sse(oa.answer_as_events(route, answer.finished, body))
            return
        assert answer.stream is not None
        first = True
        try:
            async for chunk in answer.stream.chunks():
                if first:
                    self._observe_first_byte(answer)
                    first = False
                yield chunk
        except (UpstreamError, TimeoutError) as e:
            yield self._broken_stream(answer, e)

    def _broken_stream(self, answer: Answer, error: BaseException) -> bytes:
        self.metrics.errors["stream_broken"] += 1
        name = answer.decode.name if answer.decode else answer.prefill.name
        log.warning("stream from %s broke: %r", name, error)
        return (
            b"data: "
            + oa.error_body(f"upstream {name} stream broke: {error!r}", "stream_broken", 502)
            + b"\n\n"
        )

    async def _relay_many(self, route: str, answers: list[Answer], body: JsonObject) -> AsyncGenerator[bytes]:
        """Several prompts' streams interleaved, choices renumbered, one usage chunk and one [DONE]."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(RELAY_QUEUE)  # pumps wait for a slow client
        usage: JsonObject = {}
        n = oa.choices_per_prompt(body)

        async def pump(i: int, answer: Answer) -> None:
            try:
                async for payload in self._payloads(route, answer, body):
                    if payload == oa.DONE:
                        continue
                    event = oa.loads(payload)
                    if event.get("choices"):
                        await queue.put(b"data: " + oa.dumps(oa.shift_choices(event, i * n)) + b"\n\n")
                    else:
                        oa.add_usage(usage, event.get("usage"))
            except (UpstreamError, TimeoutError, ValueError) as e:  # ValueError: an event that is not JSON
                await queue.put(self._broken_stream(answer, e))
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

    async def _payloads(self, route: str, answer: Answer, body: JsonObject) -> AsyncGenerator[bytes]:
        if answer.finished is not None:
            for payload in oa.answer_as_events(route, answer.finished, body):
                yield payload
            return
        assert answer.stream is not None
        splitter = oa.SseSplitter()
        async for chunk in answer.stream.chunks():
            for payload in splitter.feed(chunk):
                yield payload

    # ---- the other endpoints ----

    async def models(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep = self.pick(self.decode, [])
            headers = dict(self._probe_headers)  # L5: the engines' key, else the client's own
            auth = request.header(b"authorization")
            if not headers and auth is not None:
                headers["Authorization"] = auth.decode("latin-1")
            try:
                url = ep.url + "/v1/models"
                async with self.session.get(url, timeout=self._probe_timeout, headers=headers) as r:
                    return Response(await r.read(), status=r.status)
            except (TimeoutError, aiohttp.ClientError) as e:
                raise RouterError(502, "decode_unreachable", f"decode pod {ep.name}: {e!r}") from e
        except RouterError as e:
            return self.error_response(e, rid)

    def _pool_state(self) -> JsonObject:
        return {
            pool.role: {"ready": len(pool.ready()), "pods": len(pool.endpoints)}
            for pool in (self.prefill, self.decode)
        }

    async def health(self, _: Request) -> Response:
        """Liveness: the router itself is up (200), with each role's ready and known pods."""
        state = self._pool_state()
        ok = all(role["ready"] for role in state.values())
        status = "ok" if ok else "degraded"
        return Response(oa.dumps({"status": status, "flow": self.config.flow, **state}))

    async def ready(self, _: Request) -> Response:
        """Readiness: 200 only when both roles have a ready pod; else 503 naming the missing roles."""
        state = self._pool_state()
        missing = [role for role, s in state.items() if not s["ready"]]
        if missing:
            message = "no ready " + " or ".join(missing) + " pod"
            return Response(oa.error_body(message, "service_unavailable", 503), status=503)
        return Response(oa.dumps({"status": "ok", **state}))

    async def metrics_page(self, _: Request) -> Response:
        return Response(self._exposition(), content_type=prometheus_client.CONTENT_TYPE_LATEST)

    def upstream_headers(self, request: Request) -> bytes:
        """The header lines both engine calls carry besides X-Request-Id: the engines' key when one is
        configured (DLLM_ENGINE_API_KEY, instead of the client's), else the client's Authorization."""
        if self._engine_auth is not None:
            return _JSON_LINE + self._engine_auth
        auth = request.header(b"authorization")
        if auth is None:
            return _JSON_LINE
        return _JSON_LINE + b"Authorization: " + auth + b"\r\n"  # the parser refuses line breaks in values


_JSON_LINE = b"Content-Type: application/json\r\n"


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


_SERVER_ERROR_KINDS = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    500: "internal_error",
    503: "too_many_connections",
}


def _json(data: bytes | None) -> JsonObject:
    parsed = oa.loads(data or b"{}")
    if not isinstance(parsed, dict):
        raise RouterError(502, "decode_error", "decode answered a non-object")
    return parsed


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
        head_timeout_s=router.config.head_timeout_s,
        body_timeout_s=router.config.body_timeout_s,
    )
    await server.start(host, port)
    router.metrics.open_connections = lambda: len(server.connections)
    return server
