"""KVTransferVerified: what the router pods' KV check pages make of the resource's status (kv_transfer.py),
and what a page that is not one does (it is named, never trusted)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from status_cases import sample_status

from dllm_operator.kv_transfer import (
    MAX_MESSAGE,
    MAX_PAGE_BYTES,
    MAX_PAIRS,
    KVCheckView,
    PageInvalid,
    RouterPage,
    finding,
    parse_page,
)


def pair(prefill: str, decode: str, reason: str, at: float, message: str = "") -> dict[str, Any]:
    return {"prefill": prefill, "decode": decode, "reason": reason, "message": message, "checkedAt": at}


def page(*pairs: dict[str, Any], enabled: bool = True, reason: str = "Verified") -> RouterPage:
    raw = {"enabled": enabled, "reason": reason, "message": "", "pairs": list(pairs)}
    return parse_page(json.dumps(raw).encode())


def view(**pages: RouterPage | str) -> KVCheckView:
    return KVCheckView(True, pages)


# ---- pages -----------------------------------------------------------------------------------------


def test_a_page_larger_than_the_bound_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(PageInvalid, match=f"over {MAX_PAGE_BYTES} bytes"):
        parse_page(b" " * (MAX_PAGE_BYTES + 1))


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"not json", "body"),
        (b'{"enabled": true, "reason": "AllGood", "pairs": []}', "reason"),
        (b'{"enabled": true, "reason": "Verified", "pairs": [{"prefill": "p"}]}', "pairs.0.decode"),
        (
            (
                b'{"enabled": true, "reason": "Verified", "pairs": '
                b'[{"prefill": "p", "decode": "d", "reason": "Verified", "checkedAt": -1}]}'
            ),
            "pairs.0.checkedAt",
        ),
    ],
)
def test_a_page_that_is_not_a_kv_check_page_is_named_with_its_field(raw: bytes, field: str) -> None:
    with pytest.raises(PageInvalid, match=f"not a KV check page: {field}"):
        parse_page(raw)


def test_a_page_with_too_many_pairs_is_refused() -> None:
    pairs = [pair(f"p{i}", "d", "Verified", 1.0) for i in range(MAX_PAIRS + 1)]
    raw = json.dumps({"enabled": True, "reason": "Verified", "pairs": pairs}).encode()
    with pytest.raises(PageInvalid, match="pairs"):
        parse_page(raw)


def test_a_long_message_is_cut_not_refused() -> None:
    long = page(pair("p", "d", "TransferFailed", 1.0, "x" * (MAX_MESSAGE * 5)))
    assert len(long.pairs[0].message) == MAX_MESSAGE


# ---- the finding -----------------------------------------------------------------------------------


def test_a_resource_the_router_does_not_check_is_unknown() -> None:
    found = finding(KVCheckView(False, {}))
    assert (found.status, found.reason, found.failed) == (None, "NotChecked", False)


def test_before_any_page_is_read_the_check_is_pending() -> None:
    assert (finding(view()).status, finding(view()).reason) == (None, "Pending")


def test_routers_that_cannot_be_read_are_named() -> None:
    found = finding(view(**{"r-1": "unreachable (ClientConnectorError)", "r-0": "HTTP 503"}))
    assert (found.status, found.reason) == (None, "RouterUnreachable")
    assert found.message.endswith("r-0: HTTP 503; r-1: unreachable (ClientConnectorError)")


def test_a_router_that_does_not_run_the_check_makes_it_unknown() -> None:
    found = finding(view(r=page(enabled=False)))
    assert (found.status, found.reason) == (None, "NotChecked")


def test_no_pair_checked_is_no_complete_pair_and_no_failure() -> None:
    found = finding(view(r=page(reason="NoCompletePair")))
    assert (found.status, found.reason, found.failed) == (False, "NoCompletePair", False)


def test_every_pair_verified_is_verified() -> None:
    found = finding(view(r=page(pair("p0", "d0", "Verified", 5.0), pair("p1", "d0", "Verified", 6.0))))
    assert (found.status, found.reason) == (True, "Verified")
    assert found.message.startswith("2 pairs verified")


def test_one_failed_pair_fails_the_resource_and_is_named() -> None:
    found = finding(
        view(r=page(pair("p0", "d0", "Verified", 5.0), pair("p1", "d0", "TransferFailed", 6.0, "checksum")))
    )
    assert (found.status, found.reason, found.failed) == (False, "TransferFailed", True)
    assert found.message == "p1 -> d0: checksum"


def test_a_pair_takes_the_latest_verdict_of_any_router_pod() -> None:
    older = page(pair("p0", "d0", "TransferFailed", 5.0, "timeout"))
    newer = page(pair("p0", "d0", "Verified", 9.0))
    assert finding(view(a=older, b=newer)).reason == "Verified"
    assert finding(view(a=newer, b=older)).reason == "Verified"
    assert finding(view(a=older, b="HTTP 500")).reason == "TransferFailed"


def test_pairs_are_named_by_their_pods_where_the_operator_knows_the_address() -> None:
    known = KVCheckView(
        True,
        {"r": page(pair("10.0.0.1:8000", "10.0.0.2:8000", "TransferFailed", 1.0, "timeout"))},
        {"10.0.0.1": "tiny-prefill-0"},
    )
    found = finding(known)
    assert (found.pairs[0].prefill, found.pairs[0].decode) == ("tiny-prefill-0", "10.0.0.2:8000")
    assert found.message == "tiny-prefill-0 -> 10.0.0.2:8000: timeout"


# ---- the status ------------------------------------------------------------------------------------


def status_with(kv: KVCheckView) -> dict[str, Any]:
    return sample_status(kv_check=kv)


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_failed_kv_path_makes_a_ready_resource_degraded_and_not_ready() -> None:
    failed = view(
        r=page(pair("tiny-cpu-prefill-0", "tiny-cpu-decode-0", "Recomputed", 1e9, "nothing loaded"))
    )
    status = status_with(failed)
    found = conditions(status)
    assert found["KVTransferVerified"] == ("False", "Recomputed")
    assert found["Ready"] == ("False", "Recomputed")
    assert found["Degraded"] == ("True", "Recomputed")
    assert found["Progressing"] == ("False", "Stalled")
    assert status["kvTransfer"]["pairs"] == [
        {
            "prefill": "tiny-cpu-prefill-0",
            "decode": "tiny-cpu-decode-0",
            "reason": "Recomputed",
            "message": "nothing loaded",
            "checkedAt": "2001-09-09T01:46:40Z",
        }
    ]


def test_a_verified_path_leaves_the_resource_ready() -> None:
    status = status_with(view(r=page(pair("tiny-cpu-prefill-0", "tiny-cpu-decode-0", "Verified", 1.0))))
    found = conditions(status)
    assert found["KVTransferVerified"] == ("True", "Verified")
    assert found["Ready"] == ("True", "AllRolesReady")
    assert found["Degraded"] == ("False", "AsExpected")
    assert status["kvTransfer"]["reason"] == "Verified"


@pytest.mark.parametrize("kv", [view(), view(r="HTTP 503"), KVCheckView(False, {})])
def test_an_unknown_check_neither_blocks_nor_claims_anything(kv: KVCheckView) -> None:
    found = conditions(status_with(kv))
    assert found["KVTransferVerified"][0] == "Unknown"
    assert found["Ready"] == ("True", "AllRolesReady")
    assert found["Degraded"] == ("False", "AsExpected")


def test_status_lists_failed_pairs_first() -> None:
    pairs = [pair(f"p{i:02}", "d", "Verified", 1.0) for i in range(40)] + [
        pair("z", "d", "TransferFailed", 1.0)
    ]
    shown = status_with(view(r=page(*pairs)))["kvTransfer"]["pairs"]
    assert len(shown) == 32
    assert shown[0]["prefill"] == "z"
