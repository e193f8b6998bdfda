"""One question to a side channel and its one answer, outside a transfer (an end, a record query)."""

from __future__ import annotations

from typing import TypeVar

from dllm_connector.pipe.messages import MalformedMessage, WireMessage, bounded, dump, parse
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.sidechannel import PeerAuth

_A = TypeVar("_A", bound=WireMessage)


def ask(
    host: str,
    port: int,
    question: WireMessage,
    answer: type[_A],
    timeout: float,
    *,
    auth: PeerAuth | None,
    limit: int,
    refused: type[Exception],
    doing: str,
) -> _A:
    """Connect (hello first; with `auth`, authenticated), send `question`, read one reply of at most
    `limit` bytes as `answer`. Blocking, bounded by `timeout`; `refused` ("cannot <doing> at ...: why")
    when the side channel cannot be reached or answers anything else."""
    try:
        with sidechannel.connect(host, port, timeout, auth=auth) as sock:
            sidechannel.send_message(sock, dump(question))
            reply = sidechannel.recv_message(sock, timeout, limit=limit)
    except TransportError as error:
        raise refused(f"cannot {doing} at {host}:{port}: {bounded(str(error))}") from None
    try:
        return parse(answer, reply)
    except MalformedMessage:
        raise refused(f"cannot {doing} at {host}:{port}: it answered {bounded(reply)}") from None
