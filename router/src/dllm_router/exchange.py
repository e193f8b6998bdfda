"""What a request path needs from the router: pods, the pick, the plan, accounting and errors.

Both request paths, the fast path's callbacks (fastpath.py) and the coroutine path's tasks
(coroutine_path.py), drive requests against this interface, and the Router (server.py) provides it;
the paths never import the server, so there is no import cycle between them.
"""

from __future__ import annotations

from typing import Protocol

from dllm_router import flows
from dllm_router.config import RouterConfig
from dllm_router.endpoints import Endpoint, Pool
from dllm_router.errors import RouterError, Unreachable
from dllm_router.http_messages import Response
from dllm_router.metrics import Metrics
from dllm_router.upstream import Deadlines


class ExchangeHost(Protocol):
    config: RouterConfig
    prefill: Pool
    decode: Pool
    metrics: Metrics
    deadlines: Deadlines  # the fast path's upstream calls

    def pick(self, pool: Pool, tried: list[Endpoint], partner: Pool | Endpoint | None = None) -> Endpoint: ...

    def plan(self, rid: str, index: int, p: Endpoint, d: Endpoint) -> flows.PairPlan: ...

    def note_unreachable(self, error: Unreachable, rid: str, tried: list[Endpoint]) -> None: ...

    def error_response(self, error: RouterError, rid: str) -> Response: ...

    def upstream_failure(self, ep: Endpoint, error: BaseException) -> Exception: ...

    def end_transfer(self, ep: Endpoint, transfer_id: str, headers: bytes) -> None:
        """In the background: tell decode pod `ep` to end `transfer_id` (M2, transfer_end.py)."""
        ...

    def account(
        self, route: str, rid: str, status: int, prefill: str, decode: str, started: float, sent: bool = False
    ) -> None: ...
