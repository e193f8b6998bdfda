"""The coroutine path: every generation request the fast path does not take (streams, several prompts,
the mooncake flow), served by a task.

Its prompts are exchanged at once (at most EXCHANGES_PER_REQUEST pairs of calls in flight), then the
answers are joined into one body, or their streams relayed; a client that leaves cancels the task, and
with it every upstream call.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter
from typing import Any

import msgspec

from dllm_router import openai as oa
from dllm_router.engine_answer import EngineAnswer
from dllm_router.engine_auth import EngineAuth
from dllm_router.errors import RouterError, request_id, request_id_or_new
from dllm_router.exchange import ExchangeHost
from dllm_router.http_messages import Request, Response, StreamWriter
from dllm_router.memory_budget import BudgetSpent, MemoryBudget, RequestBytes
from dllm_router.metrics import Metrics
from dllm_router.prompt_exchange import Answer, Prompt, PromptExchange, decode_name
from dllm_router.stream_relay import relay_many, relay_one
from dllm_router.trace_context import trace_lines

log = logging.getLogger(__name__)
JsonObject = dict[str, Any]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
EXCHANGES_PER_REQUEST = 16  # H2: one request's prompts run at most this many pairs of calls at once


class CoroutinePath:
    def __init__(self, host: ExchangeHost, auth: EngineAuth, limits: oa.Limits, budget: MemoryBudget) -> None:
        self._host, self._auth, self._limits, self._budget = host, auth, limits, budget
        self._prompts = PromptExchange(host)

    async def generate(
        self,
        route: str,
        request: Request,
        *,
        body: JsonObject | None = None,
        rid: str | None = None,
        started: float | None = None,
    ) -> Response | StreamWriter:
        """A generation request from its head to its answer (`body`, `rid`: already read by the fast
        path's front door)."""
        host = self._host
        started = perf_counter() if started is None else started
        answers: list[Answer] = []
        ledger = self._budget.ledger()  # its body and answers held (NEW-1), given back when it ends
        if rid is None:
            try:
                rid = request_id(request)
            except RouterError as e:
                rid = request_id_or_new(None)
                host.account(route, rid, e.status, "-", "-", started)
                return host.error_response(e, rid)
        try:
            raw = request.body
            ledger.charge_body(len(raw))
            if body is None:
                body = oa.parse_request(raw, route, self._limits)
            response = await self._serve(request, route, body, raw, rid, started, answers, ledger)
        except oa.BadRequest as e:
            response = host.error_response(RouterError(400, "bad_request", str(e)), rid)
        except RouterError as e:
            response = host.error_response(e, rid)
        except BudgetSpent as e:
            response = host.error_response(RouterError(503, "memory_budget", str(e)), rid)
        except asyncio.CancelledError:
            host.metrics.errors["client_disconnect"] += 1
            log.info("%s %s client went away; upstream requests cancelled", rid, route)
            raise
        finally:
            for answer in answers:
                answer.release()
            ledger.release()
        prefill = ",".join(a.prefill.name for a in answers) or "-"
        decode = ",".join(a.decode.name if a.decode else "-" for a in answers) or "-"
        host.account(route, rid, response.status, prefill, decode, started)
        return response

    async def _serve(
        self,
        request: Request,
        route: str,
        body: JsonObject,
        raw: bytes,
        rid: str,
        started: float,
        answers: list[Answer],
        ledger: RequestBytes,
    ) -> Response | StreamWriter:
        metrics = self._host.metrics
        stream = bool(body.get("stream"))
        prompts = oa.split_prompts(route, body)
        headers = self._auth.call_headers(request) + trace_lines(request)
        if len(prompts) == 1:
            prompt = Prompt(body, raw, rid, 0)
            answers.append(await self._prompts.exchange(route, prompt, headers, not stream, ledger))
        else:
            answers += await self._exchange_all(route, prompts, rid, headers, not stream, ledger)
        if not stream:
            payload = _joined_body(answers, body)
            observe_ttft(metrics, answers, perf_counter() - started)
            return Response(payload, headers={"X-Request-Id": rid})
        response = request.stream({**SSE_HEADERS, "X-Request-Id": rid})
        if len(answers) == 1:
            chunks = relay_one(route, answers[0], body, metrics)
        else:
            chunks = relay_many(route, answers, body, metrics)
        first = True
        try:
            async for chunk in chunks:
                await response.write(chunk)
                if first:
                    observe_ttft(metrics, answers, perf_counter() - started)
                    first = False
            await response.finish()
        except ConnectionResetError:
            metrics.errors["client_disconnect"] += 1
            log.info("%s %s client went away mid-stream; upstream requests cancelled", rid, route)
        finally:
            await chunks.aclose()
        return response

    async def _exchange_all(
        self,
        route: str,
        prompts: list[JsonObject],
        rid: str,
        headers: bytes,
        read_all: bool,
        ledger: RequestBytes,
    ) -> list[Answer]:
        gate = asyncio.Semaphore(EXCHANGES_PER_REQUEST)

        async def exchange(i: int, p: JsonObject) -> Answer:
            async with gate:  # until its answer (or its stream's head) is in
                prompt = Prompt(p, None, f"{rid}-{i}", i)
                return await self._prompts.exchange(route, prompt, headers, read_all, ledger)

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


def _joined_body(answers: list[Answer], body: JsonObject) -> bytes:
    if len(answers) == 1:
        answer = answers[0]
        if answer.body is not None:
            return answer.body  # decode's bytes as they came: no re-encoding
        assert answer.finished is not None
        return answer.finished.public()
    parts = [a.finished if a.finished is not None else _parts(a.body) for a in answers]
    return oa.merge_answers(parts, oa.choices_per_prompt(body))


def _parts(data: bytes | None) -> EngineAnswer:
    """Decode's answer by its raw top-level fields: merged without being parsed whole (NEW-1)."""
    try:
        return EngineAnswer.parse(data or b"{}")
    except msgspec.ValidationError:
        raise RouterError(502, "decode_error", "decode answered a non-object") from None
    except ValueError:
        raise RouterError(502, "decode_error", "decode answered non-JSON") from None


def observe_ttft(metrics: Metrics, answers: list[Answer], seconds: float) -> None:
    """The request's time to first byte; per pair for a single prompt (several prompts have several)."""
    if len(answers) == 1:
        metrics.observe("ttft", answers[0].prefill.name, decode_name(answers[0]), seconds)
    else:
        metrics.ttft_seconds.observe(seconds)
