"""The side channel's messages: a tagged union on `type`, validated before any field is used (H6, L3).

Everything here came over the network: a message that does not fit its model raises
MalformedMessage with a short reason (the pipe turns it into TransportError), never
KeyError/TypeError deep inside a transfer. Reasons and logged peer values are cut to `MAX_ECHO`
characters (L2). Pure: pydantic only (no torch).

The protocol's version travels in every connection's hello (transport/sidechannel.py,
PROTOCOL_VERSION, with the history of what changed): a change here that a peer of the previous
version would misread bumps it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, ValidationError

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


class WireMessage(BaseModel):
    """One side-channel message; `type` names it."""

    # lax (JSON lists fill tuples), but a list or a dict is never coerced into a number
    model_config = ConfigDict(frozen=True, extra="ignore")


class TPPart(WireMessage):
    rank: _Count = 0
    size: Annotated[int, Field(ge=1, le=1 << 16)] = 1
    decode_rank: _Count | None = None
    heads: tuple[_Count, _Count] | None = None


class Offer(WireMessage):
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


class Destination(WireMessage):
    """Where a zero-copy part goes in decode's caches (layout.BlockAddresses, gpu-review item 5): per
    layer (base, block stride, segment stride), the segments per block, the (offset, length) runs in
    a segment, and decode's block ids for the part; prefill works the spans out from them."""

    layers: Annotated[list[tuple[_Addr, _Addr, _Addr]], Field(min_length=1, max_length=1 << 16)]
    segments: Annotated[int, Field(ge=1, le=2)]
    runs: Annotated[list[tuple[_Addr, _Addr]], Field(min_length=1, max_length=1 << 16)]
    blocks: Annotated[list[_Index], Field(max_length=1 << 24)]


class Accept(WireMessage):
    type: Literal["accept"]
    skip: _Count
    count: _Count
    dst: Destination | None = None  # zero-copy parts only
    slots: list[tuple[_Index, _Addr]] = Field(default_factory=list)
    endpoint: dict[str, Any] = Field(default_factory=dict)
    # Whether decode takes an offered block-to-block write: false where its data path does not register
    # its cache (gpu-review item 8), and the sender stages the part instead.
    zero_copy: StrictBool = True


class Slot(WireMessage):
    type: Literal["slot"]
    index: _Index
    addr: _Addr


class Piece(WireMessage):
    type: Literal["piece"]
    index: _Index
    parts: _Count


class Chunk(WireMessage):
    type: Literal["chunk"]
    index: _Index
    header: dict[str, Any]


class EndTransfer(WireMessage):
    """M2: decode (or the router) will never claim this id; a waiting offer for it is refused now."""

    type: Literal["end"]
    transfer_id: _TransferId


class RecordQuery(WireMessage):
    """What decode knows of one transfer id: asked by its own engine's record route for the router."""

    type: Literal["record?"]
    transfer_id: _TransferId


class TransferRecord(WireMessage):
    """Decode's answer to a RecordQuery (pipe/records.py): the outcome and what came, on this rank."""

    type: Literal["record"]
    state: Literal["loaded", "failed", "pending", "unknown"]
    reason: Annotated[str, Field(max_length=MAX_ECHO)] = ""
    blocks: Annotated[int, Field(ge=0, le=1 << 40)] = 0
    kv_bytes: Annotated[int, Field(ge=0, le=1 << 60)] = 0
    wire_bytes: Annotated[int, Field(ge=0, le=1 << 60)] = 0
    seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    transport: Annotated[str, Field(max_length=64)] = ""


class Done(WireMessage):
    """The sender wrote everything (a one-sided transport's writes have all returned)."""

    type: Literal["done"]


class Ack(WireMessage):
    """Decode loaded and verified the part (or took note of an `end`)."""

    type: Literal["ack"]


class Nack(WireMessage):
    """Decode refused the offer, or tells the sender mid-stream to stop (H5)."""

    type: Literal["nack"]
    reason: str = ""


class Abort(WireMessage):
    """The sender stopped (told to, or failed); nothing more is written."""

    type: Literal["abort"]
    reason: str = ""


SideMessage = Annotated[
    Offer | Accept | Slot | Piece | Chunk | Done | Ack | Nack | Abort | EndTransfer | RecordQuery,
    Field(discriminator="type"),
]
_ANY: TypeAdapter[SideMessage] = TypeAdapter(SideMessage)

_M = TypeVar("_M", bound=WireMessage)


def parse(model: type[_M], message: dict[str, Any]) -> _M:
    """`message` as `model`, or MalformedMessage naming the first problem (bounded)."""
    try:
        return model.model_validate(message)
    except ValidationError as error:
        raise _malformed(error, message) from None


def parse_any(message: dict[str, Any]) -> SideMessage:
    """`message` as whichever model its `type` names, or MalformedMessage (an unknown type too)."""
    try:
        return _ANY.validate_python(message)
    except ValidationError as error:
        raise _malformed(error, message) from None


def dump(message: WireMessage) -> dict[str, Any]:
    """`message` as the JSON object that goes on the wire."""
    return message.model_dump(mode="json")


def _malformed(error: ValidationError, message: dict[str, Any]) -> MalformedMessage:
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid"}
    where = ".".join(str(part) for part in first["loc"]) or "<message>"
    kind = bounded(message.get("type", "?"), 20)
    return MalformedMessage(
        f"malformed {kind} message from the peer: {bounded(where, 60)}: {bounded(first['msg'], 100)}"
    )
