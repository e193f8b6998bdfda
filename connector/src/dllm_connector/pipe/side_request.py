"""One question to a side channel and its one answer, outside a transfer (an end, a record query)."""

from __future__ import annotations

import random
import socket
import time
from typing import TypeVar

from dllm_connector.pipe.common import FULL_RETRY_S
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
    `limit` bytes as `answer`. A side channel that is full (every slot busy with offers) is asked
    again until `timeout` (NEW-7). Blocking, bounded by `timeout`; `refused` ("cannot <doing> at ...:
    why") when the side channel cannot be reached or answers anything else."""
    try:
        with _connect_when_free(host, port, timeout, auth) as sock:
            sidechannel.send_message(sock, dump(question))
            reply = sidechannel.recv_message(sock, timeout, limit=limit)
    except TransportError as error:
        raise refused(f"cannot {doing} at {host}:{port}: {bounded(str(error))}") from None
    try:
        return parse(answer, reply)
    except MalformedMessage:
        raise refused(f"cannot {doing} at {host}:{port}: it answered {bounded(reply)}") from None


def _connect_when_free(host: str, port: int, timeout: float, auth: PeerAuth | None) -> socket.socket:
    """A connection within `timeout`, asking again after a doubling, jittered pause while it is full."""
    deadline = time.monotonic() + timeout
    pause = FULL_RETRY_S[0]
    while True:
        try:
            return sidechannel.connect(host, port, max(deadline - time.monotonic(), 0.001), auth=auth)
        except sidechannel.ServerFull:
            left = deadline - time.monotonic()
            if left <= pause:
                raise
            time.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(2 * pause, FULL_RETRY_S[1])
