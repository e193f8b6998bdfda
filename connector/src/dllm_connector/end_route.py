"""`POST /v1/dllm/end_transfer` on a decode engine's HTTP port: how the router ends a transfer id (M2).

When decode fails a request after prefill ran (decode answered an error, was unreachable or timed out,
or the client left), prefill's KV sender would hold that request's blocks for the hold time waiting for
an accept that never comes. The router then posts `{"transfer_id": "..."}` here, and this middleware
tells every TP rank of this engine's own side channel (kv port + rank) to `end` the id, so prefill's
offer is refused at once. An id decode does expect is left alone (pipe/end.py).

`POST /v1/dllm/transfer_record` with the same body answers decode's own account of that transfer
(pipe/records.py), asked of every TP rank's side channel and merged: whether the KV was loaded, how
many blocks and bytes came, in how long, over which transport, or why it failed. The router uses it to
prove that a request's KV moved rather than being recomputed.

It adds no trust: the router already calls this port with the engine API key, and only the router may
reach it (NetworkPolicy); the router never learns the side channel's token, this engine uses its own.
dllm-serve adds it with vLLM's `--middleware` for the decode role; vLLM builds the app in each API
server process and adds this class last, so it runs before vLLM's own key check (which guards `/v1`):
it checks the key itself. Every other request goes through untouched after one path comparison.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from dllm_connector.end_route_names import ENV_END_ROUTE_TP_SIZE
from dllm_connector.key_guard import ASGIApp, Receive, Scope, Send, engine_keys, request_path
from dllm_connector.pipe.end import EndRefused, end_transfer
from dllm_connector.pipe.messages import TransferRecord
from dllm_connector.pipe.record_query import RecordUnavailable, query_record
from dllm_connector.transport.sidechannel import PeerAuth
from dllm_contract import kvconfig
from dllm_contract.pd_params import MAX_TRANSFER_ID

log = logging.getLogger(__name__)
_R = TypeVar("_R")

END_PATH = "/v1/dllm/end_transfer"
RECORD_PATH = "/v1/dllm/transfer_record"
# The worst state of any rank is the transfer's: a failure on one rank fails it.
_STATE_ORDER = ("failed", "pending", "unknown", "loaded")
MAX_BODY = 1024  # {"transfer_id": <at most 256 characters>} fits with room
MAX_IN_FLIGHT = 64  # ends being sent at once; beyond: 503 (the router bounds its own too)
MAX_TP_SIZE = 1024
# What the router generates: new_transfer_id(request id, prompt index) = "<rid>-<index>-<12 hex>",
# the request id being visible ASCII (the router refuses any other X-Request-Id).
TRANSFER_ID = re.compile(r"[!-~]+-[0-9]{1,9}-[0-9a-f]{12}")


class EndRouteConfigError(ValueError):
    """The engine's env does not allow the route (named variable, what it allows)."""


@dataclass(frozen=True)
class EndTarget:
    """This engine's own side channel, and the key a caller must present."""

    host: str
    port: int  # TP rank 0's; rank r listens on port + r
    tp_size: int
    timeout_s: float
    auth: PeerAuth | None = None
    api_keys: tuple[str, ...] = ()  # any of them is accepted; none: no key needed (as vLLM)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EndTarget:
        settings = kvconfig.from_env(env)
        raw_tp = env.get(ENV_END_ROUTE_TP_SIZE, "1").strip()
        if not raw_tp.isdigit() or not 1 <= int(raw_tp) <= MAX_TP_SIZE:
            raise EndRouteConfigError(
                f"{ENV_END_ROUTE_TP_SIZE}: {raw_tp[:20]!r} must be a whole number 1-{MAX_TP_SIZE}"
            )
        token = kvconfig.side_channel_token(env)
        return cls(
            host=settings.host_ip or "127.0.0.1",  # where worker binds the side channel
            port=settings.listen_port,
            tp_size=int(raw_tp),
            timeout_s=settings.transfer_timeout_ms / 1000,
            auth=PeerAuth.from_token(token) if token is not None else None,
            api_keys=engine_keys(env),
        )


class BadEnd(Exception):
    """A request this route refuses: its status and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


# ---- pure: what a request asks ------------------------------------------------------------------------


def parse_body(body: bytes) -> str:
    """The transfer id of a body `{"transfer_id": "..."}`; BadEnd(400) naming what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise BadEnd(400, 'the body must be JSON: {"transfer_id": "..."}') from None
    if not isinstance(data, dict) or set(data) != {"transfer_id"}:
        raise BadEnd(400, 'the body must be an object with one key: {"transfer_id": "..."}')
    tid = data["transfer_id"]
    if not isinstance(tid, str) or len(tid) > MAX_TRANSFER_ID or TRANSFER_ID.fullmatch(tid) is None:
        raise BadEnd(
            400,
            f"transfer_id must be a transfer id the router generates (<request id>-<index>-<12 hex>, "
            f"at most {MAX_TRANSFER_ID} visible ASCII characters)",
        )
    return tid


def merge_records(records: list[TransferRecord]) -> dict[str, object]:
    """One transfer's record over decode's TP ranks (rank order): the worst state and the first reason;
    blocks as each rank holds them (the same blocks, its own heads), bytes summed, the longest time."""
    state = min((r.state for r in records), key=_STATE_ORDER.index)
    reason = next((r.reason for r in records if r.state == state and r.reason), "")
    return {
        "state": state,
        "reason": reason,
        "blocks": max(r.blocks for r in records),
        "kv_bytes": sum(r.kv_bytes for r in records),
        "wire_bytes": sum(r.wire_bytes for r in records),
        "seconds": max(r.seconds for r in records),
        "transport": records[0].transport,
        "ranks": len(records),
    }


def key_matches(authorization: bytes | None, keys: tuple[str, ...]) -> bool:
    """`Authorization: Bearer <one of keys>`, compared in constant time (digests: the length leaks
    nothing; every key is compared)."""
    if authorization is None:
        return False
    scheme, _, given = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    digest = hashlib.sha256(given.strip()).digest()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return matched


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value)
    return None


# ---- the middleware ----------------------------------------------------------------------------------


class EndTransferRoute:
    """ASGI middleware serving END_PATH (see the module docstring); vLLM constructs it with the app only,
    so the target comes from the engine's env unless a test passes one."""

    def __init__(self, app: ASGIApp, target: EndTarget | None = None) -> None:
        self.app = app
        self.target = target if target is not None else EndTarget.from_env(os.environ)
        self._in_flight = 0
        log.info(
            "%s serves ends for side channel %s:%d (TP %d)",
            END_PATH,
            self.target.host,
            self.target.port,
            self.target.tp_size,
        )

    @property
    def in_flight(self) -> int:
        """Ends being sent to the side channel now."""
        return self._in_flight

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # behind vLLM's --root-path, Starlette's scope path may carry the prefix
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        path = request_path(scope)
        if path not in (END_PATH, RECORD_PATH):
            return self.app(scope, receive, send)
        return self._serve(scope, receive, send, path)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        target = self.target
        try:
            tid = await self._accept(scope, receive, path)
            if self._in_flight >= MAX_IN_FLIGHT:
                raise BadEnd(503, f"over {MAX_IN_FLIGHT} ends in flight; try again later")
            self._in_flight += 1
            try:
                body: dict[str, object] | None = None
                if path == RECORD_PATH:
                    records = await self._on_every_rank(
                        lambda port: query_record(target.host, port, tid, target.timeout_s, auth=target.auth)
                    )
                    body = {"transfer_id": tid, **merge_records(records)}
                else:
                    await self._on_every_rank(
                        lambda port: end_transfer(target.host, port, tid, target.timeout_s, auth=target.auth)
                    )
            finally:
                self._in_flight -= 1
        except BadEnd as bad:
            await _answer(send, bad.status, str(bad))
            return
        await (_answer(send, 204, None) if body is None else _answer_json(send, body))

    async def _accept(self, scope: Scope, receive: Receive, path: str) -> str:
        if scope.get("method") != "POST":
            raise BadEnd(405, f"{path} takes POST")
        keys = self.target.api_keys
        if keys and not key_matches(_header(scope, b"authorization"), keys):
            raise BadEnd(401, "Unauthorized")
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            raise BadEnd(413, f"the body must be at most {MAX_BODY} bytes")
        return parse_body(await _read_body(receive))

    async def _on_every_rank(self, call: Callable[[int], _R]) -> list[_R]:
        """`call(port)` for every TP rank's side channel at once, off the event loop, in rank order;
        BadEnd(502) naming each rank that could not be reached or answered wrong."""
        target = self.target

        def one(rank: int) -> tuple[_R | None, str | None]:
            try:
                return call(target.port + rank), None
            except (EndRefused, RecordUnavailable) as error:
                return None, f"rank {rank}: {error}"

        answers = await asyncio.gather(*(asyncio.to_thread(one, r) for r in range(target.tp_size)))
        refusals = [refusal for _, refusal in answers if refusal is not None]
        if refusals:
            raise BadEnd(502, "; ".join(refusals))
        return [answer for answer, _ in answers if answer is not None]


async def _read_body(receive: Receive) -> bytes:
    """The request body, refused past MAX_BODY without reading further."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadEnd(400, "the client went away before the body was complete")
        body += message.get("body", b"")
        if len(body) > MAX_BODY:
            raise BadEnd(413, f"the body must be at most {MAX_BODY} bytes")
        if not message.get("more_body", False):
            return bytes(body)


async def _answer_json(send: Send, body: dict[str, object]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _answer(send: Send, status: int, reason: str | None) -> None:
    if reason is None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    payload = json.dumps({"error": {"message": reason, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 405:
        headers.append((b"allow", b"POST"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
