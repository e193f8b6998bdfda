"""The side-channel messages a peer sends, validated before any field is used (H6, L3).

Everything here came over the network: a message that does not fit its model raises
MalformedMessage with a short reason (the pipe turns it into TransportError), never
KeyError/TypeError deep inside a transfer. Reasons and logged peer values are cut to `MAX_ECHO`
characters (L2). Pure: pydantic only (no torch), so the router can import it.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from dllm_contract.kvconfig import Compression
from dllm_contract.pd_params import MAX_TRANSFER_ID

MAX_ECHO = 200  # characters of peer data a log line or a nack may carry

_Addr = Annotated[int, Field(ge=0, lt=1 << 64)]
_Count = Annotated[int, Field(ge=0, le=1 << 24)]
_Index = Annotated[int, Field(ge=0, le=1 << 24)]
_TransferId = Annotated[str, Field(min_length=1, max_length=MAX_TRANSFER_ID)]


class MalformedMessage(ValueError):
    """A peer's message does not fit its model; the message names the first problem (bounded)."""


def bounded(value: object, limit: int = MAX_ECHO) -> str:
    """`value` as text of at most `limit` characters (peer data never floods a log line or a nack)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Message(BaseModel):
    # lax (JSON lists fill tuples), but a list or a dict is never coerced into a number
    model_config = ConfigDict(frozen=True, extra="ignore")


class TPPart(_Message):
    rank: _Count = 0
    size: Annotated[int, Field(ge=1, le=1 << 16)] = 1
    decode_rank: _Count | None = None
    heads: tuple[_Count, _Count] | None = None


class Offer(_Message):
    type: Literal["offer"]
    transfer_id: _TransferId
    # L3: required, and decode compares it with its own whenever it has one (empty only for the
    # tensor API, whose receiver expects an empty one too)
    prompt_hash: Annotated[str, Field(max_length=64)]
    engine_id: Annotated[str, Field(max_length=256)] | None = None
    num_blocks: Annotated[int, Field(ge=1, le=1 << 24)]
    codec: Compression
    zero_copy: StrictBool = False
    chunk_blocks: Annotated[int, Field(ge=1, le=1 << 24)]  # L3: 0 would mean "loaded" with no data
    signature: dict[str, Any]
    endpoint: dict[str, Any] = Field(default_factory=dict)
    # H4: finite and positive; the receiver clamps it to its own hold
    hold_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    tag: Annotated[int, Field(ge=0, lt=1 << 63)] = 0
    tp: TPPart = Field(default_factory=TPPart)


class Accept(_Message):
    type: Literal["accept"]
    skip: _Count
    count: _Count
    dst: list[tuple[_Addr, _Addr]] = Field(default_factory=list)
    slots: list[tuple[_Index, _Addr]] = Field(default_factory=list)
    endpoint: dict[str, Any] = Field(default_factory=dict)


class Slot(_Message):
    type: Literal["slot"]
    index: _Index
    addr: _Addr


class Piece(_Message):
    type: Literal["piece"]
    index: _Index
    parts: _Count


class Chunk(_Message):
    type: Literal["chunk"]
    index: _Index
    header: dict[str, Any]


class EndTransfer(_Message):
    """M2: decode (or the router) will never claim this id; a waiting offer for it is refused now."""

    type: Literal["end"]
    transfer_id: _TransferId


_M = TypeVar("_M", bound=_Message)


def parse(model: type[_M], message: dict[str, Any]) -> _M:
    """`message` as `model`, or MalformedMessage naming the first problem (bounded)."""
    try:
        return model.model_validate(message)
    except ValidationError as error:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid"}
        where = ".".join(str(part) for part in first["loc"]) or "<message>"
        kind = bounded(message.get("type", "?"), 20)
        raise MalformedMessage(
            f"malformed {kind} message from the peer: {bounded(where, 60)}: {bounded(first['msg'], 100)}"
        ) from None


# ---- ending an id, for the router (no torch here) ------------------------------------------------

_LENGTH = struct.Struct(">I")  # the side channel's framing (transport/sidechannel.py)


class EndRefused(OSError):
    """Decode could not be told to end the id (unreachable, or it did not answer ack)."""


def end_transfer(
    host: str,
    port: int,
    transfer_id: str,
    timeout: float,
    *,
    handshake: Callable[[socket.socket], None] | None = None,
) -> None:
    """Tell a decode TP rank's side channel (kv port + rank) it will never expect `transfer_id` (M2).

    For the router, when decode refused or lost a request whose prefill already sends: prefill's
    offer for it is then refused at once instead of holding its blocks for the hold time. An id
    decode does expect is left alone. `handshake` runs first on the connection (the side channel's
    authentication, where it has a key). Blocking, bounded by `timeout`; raises EndRefused.
    """
    body = json.dumps({"type": "end", "transfer_id": transfer_id}, separators=(",", ":")).encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            if handshake is not None:
                handshake(sock)
            sock.sendall(_LENGTH.pack(len(body)) + body)
            (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
            if length > 4096:
                raise EndRefused(f"decode answered {length} bytes to an end")
            reply = json.loads(_read(sock, length))
    except (OSError, ValueError) as error:
        if isinstance(error, EndRefused):
            raise
        raise EndRefused(f"cannot end transfer at {host}:{port}: {bounded(str(error))}") from None
    if not isinstance(reply, dict) or reply.get("type") != "ack":
        raise EndRefused(f"decode answered {bounded(reply)} to an end")


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EndRefused("decode closed the side channel")
        data += chunk
    return data
