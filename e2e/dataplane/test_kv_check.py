"""The router's KV check on the real CPU pipeline: a canary through the one prefill/decode pair, proved
by decode's own account of its transfer. With the engines as rendered it is Verified, naming the
blocks and bytes decode loaded over Mooncake (TCP); a router told to expect RDMA calls the same
transfer RDMAFallbackToTCP; a decode whose KV layout no longer matches prefill's (a block size of 64
where prefill has 32) fails the load, and the check says TransferFailed with the connector's reason,
then Verified again once decode is put back.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.dataplane.pipeline import Pipeline, counter, metrics_text, wait_healthy
from e2e.dataplane.prompts import PIPELINE_MARKS
from e2e.fixtures import wait_until

pytestmark = PIPELINE_MARKS

CHECK_EVERY_S = "2"


@pytest.fixture(scope="module")
def pipeline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    logs = tmp_path_factory.mktemp("kv-check")
    pipeline = Pipeline(model=model, logs=logs, router_extra=("--kv-check-interval-s", CHECK_EVERY_S))
    try:
        yield pipeline.start()
    finally:
        pipeline.stop()


def kv_check(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/dllm/kv-check", timeout=5) as response:  # noqa: S310 - 127.0.0.1
        return dict(json.loads(response.read()))


def verdict_after(
    pipeline: Pipeline, checks_before: float, reason: str, within: float, name: str = "router"
) -> dict[str, Any]:
    """Router `name`'s check once a check newer than `checks_before` has run and says `reason`."""
    router = pipeline.processes[name].url

    def newer() -> dict[str, Any] | None:
        done = counter(metrics_text(router), "dllm_router_kv_checks")
        state = kv_check(router)
        return state if done > checks_before and state["reason"] == reason else None

    return dict(wait_until(newer, within, f"the KV check to say {reason}"))


def test_the_pair_as_rendered_is_verified_with_what_decode_loaded(pipeline: Pipeline) -> None:
    state = verdict_after(pipeline, 0, "Verified", 120)
    [pair] = state["pairs"]
    assert pair["prefill"].endswith(f":{pipeline.ports['prefill']}")
    assert pair["decode"].endswith(f":{pipeline.ports['decode']}")
    assert "decode loaded" in pair["message"]
    assert "over mooncake (tcp)" in pair["message"]
    router_metrics = metrics_text(pipeline.processes["router"].url)
    assert counter(router_metrics, "dllm_router_kv_check", reason="Verified") == 1
    # the canary's transfer is decode's own: its connector counted it
    assert counter(metrics_text(pipeline.processes["decode"].url), "vllm:dllm_kv_transfers") > 0


def test_a_decode_whose_layout_no_longer_matches_fails_the_check_with_the_connectors_reason(
    pipeline: Pipeline,
) -> None:
    router = pipeline.processes["router"].url
    pipeline.processes["decode"].stop()
    wait_healthy(pipeline.start_engine("decode", {"--block-size": "64"}))
    before = counter(metrics_text(router), "dllm_router_kv_checks")
    state = verdict_after(pipeline, before, "TransferFailed", 120)
    [pair] = state["pairs"]
    assert "decode's connector failed the load" in pair["message"], pair
    assert "KV cache mismatch" in pair["message"], pair  # the handshake names what differs
    assert "block" in pair["message"], pair
    assert counter(metrics_text(router), "dllm_router_kv_check", reason="TransferFailed") == 1
    pipeline.processes["decode"].stop()
    wait_healthy(pipeline.start_engine("decode"))
    verdict_after(pipeline, counter(metrics_text(router), "dllm_router_kv_checks"), "Verified", 120)


def test_a_router_that_expects_rdma_calls_the_same_tcp_transfer_a_fallback(pipeline: Pipeline) -> None:
    """The transport decode reports for the transfer (here Mooncake over TCP) is what the check reads."""
    second = pipeline.start_router("router-rdma", ("--kv-check-rdma", "true"))
    try:
        wait_healthy(second, 30)
        state = verdict_after(pipeline, 0, "RDMAFallbackToTCP", 120, name="router-rdma")
        [pair] = state["pairs"]
        assert "RDMA was asked for; the KV moved over mooncake (tcp)" in pair["message"], pair
        assert state["message"].startswith(pair["prefill"]), state
    finally:
        second.stop()
