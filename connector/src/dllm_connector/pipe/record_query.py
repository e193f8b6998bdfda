"""Asking a decode TP rank's side channel for its account of one transfer id (pipe/records.py)."""

from __future__ import annotations

from dllm_connector.pipe.messages import RecordQuery, TransferRecord
from dllm_connector.pipe.side_request import ask
from dllm_connector.transport.sidechannel import PeerAuth

_REPLY_LIMIT = 4096  # a record is a few hundred bytes


class RecordUnavailable(OSError):
    """The rank could not be asked (unreachable, or it did not answer a record)."""


def query_record(
    host: str, port: int, transfer_id: str, timeout: float, *, auth: PeerAuth | None = None
) -> TransferRecord:
    """What the side channel at host:port (kv port + rank) knows of `transfer_id`. It says hello as
    every connection does (with `auth`, authenticated). Blocking, bounded by `timeout`."""
    question = RecordQuery(type="record?", transfer_id=transfer_id)
    return ask(
        host,
        port,
        question,
        TransferRecord,
        timeout,
        auth=auth,
        limit=_REPLY_LIMIT,
        refused=RecordUnavailable,
        doing="ask for the transfer's record",
    )
