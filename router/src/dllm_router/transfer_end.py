"""Ending a transfer id on its decode pod when decode failed after prefill ran (security review M2).

In the dllm flow prefill pushes a prompt's KV to decode under a transfer id the router generated. When
decode then fails that prompt (an error status, a connection error or timeout, or the client leaving
before decode's answer), prefill's sender would hold the prompt's blocks for its hold time (480 s by
default) waiting for decode to accept. The router then posts `{"transfer_id": ...}` to that decode
pod's `POST /v1/dllm/end_transfer` (dllm_connector.end_route), which tells decode's side channel to
refuse the id at once. Nothing new is trusted: the call goes to the HTTP port the router already
calls, with the same engine credentials; the router never reaches the KV side channel.

The calls run in the background, never delaying an answer, at most MAX_IN_FLIGHT at once (more are
dropped and counted), each bounded by END_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from dllm_router.endpoints import Endpoint
from dllm_router.metrics import Metrics
from dllm_router.upstream import UpstreamError

log = logging.getLogger(__name__)

END_PATH = "/v1/dllm/end_transfer"
MAX_IN_FLIGHT = 256
END_TIMEOUT_S = 15.0  # decode ends the id on all its TP ranks at once, each within its transfer timeout


class TransferEnds:
    def __init__(self, metrics: Metrics, timeout_s: float = END_TIMEOUT_S) -> None:
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak refs)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def end(self, ep: Endpoint, transfer_id: str, headers: bytes) -> None:
        """Tell decode pod `ep` to end `transfer_id`, in the background; `headers`: the header lines the
        prompt's engine calls carry (the engine credentials, Content-Type: application/json)."""
        if len(self._tasks) >= MAX_IN_FLIGHT:
            self._metrics.transfer_ends["dropped"] += 1
            log.warning("transfer %s not ended on %s: %d ends in flight", transfer_id, ep.name, MAX_IN_FLIGHT)
            return
        task = asyncio.get_running_loop().create_task(self._post(ep, transfer_id, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, ep: Endpoint, transfer_id: str, headers: bytes) -> None:
        body = msgspec.json.encode({"transfer_id": transfer_id})
        upstream = ep.upstream
        status: int | None = None
        reason = ""
        try:
            if upstream is None:  # the pod left meanwhile
                raise UpstreamError("the pod left")
            async with asyncio.timeout(self._timeout_s):
                response = await upstream.post(END_PATH, headers, body, self._timeout_s)
                try:
                    data = await response.read()
                finally:
                    response.close()
            status = response.status
            reason = data[:200].decode("utf-8", "replace")
        except (UpstreamError, TimeoutError) as error:
            reason = str(error)[:200]
        if status is not None and 200 <= status < 300:
            self._metrics.transfer_ends["sent"] += 1
            return
        self._metrics.transfer_ends["failed"] += 1
        log.warning(
            "transfer %s not ended on decode pod %s (%s): %s",
            transfer_id,
            ep.name,
            status if status is not None else "no answer",
            reason,
        )

    async def close(self) -> None:
        """Stop the ends still in flight (the router is shutting down)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
