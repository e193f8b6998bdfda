"""The KV check's verdicts from decode's account of a canary's transfer (kv_verdict.py, pure)."""

from __future__ import annotations

from typing import Any

import pytest

from dllm_router.kv_verdict import Verdict, judge, overall

LOADED: dict[str, Any] = {
    "state": "loaded",
    "reason": "",
    "blocks": 2,
    "kv_bytes": 131072,
    "wire_bytes": 65600,
    "seconds": 0.0123,
    "transport": "mooncake (rdma)",
}


def test_a_loaded_transfer_is_verified_and_says_what_moved() -> None:
    reason, message = judge(LOADED, want_rdma=True)
    assert reason == "Verified"
    assert message == (
        "decode loaded 2 blocks, 131072 bytes of KV (65600 on the wire) in 0.012s over mooncake (rdma)"
    )


@pytest.mark.parametrize("transport", ["mooncake (tcp)", "torch.distributed (gloo)"])
def test_rdma_asked_for_and_another_transport_used_is_a_fallback(transport: str) -> None:
    reason, message = judge(LOADED | {"transport": transport}, want_rdma=True)
    assert reason == "RDMAFallbackToTCP"
    assert f"the KV moved over {transport}" in message
    assert judge(LOADED | {"transport": transport}, want_rdma=False)[0] == "Verified"


@pytest.mark.parametrize("state", ["unknown", "pending"])
def test_decode_answering_without_its_connector_loading_is_a_recompute(state: str) -> None:
    reason, message = judge({"state": state, "blocks": 0, "transport": "mooncake (tcp)"}, want_rdma=False)
    assert reason == "Recomputed"
    assert state in message
    assert judge(LOADED | {"blocks": 0}, want_rdma=False)[0] == "Recomputed"


def test_a_failed_load_names_the_connectors_reason_whether_or_not_decode_answered() -> None:
    failed = {
        "state": "failed",
        "reason": "KV load failed: block size 16 != 32",
        "transport": "mooncake (tcp)",
    }
    reason, message = judge(failed, want_rdma=False)
    assert reason == "TransferFailed"
    assert message == (
        "decode's connector failed the load: KV load failed: block size 16 != 32; "
        "decode computed the prompt itself"
    )
    reason, message = judge(failed, want_rdma=False, failure="decode 10.0.0.2:8000 answered 500: {}")
    assert (reason, message.endswith("(decode 10.0.0.2:8000 answered 500: {})")) == ("TransferFailed", True)


def test_a_call_that_failed_without_a_record_is_a_failed_transfer_in_its_own_words() -> None:
    assert judge(None, want_rdma=False, failure="prefill 10.0.0.1:8000 answered 401: x") == (
        "TransferFailed",
        "prefill 10.0.0.1:8000 answered 401: x",
    )
    assert judge(None, want_rdma=False)[0] == "TransferFailed"
    assert judge({"state": "unknown"}, want_rdma=False, failure="prefill answered 503")[0] == "TransferFailed"


def verdict(reason: Any, prefill: str = "p:1", decode: str = "d:1") -> Verdict:
    return Verdict(prefill, decode, reason, f"{reason} message", 1.0)


def test_the_resource_takes_its_worst_pair_and_has_none_without_a_complete_pair() -> None:
    assert overall([], 0) == ("NoCompletePair", "no ready prefill and decode pod to check")
    assert overall([], 2)[0] == "NoCompletePair"  # not checked yet
    good = [verdict("Verified"), verdict("Verified", decode="d:2")]
    assert overall(good, 2) == ("Verified", "2 of 2 pairs verified; Verified message")
    mixed = [*good, verdict("RDMAFallbackToTCP", decode="d:3"), verdict("TransferFailed", decode="d:4")]
    assert overall(mixed, 4) == ("TransferFailed", "p:1 -> d:4: TransferFailed message")
    assert overall([*good, verdict("Recomputed")], 3)[0] == "Recomputed"
