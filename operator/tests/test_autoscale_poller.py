"""The autoscaler's loop (autoscale/poller.py) against an engine's metrics page double (a local HTTP
server): a recommendation is handed on when it changes (an Event's worth) and, unchanged, with fresh
values once a minute; a pod that stops answering keeps its last signal while it is fresh, then leaves
its role unscaled, said in status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from page_server import serving
from prometheus_client import generate_latest

from dllm_operator import metrics
from dllm_operator.api.autoscaling import AutoscalingSpec
from dllm_operator.autoscale import exported
from dllm_operator.autoscale.decide import Decision
from dllm_operator.autoscale.poller import AutoscalePoller, Target
from dllm_operator.autoscale.scrape import METRICS_PATH

PREFILL_PAGE = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 3
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{le="+Inf"} 10
vllm:request_prompt_tokens_count 10
vllm:request_prompt_tokens_sum 10000
"""


class PrefillMetricsDouble:
    """A prefill engine's /metrics on 127.0.0.1 (a double: the operator only reads it)."""

    def __init__(self) -> None:
        self.status = 200

    async def page(self, _: web.Request) -> web.Response:
        return web.Response(status=self.status, text=PREFILL_PAGE, content_type="text/plain")


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[PrefillMetricsDouble, int]]:
    double = PrefillMetricsDouble()
    async with serving(METRICS_PATH, double.page) as port:
        yield double, port


async def test_a_recommendation_is_handed_on_when_it_changes_and_refreshed_once_a_minute(
    prefill: tuple[PrefillMetricsDouble, int],
) -> None:
    double, port = prefill
    spec = AutoscalingSpec.model_validate(
        {"mode": "advisory", "prefill": {"maxReplicas": 4, "target": {"queuedPromptTokensPerReplica": 2000}}}
    )
    target = Target(spec, {"prefill": [("p-0", "127.0.0.1", port)]}, {"prefill": 1, "decode": 1})
    clock = [1_000.0]
    handed: list[tuple[Any, dict[str, Any], bool]] = []
    acted: list[tuple[Any, Decision]] = []  # active mode's steps see every decision, written or not
    poller = AutoscalePoller(
        15,
        lambda: {"cr": target},
        lambda *call: handed.append(call),
        lambda: clock[0],
        acted=lambda *call: acted.append(call),
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
        await poller.poll(session)
        # 3 waiting x 1000-token prompts = 3000 queued tokens, at 2000 a replica
        assert [(key, status["prefill"]["replicas"], changed) for key, status, changed in handed] == [
            ("cr", 2, True)
        ]
        assert handed[0][1]["prefill"]["value"] == 3000
        assert handed[0][1]["decidedAt"] == "1970-01-01T00:16:40Z"
        clock[0] += 15
        await poller.poll(session)
        assert len(handed) == 1  # the same recommendation, values not a minute old: nothing to write
        clock[0] += 60
        await poller.poll(session)
        assert [changed for _, _, changed in handed] == [True, False]
        double.status = 503  # the pod stops answering: its last signal stands while it is fresh
        clock[0] += 15
        await poller.poll(session)
        assert len(handed) == 2
        clock[0] += 46  # 61 s after the last page read
        await poller.poll(session)
    last = handed[-1][1]["prefill"]
    assert (handed[-1][2], last["replicas"], "value" in last) == (True, 1, False)
    assert [decision.roles["prefill"].replicas for _, decision in acted] == [2, 2, 2, 2, 1]
    assert last["reason"] == "no fresh signal (61s old); not scaled"


def test_the_recommendation_is_exported_for_keda_and_removed_with_the_resource() -> None:
    prefill = {"replicas": 2, "current": 1, "measure": "queued prompt tokens", "value": 3000.0, "reason": ""}
    decode = {"replicas": 1, "current": 1, "measure": "KV-cache usage", "reason": "no fresh signal"}
    exported.export("ns", "llm", {"prefill": prefill, "decode": decode})
    page = generate_latest(metrics.REGISTRY).decode()
    ours = 'name="llm",namespace="ns"'
    assert f'dllm_operator_autoscaling_recommended_replicas{{{ours},role="prefill"}} 2.0' in page
    assert (
        f'dllm_operator_autoscaling_signal{{measure="queued prompt tokens",{ours},role="prefill"}} 3000.0'
        in page
    )
    assert f'dllm_operator_autoscaling_recommended_replicas{{{ours},role="decode"}} 1.0' in page
    assert 'measure="KV-cache usage"' not in page  # no fresh signal: no series, not a zero
    exported.forget("ns", "llm")
    assert ours not in generate_latest(metrics.REGISTRY).decode()
