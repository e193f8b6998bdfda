"""One prompt's pair of pods, what its two calls carry, and which failures another pair may retry.

Both request paths (the fast path's callbacks, the coroutine path's tasks) choose and plan through
here, so a prompt is paired and retried the same way whichever path serves it.
"""

from __future__ import annotations

import logging

from dllm_router import flows
from dllm_router.config import RouterConfig
from dllm_router.endpoints import Endpoint, Pool
from dllm_router.errors import RouterError, Unreachable
from dllm_router.fingerprint_pairs import FingerprintPairs
from dllm_router.memory_budget import AnswerTooLarge, BudgetSpent
from dllm_router.upstream import ConnectFailed

log = logging.getLogger(__name__)


class Pairing:
    def __init__(self, config: RouterConfig, fingerprint_pairs: FingerprintPairs) -> None:
        # the settings read per prompt, as plain attributes: a pydantic model's attribute read costs
        # more (its __getattr__ hook makes every read take the slow path; docs/benchmarks.md)
        self._flow = config.flow
        self._bootstrap_port = config.mooncake_bootstrap_port
        self._timeout_s = config.request_timeout_s
        self._dllm_plans = flows.DllmPlans(config)
        self._count_pair = fingerprint_pairs.count

    def pick(self, pool: Pool, tried: list[Endpoint], partner: Pool | Endpoint | None = None) -> Endpoint:
        """The pool's least busy ready pod not tried yet for this prompt; 503 when it has none.

        With a `partner`, only a pod whose KV fingerprint fits the partner's (a pool: any of its ready
        pods'; a pod: its own; endpoints.fits): during a rollout, a prefill pod sends its KV only to a
        decode pod that reads it, and each fingerprint takes requests as its pairs come (issue 34)."""
        partners = [partner] if isinstance(partner, Endpoint) else partner.ready() if partner else []
        if not partners:
            ep = pool.pick(tried)  # no partner to fit yet: the partner's own pick says what is missing
        else:
            ep = pool.pick(tried, {other.fingerprint for other in partners})
            if ep is None and pool.ready():
                raise RouterError(
                    503,
                    "no_compatible_pair",
                    f"no ready {pool.role} pod shares a KV fingerprint with a ready {partners[0].role} pod",
                    None,
                )
        if ep is None:
            raise RouterError(503, f"no_{pool.role}", f"no ready {pool.role} pod", None)
        return ep

    def plan(self, rid: str, index: int, p: Endpoint, d: Endpoint) -> flows.PairPlan:
        """What prefill and decode are told for prompt `index` of request `rid`, in the configured flow."""
        self._count_pair(p.fingerprint, d.fingerprint)
        flow = self._flow
        if flow == "dllm":
            return self._dllm_plans.plan(rid, index, p.host, d.host)
        if flow == "mooncake":
            rank = p.next_dp_rank % max(len(p.engine_ids), 1)
            p.next_dp_rank += 1
            addr = flows.bootstrap_url(p.host, self._bootstrap_port)
            return flows.mooncake_plan(rid, index, addr, p.engine_ids[rank], rank, len(p.engine_ids))
        return flows.nixl_plan()

    @staticmethod
    def note_unreachable(error: Unreachable, rid: str, tried: list[Endpoint]) -> None:
        """An attempt failed on a connection: that pod is not tried again for this prompt, and a pod
        that refused the connection is taken out at once."""
        ep = error.endpoint
        tried.append(ep)
        if error.connect_failed and ep.healthy:
            ep.healthy = False
            log.warning("%s %s pod %s taken out: %s", rid, ep.role, ep.name, error)

    def upstream_failure(self, ep: Endpoint, error: BaseException) -> Exception:
        """An upstream call's failure as the request sees it: a 504 after the timeout, else Unreachable
        (retried on another pair)."""
        if isinstance(error, AnswerTooLarge):  # NEW-1: the request asked too much; no other pod helps
            return RouterError(502, "answer_too_large", f"{ep.role} pod {ep.name}: {error}")
        if isinstance(error, BudgetSpent):
            return RouterError(503, "memory_budget", str(error))
        if isinstance(error, TimeoutError):
            limit = self._timeout_s
            return RouterError(504, "timeout", f"{ep.role} pod {ep.name} timed out after {limit}s")
        return Unreachable(ep, error, connect_failed=isinstance(error, ConnectFailed))
