"""What a request may ask its answers to carry (NEW-1): logprobs, prompt logprobs and echo make an
engine's answer grow with the prompt or with every token, far past the request's own size, and the
router holds non-streamed answers whole. Refused here with a 400 that names the field, before any
engine call; the bytes an answer may really take are bounded as they arrive (memory_budget.py).

vLLM's OpenAI fields (entrypoints/openai/{completion,chat_completion}/protocol.py): completions
`logprobs: int` (top-k per generated token), chat `logprobs: bool` with `top_logprobs: int`, both
`prompt_logprobs: int` (top-k per prompt token; -1 is the whole vocabulary) and `echo: bool` (the
prompt repeated in every choice), `n` choices per prompt.
"""

from __future__ import annotations

from typing import Any

JsonObject = dict[str, Any]


class AskTooLarge(ValueError):
    """The request asks its answers for more than the router allows; the message says what."""


def check_answer_asks(body: JsonObject, prompts: int, n: int, max_logprobs: int, max_n: int) -> None:
    """Each top-k within `max_logprobs` (vLLM's own default --max-logprobs is 20); summed over the
    request's prompts and choices, no more than one prompt may ask: `max_logprobs x max_n` logprobs
    per generated token, `max_logprobs + 1` per prompt token, and echo's copies within `max_n`."""
    per_token = _top_k(body, "top_logprobs" if isinstance(body.get("logprobs"), bool) else "logprobs")
    if body.get("logprobs") is False:
        per_token = 0
    per_prompt_token = _top_k(body, "prompt_logprobs")
    for key, k in (("logprobs", per_token), ("prompt_logprobs", per_prompt_token)):
        if k is not None and k > max_logprobs:
            raise AskTooLarge(f"'{key}' is {k}; this router allows at most {max_logprobs} (--max-logprobs)")
    if per_token and per_token * n * prompts > max_logprobs * max_n:
        raise AskTooLarge(
            f"logprobs x n x prompts is {per_token} x {n} x {prompts}; this router allows at most "
            f"{max_logprobs * max_n} (--max-logprobs x --max-n) in one request"
        )
    if per_prompt_token is not None and (per_prompt_token + 1) * prompts > max_logprobs + 1:
        raise AskTooLarge(
            f"'prompt_logprobs' ({per_prompt_token}) over {prompts} prompts asks "
            f"{(per_prompt_token + 1) * prompts} logprobs per prompt position; this router allows at "
            f"most {max_logprobs + 1} (--max-logprobs + 1) in one request"
        )
    if body.get("echo") and n * prompts > max_n:
        raise AskTooLarge(
            f"'echo' copies each prompt into each choice: n x prompts is {n} x {prompts}; this router "
            f"allows at most {max_n} (--max-n) with echo"
        )


def _top_k(body: JsonObject, key: str) -> int | None:
    value = body.get(key)
    if value is None or value is False:
        return None
    if value is True:
        return 0  # chat's logprobs without top_logprobs: the sampled token's own
    if not isinstance(value, int) or value < 0:
        raise AskTooLarge(f"'{key}' must be a whole number from 0 (-1, the whole vocabulary, is refused)")
    return value
