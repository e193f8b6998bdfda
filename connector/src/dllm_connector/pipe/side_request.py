"""One question to a side channel and its one answer, outside a transfer (an end, a record query)."""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import TypeVar

from dllm_connector.pipe.common import CONNECT_RETRY_S, FULL_RETRY_S
from dllm_connector.pipe.messages import MalformedMessage, WireMessage, bounded, dump, parse
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, TransportError
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
        with connect_when_free(host, port, timeout, auth=auth) as sock:
            sidechannel.send_message(sock, dump(question))
            reply = sidechannel.recv_message(sock, timeout, limit=limit)
    except TransportError as error:
        raise refused(f"cannot {doing} at {host}:{port}: {bounded(str(error))}") from None
    try:
        return parse(answer, reply)
    except MalformedMessage:
        raise refused(f"cannot {doing} at {host}:{port}: it answered {bounded(reply)}") from None


def connect_when_free(
    host: str,
    port: int,
    timeout: float,
    *,
    auth: PeerAuth | None,
    stop: threading.Event | None = None,
    retry_unreachable: bool = False,
) -> socket.socket:
    """A connection to a side channel within `timeout` (hello answered; with `auth`, authenticated).

    One that is full (NEW-7) is asked again after a doubling, jittered pause, the last try just before
    the deadline with time left to say hello; past it, TransferTimeout naming it. With
    `retry_unreachable`, one not up yet is asked again too. An authentication failure is final at
    once, and `stop` (a closing side) ends the waiting with the last error."""
    stop = stop if stop is not None else threading.Event()
    deadline = time.monotonic() + timeout
    pause = FULL_RETRY_S[0]
    while True:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            return sidechannel.connect(host, port, left, auth=auth)
        except sidechannel.AuthenticationFailed:
            raise  # a retry would only repeat the refusal until the timeout
        except sidechannel.ServerFull as full:
            if stop.is_set():
                raise
            left = deadline - time.monotonic()
            if left <= CONNECT_RETRY_S:  # no time for another hello
                raise TransferTimeout(f"{full}, for the whole transfer timeout ({timeout:.1f}s)") from None
            stop.wait(min(pause * random.uniform(0.5, 1.0), left - CONNECT_RETRY_S))
            pause = min(2 * pause, FULL_RETRY_S[1])
        except TransportError:
            if not retry_unreachable or time.monotonic() + CONNECT_RETRY_S > deadline or stop.is_set():
                raise
            stop.wait(CONNECT_RETRY_S)
