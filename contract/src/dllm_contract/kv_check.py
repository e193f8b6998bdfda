"""The KV check's reasons and page, shared by the router that runs the check and the operator that
reports it as the resource's KVTransferVerified condition."""

from __future__ import annotations

from typing import Literal

# GET on the router's HTTP port: {"enabled", "reason", "message", "pairs": [{"prefill", "decode",
# "reason", "message", "checkedAt"}]} (dllm_router.kv_check.KVCheck.summary).
PAGE_PATH = "/dllm/kv-check"

Reason = Literal["Verified", "RDMAFallbackToTCP", "Recomputed", "TransferFailed", "NoCompletePair"]
REASONS: tuple[Reason, ...] = (
    "Verified",
    "RDMAFallbackToTCP",
    "Recomputed",
    "TransferFailed",
    "NoCompletePair",
)
# A resource's reason is its worst pair's: a failure anywhere is what a user must see.
WORST_FIRST: tuple[Reason, ...] = ("TransferFailed", "Recomputed", "RDMAFallbackToTCP", "Verified")
# The reasons that say the KV path is broken: the resource is Degraded and not Ready.
FAILURES: tuple[Reason, ...] = ("TransferFailed", "Recomputed", "RDMAFallbackToTCP")
