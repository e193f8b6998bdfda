"""One prompt on the coroutine path: pick a prefill and a decode pod, send the flow's two calls, and
retry on another pair when a connection failed, or a pod answered a server error, before any byte
reached the client.

Nothing reaches the client before prefill has answered, so a prefill error, a prefill that already
finished the answer, or an unreachable pod is still handled cleanly. The answer comes back whole
(`read_all`), or as decode's open stream for the relay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from dllm_router import openai as oa
from dllm_router.endpoints import Endpoint
from dllm_router.engine_answer import EngineAnswer
from dllm_router.errors import Unreachable, header_value, pod_failure, prefill_answer
from dllm_router.exchange import ExchangeHost
from dllm_router.memory_budget import RequestBytes
from dllm_router.metrics import Metrics
from dllm_router.upstream import ConnectFailed, UpstreamError, UpstreamPool
from dllm_router.upstream import Response as UpstreamResponse

JsonObject = dict[str, Any]


@dataclass
class Answer:
    """One prompt's answer: prefill's finished JSON, decode's full body, or decode's open stream."""

    prefill: Endpoint
    decode: Endpoint | None = None
    finished: EngineAnswer | None = None
    body: bytes | None = None
    stream: UpstreamResponse | None = None
    prefill_done: float = field(default_factory=perf_counter)
    decode_ok: bool = False  # decode answered 200: it took the transfer
    prefill_refused: bool = False  # prefill answered an error or was never reached: it sends nothing

    def release(self) -> None:
        """Close its stream, and drop the bytes it holds: an Answer may outlive its request in a
        traceback's reference cycle (a failed sibling prompt's), kept until the garbage collector runs,
        and what it held was given back to the memory budget when the request ended (NEW-1)."""
        self.body = self.finished = None
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


def observe_first_byte(metrics: Metrics, answer: Answer) -> None:
    seconds = max(perf_counter() - answer.prefill_done, 0.0)
    metrics.observe("decode_first_byte", answer.prefill.name, decode_name(answer), seconds)


def decode_name(answer: Answer) -> str:
    """The answer's decode pod, "-" when prefill answered alone."""
    return answer.decode.name if answer.decode is not None else "-"


class PromptExchange:
    def __init__(self, host: ExchangeHost) -> None:
        self._host = host
        # read per prompt: plain attributes, not the pydantic model's (see Pairing)
        self._retries = host.config.retries
        self._timeout_s = host.config.request_timeout_s

    async def exchange(
        self, route: str, prompt: Prompt, headers: bytes, read_all: bool, ledger: RequestBytes | None = None
    ) -> Answer:
        """The prompt's answer from the first pair that answers; 502 when every attempt was unreachable."""
        host = self._host
        tried: list[Endpoint] = []
        last: Unreachable | None = None
        for attempt in range(self._retries + 1):
            if attempt:
                host.metrics.retries += 1
            try:
                return await self._attempt(route, prompt, headers, read_all, tried, ledger)
            except Unreachable as e:
                host.note_unreachable(e, prompt.rid, tried)
                last = e
        assert last is not None
        raise last.final()

    async def _attempt(
        self,
        route: str,
        prompt: Prompt,
        headers: bytes,
        read_all: bool,
        tried: list[Endpoint],
        ledger: RequestBytes | None,
    ) -> Answer:
        host, body = self._host, prompt.body
        # answers read whole are charged to the request (NEW-1); a stream is relayed as it comes
        whole = ledger if read_all else None
        p = host.pick(host.prefill, tried, host.decode)
        up_headers = headers + b"X-Request-Id: " + header_value(prompt.rid) + b"\r\n"
        if oa.asks_one_token(body):  # prefill alone answers; no KV moves
            host.metrics.prefill_answers += 1
            answer = Answer(prefill=p, decode=p)
            await self._open(
                answer, p, route, oa.decode_payload(body, prompt.raw, None), up_headers, read_all, whole
            )
            return answer
        d = host.pick(host.decode, tried, p)
        plan = host.plan(prompt.rid, prompt.index, p, d)
        answer = Answer(prefill=p, decode=d)
        prefill_call = self._call_prefill(
            p,
            route,
            oa.dumps(oa.prefill_request(body, plan.prefill_kv)),
            up_headers + plan.prefill_headers,
            answer,
            ledger,
        )
        if plan.concurrent:
            assert plan.decode_kv is not None
            decode_call = self._open(
                answer,
                d,
                route,
                oa.decode_payload(body, prompt.raw, plan.decode_kv),
                up_headers,
                read_all,
                whole,
            )
            if plan.end_id is None:
                return await self._concurrently(answer, prefill_call, decode_call, body)
            try:
                return await self._concurrently(answer, prefill_call, decode_call, body)
            finally:  # also when the client left (cancelled): the end runs in the background
                if not answer.decode_ok and not answer.prefill_refused:
                    host.end_transfer(d, plan.end_id, up_headers)
        finished = await prefill_call
        answer.prefill_done = perf_counter()
        if oa.finished_at_prefill(finished, body):
            host.metrics.prefill_answers += 1
            answer.finished, answer.decode = finished, None
            return answer
        kv = finished.value(oa.CLIENT_KV)
        await self._open(
            answer, d, route, oa.decode_payload(body, prompt.raw, kv or None), up_headers, read_all, whole
        )
        return answer

    async def _concurrently(
        self,
        answer: Answer,
        prefill_call: Awaitable[EngineAnswer],
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
                self._host.metrics.prefill_answers += 1
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

    async def _call_prefill(
        self,
        ep: Endpoint,
        route: str,
        payload: bytes,
        headers: bytes,
        answer: Answer,
        ledger: RequestBytes | None,
    ) -> EngineAnswer:
        host = self._host
        started = perf_counter()
        ep.inflight += 1
        try:
            response = await _upstream(ep).post(route, headers, payload, self._timeout_s, ledger)
            try:
                data = await response.read()
            finally:
                response.close()
        except (UpstreamError, TimeoutError) as e:
            answer.prefill_refused = isinstance(e, ConnectFailed)
            raise host.upstream_failure(ep, e) from e
        finally:
            ep.inflight -= 1
        if response.status != 200:
            answer.prefill_refused = True
            raise pod_failure(ep, response.status, data)
        host.metrics.observe("prefill", ep.name, decode_name(answer), perf_counter() - started)
        try:
            return prefill_answer(data, ep)
        except Unreachable:
            answer.prefill_refused = True  # it ran nothing: nothing of it to end on decode
            raise

    async def _open(
        self,
        answer: Answer,
        ep: Endpoint,
        route: str,
        payload: bytes,
        headers: bytes,
        read_all: bool,
        ledger: RequestBytes | None,
    ) -> None:
        """Send the answering call (decode; prefill for one-token requests): read it all, or keep it open."""
        host = self._host
        ep.inflight += 1
        response: UpstreamResponse | None = None
        try:
            response = await _upstream(ep).post(route, headers, payload, self._timeout_s, ledger)
            if response.status != 200 or read_all:
                data = await response.read()
                if response.status != 200:
                    raise pod_failure(ep, response.status, data)
                answer.body = data
                observe_first_byte(host.metrics, answer)
            answer.decode_ok = True
        except BaseException as e:
            ep.inflight -= 1
            if response is not None:
                response.close()
            if isinstance(e, UpstreamError | TimeoutError):
                raise host.upstream_failure(ep, e) from e
            raise
        if read_all:
            ep.inflight -= 1
        else:
            answer.stream = response


def _upstream(ep: Endpoint) -> UpstreamPool:
    assert ep.upstream is not None, "discover() attaches a pool to every endpoint"
    return ep.upstream


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
