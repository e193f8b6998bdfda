"""Pure shaping of OpenAI-style requests and responses for the two PD calls.

Nothing here does I/O: it splits a multi-prompt request, builds the prefill and decode bodies, decides
whether prefill already finished the answer, turns such an answer into a stream when the client asked
for one, and merges per-prompt answers back into one response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from dllm_router.answer_bounds import AskTooLarge, check_answer_asks
from dllm_router.engine_answer import ChoiceHead, EngineAnswer, choice_head, renumbered_choices
from dllm_router.jsonshape import TooComplex, check_shape

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATION_ROUTES = (COMPLETIONS, CHAT)
JsonObject = dict[str, Any]
DONE = b"[DONE]"
MAX_SSE_EVENT = 16 * 1024 * 1024  # one upstream event (a chunk of a few tokens is ~1 KiB)


def dumps(obj: object) -> bytes:
    """Compact UTF-8 JSON (msgspec: documented, and faster than the standard library's)."""
    return msgspec.json.encode(obj)


def loads(data: bytes) -> Any:
    """JSON from UTF-8 bytes; a msgspec.DecodeError (a ValueError) when it is not JSON. Stricter than
    json.loads where that is wrong anyway: no NaN or Infinity."""
    return msgspec.json.decode(data)


def error_body(message: str, kind: str, code: int) -> bytes:
    """vLLM's / OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


class BadRequest(ValueError):
    """The client's body is not a request the router can route."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (H2): prompts fan out to two upstream calls each, n to n choices."""

    max_prompts: int = 64
    max_n: int = 16
    max_logprobs: int = 20  # NEW-1: top-k per token, and what a request's answers may carry (answer_bounds)


def parse_request(raw: bytes, route: str, limits: Limits = Limits()) -> JsonObject:
    """The client's body as a JSON object, or BadRequest. Never raises anything else for any bytes:
    a shape too costly to parse, a >4300-digit integer or deep nesting is a 400 like bad JSON (L1)."""
    try:
        check_shape(raw)
        body = loads(raw)
    except TooComplex as e:
        raise BadRequest(str(e)) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise BadRequest(f"request body is not JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if route == COMPLETIONS and "prompt" not in body:
        raise BadRequest("'prompt' is required")
    if route == CHAT and not isinstance(body.get("messages"), list):
        raise BadRequest("'messages' must be a list")
    for key in ("n", "best_of"):
        n = body.get(key, 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise BadRequest(f"'{key}' must be a positive integer")
        if n is not None and n > limits.max_n:
            raise BadRequest(f"'{key}' is {n}; this router allows at most {limits.max_n} (--max-n)")
    _check_token_bounds(body)
    prompts = prompt_count(route, body)
    if prompts > limits.max_prompts:
        raise BadRequest(
            f"too many prompts: {prompts}; this router allows at most {limits.max_prompts} (--max-prompts)"
        )
    n = max(choices_per_prompt(body), body.get("best_of") or 1)
    try:
        check_answer_asks(body, prompts, n, limits.max_logprobs, limits.max_n)
    except AskTooLarge as e:
        raise BadRequest(str(e)) from None
    return body


def _check_token_bounds(body: JsonObject) -> None:
    """Refuse here what decode would refuse after prefill already ran (M2): prefill gets max_tokens=1
    and no min_tokens, so it would accept and then hold the request's KV for a decode that never
    claims it."""
    bounds: dict[str, int | None] = {}
    for key, least in (("max_tokens", 1), ("max_completion_tokens", 1), ("min_tokens", 0)):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise BadRequest(f"'{key}' must be an integer of at least {least}")
        bounds[key] = value
    largest = bounds["max_completion_tokens"] or bounds["max_tokens"]
    floor = bounds["min_tokens"]
    if largest is not None and floor is not None and floor > largest:
        raise BadRequest(f"'min_tokens' ({floor}) is above the maximum number of tokens ({largest})")


def prompt_count(route: str, body: JsonObject) -> int:
    """How many prompts `split_prompts` makes of the body (without copying it)."""
    prompt = body.get("prompt") if route == COMPLETIONS else None
    if not isinstance(prompt, list) or len(prompt) < 2:
        return 1
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return len(prompt)
    return 1


def split_prompts(route: str, body: JsonObject) -> list[JsonObject]:
    """One body per prompt: a completions `prompt` list of strings or of token-id lists is split."""
    prompt = body.get("prompt") if route == COMPLETIONS else None
    if not isinstance(prompt, list) or len(prompt) < 2:
        return [body]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return [{**body, "prompt": p} for p in prompt]
    return [body]  # a single prompt given as token ids


def choices_per_prompt(body: JsonObject) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and n > 0 else 1


def asks_one_token(body: JsonObject) -> bool:
    """max_tokens (or max_completion_tokens) of 1: prefill alone is the whole answer."""
    return body.get("max_completion_tokens", body.get("max_tokens")) == 1


def prefill_request(body: JsonObject, kv_params: JsonObject) -> JsonObject:
    """The prefill call: one token, one choice, not streamed, with the flow's kv_transfer_params."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    if _xargs_kv(body):
        out["vllm_xargs"] = _xargs_without_kv(body["vllm_xargs"])
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=kv_params)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


# stream_options needs stream; min_tokens above max_tokens=1 would be refused by the engine.
_PREFILL_DROPS = frozenset({"stream_options", "min_tokens", "min_completion_tokens"})


def decode_request(body: JsonObject, kv_params: JsonObject | None) -> JsonObject:
    """The body with the router's kv_transfer_params, and never the client's own (C1), top-level or in
    `vllm_xargs` (NEW-2: vLLM takes them from there when the top-level key is absent or empty)."""
    out = {k: v for k, v in body.items() if k != CLIENT_KV} if CLIENT_KV in body else body
    if _xargs_kv(body):
        out = {**out, "vllm_xargs": _xargs_without_kv(body["vllm_xargs"])}
    return out if kv_params is None else {**out, CLIENT_KV: kv_params}


CLIENT_KV = "kv_transfer_params"


def _xargs_kv(body: JsonObject) -> bool:
    """The client put kv_transfer_params into vllm_xargs (vLLM's free-form extra sampling args)."""
    xargs = body.get("vllm_xargs")
    return isinstance(xargs, dict) and CLIENT_KV in xargs


def _xargs_without_kv(xargs: JsonObject) -> JsonObject:
    return {k: v for k, v in xargs.items() if k != CLIENT_KV}


def carries_client_kv(body: JsonObject) -> bool:
    """The client's body names kv_transfer_params itself, at the top level or in vllm_xargs."""
    return CLIENT_KV in body or _xargs_kv(body)


def decode_payload(body: JsonObject, raw: bytes | None, kv_params: JsonObject | None) -> bytes:
    """An answering call's body as bytes (decode's, or prefill's for a one-token request): the client's
    own bytes, with kv_transfer_params spliced in before the closing brace, so a long prompt is not
    encoded again. Re-encoded without the key when the client sent kv_transfer_params itself (top-level
    or in vllm_xargs): a client must never choose an engine's KV transfer (C1, NEW-2: it crashes the
    engine or points it anywhere). Also re-encoded when the bytes are not plain UTF-8 JSON, or there are
    no client bytes."""
    if raw is not None and not carries_client_kv(body):
        if kv_params is None:
            return raw
        stripped = raw.strip()
        if stripped.startswith(b"{") and stripped.endswith(b"}") and body:
            return stripped[:-1] + b',"kv_transfer_params":' + dumps(kv_params) + b"}"
    return dumps(decode_request(body, kv_params))


def finished_at_prefill(answer: EngineAnswer, body: JsonObject) -> bool:
    """Prefill's single token ended the request (EOS or a stop string) and one choice was asked."""
    if choices_per_prompt(body) != 1:
        return False
    choices = answer.choices()
    head = choice_head(choices[0]) if len(choices) == 1 else None
    return head is not None and head.finish_reason == "stop"


def _chunk_choice(route: str, choice: ChoiceHead) -> JsonObject:
    base = {"index": choice.index, "logprobs": None, "finish_reason": choice.finish_reason}
    if route == CHAT:
        message = choice.message or {}
        base["delta"] = {"role": message.get("role", "assistant"), "content": message.get("content", "")}
    else:
        base["text"] = choice.text
    return base


def answer_as_events(route: str, answer: EngineAnswer, body: JsonObject) -> list[bytes]:
    """A finished non-streamed answer as the SSE data payloads a streamed one would have had."""
    head = {
        "id": answer.value("id", ""),
        "object": "chat.completion.chunk" if route == CHAT else "text_completion",
        "created": answer.value("created", int(time.time())),
        "model": answer.value("model", ""),
    }
    choices = [_chunk_choice(route, c) for c in answer.choice_heads()]
    events = [dumps({**head, "choices": choices})]
    options = body.get("stream_options")
    usage = answer.value("usage")
    if isinstance(options, dict) and options.get("include_usage") and usage:
        events.append(dumps({**head, "choices": [], "usage": usage}))
    return events


def sse(payloads: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in [*payloads, DONE])


class SseSplitter:
    """Splits an upstream SSE byte stream into the payloads of its `data:` events. Linear: each byte is
    searched once (the search resumes where the last one stopped) and the buffer is trimmed once per
    feed, not once per event (L7)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._searched = 0  # bytes of the buffer known to hold no event end

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += chunk
        payloads: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", max(start, self._searched - 1))
            if end < 0:
                break
            for line in bytes(buffer[start:end]).split(b"\n"):
                if line.startswith(b"data:"):
                    payloads.append(line[5:].strip())
            start = self._searched = end + 2
        del buffer[:start]
        self._searched = len(buffer)
        if len(buffer) > MAX_SSE_EVENT:
            raise ValueError(f"an upstream SSE event is over {MAX_SSE_EVENT} bytes")
        return payloads


def add_usage(total: JsonObject, usage: object) -> None:
    if isinstance(usage, dict):
        for key, value in usage.items():
            if isinstance(value, int):
                total[key] = total.get(key, 0) + value


def shift_choices(payload: JsonObject, offset: int) -> JsonObject:
    """Renumber choices of prompt i as vLLM does for a multi-prompt request: i * n + index."""
    for choice in payload.get("choices") or []:
        if isinstance(choice, dict):
            choice["index"] = offset + int(choice.get("index", 0))
    return payload


def merge_answers(answers: list[EngineAnswer], n: int) -> bytes:
    """Per-prompt completions answers merged into one, choices in prompt order: the first answer's
    fields (without kv_transfer_params), every answer's choices renumbered, their usage summed. Encoded
    from the answers' raw pieces (engine_answer): the choices are never parsed whole (NEW-1)."""
    merged: dict[str, Any] = {k: v for k, v in answers[0].fields.items() if k != CLIENT_KV}
    choices: list[Any] = []
    usage: JsonObject = {}
    for i, answer in enumerate(answers):
        choices += renumbered_choices(answer, i * n)
        add_usage(usage, answer.value("usage"))
    merged["choices"] = choices
    if usage:
        merged["usage"] = usage
    return dumps(merged)
