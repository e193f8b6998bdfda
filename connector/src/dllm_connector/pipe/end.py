"""Telling a decode side channel it will never expect a transfer id (M2), without the pipe's machinery."""

from __future__ import annotations

from dllm_connector.pipe.messages import Ack, EndTransfer
from dllm_connector.pipe.side_request import ask
from dllm_connector.transport.sidechannel import PeerAuth

_REPLY_LIMIT = 4096  # an ack is a few bytes


class EndRefused(OSError):
    """Decode could not be told to end the id (unreachable, or it did not answer ack)."""


def end_transfer(
    host: str, port: int, transfer_id: str, timeout: float, *, auth: PeerAuth | None = None
) -> None:
    """Tell a decode TP rank's side channel (kv port + rank) it will never expect `transfer_id` (M2).

    For whoever knows that decode refused or lost a request whose prefill already sends: prefill's
    offer for it is then refused at once instead of holding its blocks for the hold time. An id
    decode does expect is left alone. The connection says hello as every one does (with `auth`,
    authenticated). Blocking, bounded by `timeout`; raises EndRefused.
    """
    question = EndTransfer(type="end", transfer_id=transfer_id)
    ask(
        host,
        port,
        question,
        Ack,
        timeout,
        auth=auth,
        limit=_REPLY_LIMIT,
        refused=EndRefused,
        doing="end transfer",
    )
