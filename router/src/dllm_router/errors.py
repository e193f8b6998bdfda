"""What a request can end in besides a generation, shared by the coroutine path and the fast path."""

from __future__ import annotations

import contextlib
import secrets

import msgspec

from dllm_router import openai as oa
from dllm_router.endpoints import Endpoint
from dllm_router.engine_answer import EngineAnswer
from dllm_router.http_messages import Request


class RouterError(Exception):
    """An answer the client gets instead of a generation; `kind` is the metrics' error kind."""

    def __init__(self, status: int, kind: str, message: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind
        self.body = body if body is not None else oa.error_body(message, kind, status)


class Unreachable(Exception):
    """A failure before any byte reached the client: safe to retry on another pod. `answer`: what the
    client gets if no retry is left (None: a 502 naming the role as unreachable)."""

    def __init__(
        self,
        endpoint: Endpoint,
        cause: BaseException,
        connect_failed: bool,
        answer: RouterError | None = None,
    ) -> None:
        super().__init__(f"{endpoint.role} pod {endpoint.name} unreachable: {cause!r}")
        self.endpoint, self.connect_failed, self.answer = endpoint, connect_failed, answer

    def final(self) -> RouterError:
        """What the client gets when this was the last attempt."""
        if self.answer is not None:
            return self.answer
        return RouterError(502, f"{self.endpoint.role}_unreachable", str(self))


class EngineFailed(Exception):
    """An engine answered a server error (5xx) before any byte reached the client."""


_VISIBLE = bytes(range(0x21, 0x7F))
MAX_REQUEST_ID = 128  # characters: a uuid or a trace id fits; transfer ids add ~20 and stay under 256


def new_request_id() -> str:
    return secrets.token_hex(16)


def request_id(request: Request) -> str:
    """The client's X-Request-Id, or a new one (128 bits from the OS's CSPRNG: ids are echoed to clients
    and become the engines' request ids, so one client must not predict another's, NEW-9).

    An id over MAX_REQUEST_ID characters, or with anything but visible ASCII, is a 400 (L1): it goes
    into transfer ids the connector limits to 256 characters, and into every access line."""
    rid = request.header(b"x-request-id")
    if not rid:
        return new_request_id()
    if len(rid) > MAX_REQUEST_ID or rid.translate(None, _VISIBLE):  # something not visible ASCII is left
        raise RouterError(
            400, "bad_request", f"X-Request-Id must be 1-{MAX_REQUEST_ID} visible ASCII characters"
        )
    return rid.decode("ascii")


def request_id_or_new(request: Request | None) -> str:
    """The client's id when it is acceptable, else a new one (for answers that must not fail)."""
    if request is not None:
        with contextlib.suppress(RouterError):
            return request_id(request)
    return new_request_id()


def header_value(value: str) -> bytes:
    if "\r" in value or "\n" in value:
        raise RouterError(400, "bad_request", "a header value contains a line break")
    return value.encode("latin-1", errors="replace")


def as_error(data: bytes) -> bytes:
    """An upstream error body, kept when it is a JSON object (vLLM's own error), replaced otherwise."""
    with contextlib.suppress(ValueError):
        if isinstance(oa.loads(data), dict):
            return data
    # Not echoed: a non-JSON body may be a proxy's or a crashed server's page, nothing a client should read.
    return oa.error_body(f"upstream error ({len(data)} bytes, not JSON)", "upstream_error", 502)


def pod_error(ep: Endpoint, status: int, data: bytes) -> RouterError:
    """What the client gets when a pod answered with an error status (its own error body, if JSON)."""
    return RouterError(
        status, f"{ep.role}_error", f"{ep.role} pod {ep.name} answered {status}", as_error(data)
    )


def pod_failure(ep: Endpoint, status: int, data: bytes) -> RouterError | Unreachable:
    """An error status from a pod, before any byte reached the client. A client error (4xx) is the
    request's own and reaches the client. A server error (5xx) is retried on another pair like a failed
    connection (issue 31: decode answers 500 when its KV load failed, say a prefill or the node stalled
    past the transfer timeout, and the next attempt usually succeeds); the pod's own error reaches the
    client once the retries are spent. Nothing was generated for the client, so a retry repeats nothing
    it saw."""
    error = pod_error(ep, status, data)
    if status < 500:
        return error
    return Unreachable(ep, EngineFailed(str(error)), connect_failed=False, answer=error)


class PrefillDidNotRun(Exception):
    """Prefill answered 200 for a prompt it never ran: no KV will come for it."""


# How a prefill call that ran ends: its one token (length), or an end of the answer there (stop).
_PREFILL_RAN = ("length", "stop")


def prefill_answer(data: bytes, ep: Endpoint) -> EngineAnswer:
    """Prefill's answer, a JSON object kept raw (only what the router reads of it is decoded: NEW-1), or
    the error the client gets for anything else.

    A choice that ended otherwise did not run: vLLM answers 200 with finish_reason "abort" for a
    request its engine core rejected because it was shutting down (a pod being replaced), and decode
    would wait for KV that never comes (issue 31). That is Unreachable: the pod is taken out and the
    request is tried on another one."""
    try:
        answer = EngineAnswer.parse(data)
    except msgspec.ValidationError:
        raise RouterError(502, "prefill_error", f"prefill pod {ep.name} answered a non-object") from None
    except ValueError:
        raise RouterError(502, "prefill_error", f"prefill pod {ep.name} answered non-JSON") from None
    for head in answer.choice_heads():
        if head.finish_reason not in _PREFILL_RAN:
            reason = f"finish_reason {str(head.finish_reason)[:40]!r}: it did not run the prompt"
            raise Unreachable(ep, PrefillDidNotRun(reason), connect_failed=True)
    return answer
