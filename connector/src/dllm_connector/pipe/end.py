"""Telling a decode side channel it will never expect a transfer id (M2), without the pipe's machinery."""

from __future__ import annotations

from dllm_connector.pipe.messages import Ack, EndTransfer, MalformedMessage, bounded, dump, parse
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransportError
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
    try:
        with sidechannel.connect(host, port, timeout, auth=auth) as sock:
            sidechannel.send_message(sock, dump(EndTransfer(type="end", transfer_id=transfer_id)))
            reply = sidechannel.recv_message(sock, timeout, limit=_REPLY_LIMIT)
    except TransportError as error:
        raise EndRefused(f"cannot end transfer at {host}:{port}: {bounded(str(error))}") from None
    try:
        parse(Ack, reply)
    except MalformedMessage:
        raise EndRefused(f"decode answered {bounded(reply)} to an end") from None
