"""The router's memory budget (NEW-1): bytes of client bodies and engine answers held at once, across
all requests, and the engine answers one request may hold.

Non-streamed answers are held whole until the client's answer is written, and one small request can
ask for answers of any size, so bytes are charged as they arrive (the upstream readers call `charge`)
and given back when the request ends. Past its request's cap an answer fails with `AnswerTooLarge`
(502); past the router's budget with `BudgetSpent` (503). Both are upstream errors, so a connection
that is reading fails the call and closes. The figures and how the budget is derived are in
docs/router.md.
"""

from __future__ import annotations

from dllm_router.upstream.errors import BadResponse

# How a refusal for the spent budget begins: the HTTP server's refusals carry a status and a message
# only, and this one is told apart from its other 503 (the connection cap) by it.
SPENT = "the router's memory budget"


class AnswerTooLarge(BadResponse):
    """An engine answer took this request over its cap."""


class BudgetSpent(BadResponse):
    """The router holds its whole budget already."""


class MemoryBudget:
    """Bytes held across all requests, against one limit."""

    def __init__(self, limit_bytes: int, answer_cap_bytes: int) -> None:
        self.limit = limit_bytes
        self.answer_cap = min(answer_cap_bytes, limit_bytes)
        self.held = 0

    def ledger(self) -> RequestBytes:
        return RequestBytes(self)


class RequestBytes:
    """What one request holds: its body and its engine answers so far."""

    __slots__ = ("_budget", "answers", "held")

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.held = 0
        self.answers = 0

    def charge_body(self, n: int) -> None:
        self._take(n)

    def try_charge_body(self, n: int) -> str | None:
        """As charge_body, for the HTTP server reading a body: why not, instead of raising."""
        try:
            self._take(n)
        except BudgetSpent as error:
            return str(error)
        return None

    def charge(self, n: int) -> None:
        """Answer bytes as they arrive."""
        budget = self._budget
        if self.answers + n > budget.answer_cap:
            raise AnswerTooLarge(
                f"engine answers for this request are over {budget.answer_cap // 2**20} MiB "
                "(--max-answer-mb); ask for fewer prompts, choices, tokens or logprobs"
            )
        self._take(n)
        self.answers += n

    def _take(self, n: int) -> None:
        budget = self._budget
        if budget.held + n > budget.limit:
            raise BudgetSpent(
                f"{SPENT} ({budget.limit // 2**20} MiB, --memory-budget-mb) is "
                "spent by requests in flight; retry shortly"
            )
        budget.held += n
        self.held += n

    def release(self) -> None:
        self._budget.held -= self.held
        self.held = self.answers = 0
