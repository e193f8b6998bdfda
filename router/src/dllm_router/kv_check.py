"""The KV check: a small canary prompt through each ready prefill/decode pair, proving from decode's own
account that the KV moved (kv_verdict.py says what the account means).

Why in the router: it already holds the engines' key, is the one pod the engines' NetworkPolicy admits
on their HTTP port, and sees the same pairs its users' requests take, so the check needs no new
credential and no wider policy. Each pair is checked when it first becomes ready (a new pod is a new
pair) and again every `--kv-check-interval` seconds; one canary at a time, at most one a second. The
canary is marked (request ids `dllm-kv-check-...`) and counted in none of the router's request metrics;
vLLM's own counters on the two engines do count its few tokens.

Its calls are those of the dllm flow: prefill is told to push to decode under a transfer id of the
check's own, decode is told to wait for it, both at once; then decode is asked for its record of that
id (`POST /v1/dllm/transfer_record`). When a call fails, the id is ended on decode first (as the router
does for its users' requests), so decode gives up the wait and its record says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dllm_contract.pd_params import new_transfer_id
from dllm_router import openai as oa
from dllm_router.config import RouterConfig
from dllm_router.endpoints import Endpoint, Pool, fits
from dllm_router.flows import PairPlan
from dllm_router.kv_verdict import REASONS, Verdict, judge, overall
from dllm_router.transfer_end import END_PATH

log = logging.getLogger(__name__)

RECORD_PATH = "/v1/dllm/transfer_record"
REQUEST_PREFIX = "dllm-kv-check"
MIN_GAP_S = 1.0  # between two canaries
CANARY_WORDS = 24  # a few tokens: enough for a block of most models' caches to move
# An engine's answer to the check is a few hundred bytes (one token, a record); more is not read.
MAX_ANSWER_BYTES = 64 * 1024

JsonObject = dict[str, Any]
Planner = Callable[[str, int, Endpoint, Endpoint], PairPlan]


def canary_prompt() -> str:
    """Words no user sends, so no prefix cache holds them and decode can only load or compute them."""
    return " ".join(secrets.token_hex(3) for _ in range(CANARY_WORDS))


class KVCheck:
    def __init__(
        self,
        config: RouterConfig,
        prefill: Pool,
        decode: Pool,
        plan: Planner,
        session: Callable[[], aiohttp.ClientSession],
        headers: dict[str, str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config, self._prefill, self._decode = config, prefill, decode
        self._plan, self._session, self._headers, self._clock = plan, session, headers, clock
        self._timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
        self._models: dict[str, str] = {}  # decode pod -> the model it serves
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self.checks: dict[str, int] = dict.fromkeys(REASONS, 0)
        # (role, pod, kind) -> what the canaries added to that engine's own counters: requests it
        # answered, and on decode the prompt tokens, KV bytes and wire bytes it loaded
        self.engine_totals: dict[tuple[str, str, str], float] = {}
        self.in_flight = 0  # canaries under way (at most one)

    @property
    def enabled(self) -> bool:
        return self._config.flow == "dllm" and self._config.kv_check_interval_s > 0

    def pairs(self) -> list[tuple[Endpoint, Endpoint]]:
        """The ready pairs the router would send a request through (their KV fingerprints fit)."""
        decodes = self._decode.ready()
        return [
            (p, d) for p in self._prefill.ready() for d in decodes if fits(p.fingerprint, (d.fingerprint,))
        ]

    def due(self) -> tuple[Endpoint, Endpoint] | None:
        """The ready pair to check next (never checked first, then the oldest past the interval); the
        verdicts of pairs that are gone are dropped."""
        pairs = self.pairs()
        names = {(p.name, d.name) for p, d in pairs}
        self.verdicts = {key: v for key, v in self.verdicts.items() if key in names}
        now = self._clock()
        due = [
            (self.verdicts[(p.name, d.name)].checked_at if (p.name, d.name) in self.verdicts else 0.0, p, d)
            for p, d in pairs
        ]
        stale = [(at, p, d) for at, p, d in due if at == 0.0 or now - at >= self._config.kv_check_interval_s]
        if not stale:
            return None
        _, p, d = min(stale, key=lambda item: item[0])
        return p, d

    async def run(self) -> None:
        """Check pairs as they come due, for as long as the router runs."""
        while True:
            pair = self.due()
            if pair is not None:
                try:
                    await self.check(*pair)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug here must not stop the checks to come
                    log.exception("the KV check of %s -> %s failed", pair[0].name, pair[1].name)
            await asyncio.sleep(MIN_GAP_S)

    async def check(self, p: Endpoint, d: Endpoint) -> Verdict:
        """One canary through prefill `p` and decode `d`; its verdict is kept and returned."""
        self.in_flight += 1
        try:
            return await self._check(p, d)
        finally:
            self.in_flight -= 1

    async def _check(self, p: Endpoint, d: Endpoint) -> Verdict:
        rid = f"{REQUEST_PREFIX}-{secrets.token_hex(6)}"
        plan = self._plan(rid, 0, p, d)
        tid = plan.transfer_id or new_transfer_id(rid, 0)
        failure: str | None = None
        try:
            body = {
                "model": await self._model(d),
                "prompt": canary_prompt(),
                "max_tokens": 1,
                "temperature": 0,
            }
            prefill_body = oa.dumps(oa.prefill_request(body, plan.prefill_kv))
            decode_body = oa.decode_payload(body, None, plan.decode_kv)
            answers = await asyncio.gather(
                self._post(p, oa.COMPLETIONS, prefill_body, rid),
                self._post(d, oa.COMPLETIONS, decode_body, rid),
            )
            failure = _first_failure(zip(("prefill", "decode"), (p, d), answers, strict=True))
            for role, ep, (status, _) in zip(("prefill", "decode"), (p, d), answers, strict=True):
                if status == 200:
                    self._add(role, ep, "requests", 1)
            prompt_tokens = _prompt_tokens(answers[0][1]) if answers[0][0] == 200 else 0
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            failure = f"the check's calls failed: {error!r}"[:300]
        if failure is not None:
            await self._quietly(self._post(d, END_PATH, json.dumps({"transfer_id": tid}).encode(), rid))
        record = await self._record(d, tid, rid)
        if record is not None and record.get("state") == "loaded":
            self._add("decode", d, "loaded_tokens", prompt_tokens)
            self._add("decode", d, "kv_bytes", float(record.get("kv_bytes", 0)))
            self._add("decode", d, "wire_bytes", float(record.get("wire_bytes", 0)))
        reason, message = judge(record, want_rdma=self._config.kv_check_rdma, failure=failure)
        verdict = Verdict(p.name, d.name, reason, message, self._clock())
        self.verdicts[(p.name, d.name)] = verdict
        self.checks[reason] += 1
        (log.info if verdict.ok else log.warning)(
            "KV check %s -> %s: %s: %s", p.name, d.name, reason, message
        )
        return verdict

    def summary(self) -> JsonObject:
        """What GET /dllm/kv-check answers: the resource's reason and each pair's latest verdict."""
        pairs = self.pairs()
        reason, message = overall(list(self.verdicts.values()), len(pairs))
        return {
            "enabled": self.enabled,
            "reason": reason,
            "message": message,
            "pairs": [
                {
                    "prefill": v.prefill,
                    "decode": v.decode,
                    "reason": v.reason,
                    "message": v.message,
                    "checkedAt": v.checked_at,
                }
                for v in sorted(self.verdicts.values(), key=lambda v: (v.prefill, v.decode))
            ],
        }

    def families(self) -> Iterator[Metric]:
        current = GaugeMetricFamily(
            "dllm_router_kv_check",
            "The latest KV check of each ready prefill/decode pair: 1 under its reason",
            labels=["prefill", "decode", "reason"],
        )
        for v in self.verdicts.values():
            current.add_metric([v.prefill, v.decode, v.reason], 1)
        yield current
        checks = CounterMetricFamily("dllm_router_kv_checks", "KV checks run, by reason", labels=["reason"])
        for reason, count in self.checks.items():
            checks.add_metric([reason], count)
        yield checks
        engines = CounterMetricFamily(
            "dllm_router_kv_check_engine",
            "What the KV check's canaries added to each engine's own counters: requests answered, and "
            "on decode prompt tokens loaded, KV bytes and wire bytes (to tell them from users' traffic)",
            labels=["role", "pod", "kind"],
        )
        for (role, pod, kind), total in sorted(self.engine_totals.items()):
            engines.add_metric([role, pod, kind], total)
        yield engines
        yield GaugeMetricFamily(
            "dllm_router_kv_check_in_flight", "KV check canaries under way", value=self.in_flight
        )

    def _add(self, role: str, ep: Endpoint, kind: str, amount: float) -> None:
        key = (role, ep.name, kind)
        self.engine_totals[key] = self.engine_totals.get(key, 0.0) + amount

    async def _model(self, d: Endpoint) -> str:
        """The model decode serves (its /v1/models), asked once per pod; ValueError if it does not say."""
        if d.name not in self._models:
            async with self._session().get(
                d.url + "/v1/models", headers=self._headers, timeout=self._timeout
            ) as r:
                data = await _bounded(r, d)
            try:
                self._models[d.name] = str(json.loads(data)["data"][0]["id"])
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(f"decode {d.name}'s /v1/models names no model: {data[:200]!r}") from None
        return self._models[d.name]

    async def _post(self, ep: Endpoint, path: str, payload: bytes, rid: str) -> tuple[int, bytes]:
        headers = self._headers | {"Content-Type": "application/json", "X-Request-Id": rid}
        async with self._session().post(
            ep.url + path, data=payload, headers=headers, timeout=self._timeout
        ) as r:
            return r.status, await _bounded(r, ep)

    async def _record(self, d: Endpoint, tid: str, rid: str) -> JsonObject | None:
        try:
            status, data = await self._post(d, RECORD_PATH, json.dumps({"transfer_id": tid}).encode(), rid)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        if status != 200:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    @staticmethod
    async def _quietly(call: Any) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            await call


def _first_failure(answers: Any) -> str | None:
    """The first call that did not answer 200, in words (role, pod, status, the start of its body)."""
    for role, ep, (status, data) in answers:
        if status != 200:
            text = data[:200].decode("utf-8", "replace")
            return f"{role} {ep.name} answered {status}: {text}"
    return None


def _prompt_tokens(prefill_answer: bytes) -> int:
    """The prompt's tokens as prefill counted them (its answer's usage); 0 when it does not say."""
    try:
        usage = json.loads(prefill_answer).get("usage") or {}
        return int(usage.get("prompt_tokens", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


async def _bounded(response: aiohttp.ClientResponse, ep: Endpoint) -> bytes:
    """The whole answer, or ValueError past MAX_ANSWER_BYTES (an engine's answer is read, not trusted)."""
    data = bytearray()
    async for chunk in response.content.iter_chunked(16 * 1024):
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise ValueError(f"{ep.name} answered more than {MAX_ANSWER_BYTES} bytes")
    return bytes(data)
