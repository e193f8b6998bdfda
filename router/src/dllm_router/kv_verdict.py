"""Whether a prefill/decode pair moved a canary's KV, from decode's own account of the transfer. Pure.

The KV check (kv_check.py) sends a small prompt through one pair under a transfer id of its own and
then asks decode's connector what it did with that id (`POST /v1/dllm/transfer_record`): `loaded`
with blocks and bytes, `failed` with the reason, `pending`, or `unknown`. The verdict's reasons are
the ones a user can act on:

- `Verified`: decode loaded the prompt's KV over the transport the resource asked for;
- `RDMAFallbackToTCP`: RDMA was asked for and the KV moved over TCP;
- `Recomputed`: decode answered without loading anything (its connector never saw the transfer);
- `TransferFailed`: the transfer or a call of the check failed; the message says why;
- `NoCompletePair`: there is no ready prefill and decode pod to check (for the whole resource).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dllm_contract.kv_check import REASONS, WORST_FIRST, Reason

__all__ = ["REASONS", "Reason", "Verdict", "judge", "overall"]


@dataclass(frozen=True)
class Verdict:
    prefill: str
    decode: str
    reason: Reason
    message: str
    checked_at: float  # seconds since the epoch

    @property
    def ok(self) -> bool:
        return self.reason == "Verified"


def judge(
    record: Mapping[str, Any] | None, *, want_rdma: bool, failure: str | None = None
) -> tuple[Reason, str]:
    """The reason and message for one canary: `record` is decode's account (None if it could not be
    read), `failure` what went wrong with the check's own calls (None when decode answered 200)."""
    state = record.get("state") if record is not None else None
    if state == "failed":
        why = str(record.get("reason", "")) if record is not None else ""
        after = f" ({failure})" if failure else "; decode computed the prompt itself"
        return "TransferFailed", f"decode's connector failed the load: {why}{after}"
    if failure is not None:
        return "TransferFailed", failure
    if record is None:
        return "TransferFailed", "decode's record of the transfer could not be read"
    if state != "loaded" or int(record.get("blocks", 0)) <= 0:
        return "Recomputed", f"decode answered without loading the prompt's KV (its connector: {state})"
    transport = str(record.get("transport", ""))
    seconds = float(record.get("seconds", 0.0))
    moved = (
        f"{record.get('blocks')} blocks, {record.get('kv_bytes')} bytes of KV "
        f"({record.get('wire_bytes')} on the wire) in {seconds:.3f}s over {transport}"
    )
    if want_rdma and "rdma" not in transport.lower():
        return "RDMAFallbackToTCP", f"RDMA was asked for; the KV moved over {transport}: {moved}"
    return "Verified", f"decode loaded {moved}"


def overall(verdicts: Sequence[Verdict], complete_pairs: int) -> tuple[Reason, str]:
    """The resource's reason: NoCompletePair without a pair to check, else its worst pair's."""
    if complete_pairs == 0:
        return "NoCompletePair", "no ready prefill and decode pod to check"
    if not verdicts:
        return "NoCompletePair", "no pair checked yet"
    worst = min(verdicts, key=lambda v: WORST_FIRST.index(v.reason))
    if worst.ok:
        return "Verified", f"{len(verdicts)} of {complete_pairs} pairs verified; {worst.message}"
    return worst.reason, f"{worst.prefill} -> {worst.decode}: {worst.message}"
