"""Asking a decode TP rank's side channel for its account of one transfer id (pipe/records.py)."""

from __future__ import annotations

from dllm_connector.pipe.messages import MalformedMessage, RecordQuery, TransferRecord, bounded, dump, parse
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.sidechannel import PeerAuth

_REPLY_LIMIT = 4096  # a record is a few hundred bytes


class RecordUnavailable(OSError):
    """The rank could not be asked (unreachable, or it did not answer a record)."""


def query_record(
    host: str, port: int, transfer_id: str, timeout: float, *, auth: PeerAuth | None = None
) -> TransferRecord:
    """What the side channel at host:port (kv port + rank) knows of `transfer_id`. It says hello as
    every connection does (with `auth`, authenticated). Blocking, bounded by `timeout`."""
    try:
        with sidechannel.connect(host, port, timeout, auth=auth) as sock:
            sidechannel.send_message(sock, dump(RecordQuery(type="record?", transfer_id=transfer_id)))
            reply = sidechannel.recv_message(sock, timeout, limit=_REPLY_LIMIT)
    except TransportError as error:
        raise RecordUnavailable(f"cannot ask {host}:{port}: {bounded(str(error))}") from None
    try:
        return parse(TransferRecord, reply)
    except MalformedMessage:
        raise RecordUnavailable(f"decode answered {bounded(reply)} to a record query") from None
