"""W3C Trace Context through the router (trace_context.py): both engine calls of one request carry the
client's `traceparent` and `tracestate`, or one new `traceparent` when the client's is absent or not
W3C's form, on every flow and on both request paths, over real HTTP against engine doubles."""

from __future__ import annotations

from typing import Any

import pytest
from router_engine_double import Seen
from router_harness import EngineFactory, RouterFactory, RunningRouter

from dllm_router.config import FLOWS, Flow
from dllm_router.openai import COMPLETIONS
from dllm_router.trace_context import MAX_TRACESTATE, new_traceparent, valid_traceparent

pytestmark = pytest.mark.timeout(20)

CLIENTS = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BODIES = {
    "fast": {"prompt": "t", "max_tokens": 3},
    "stream": {"prompt": "t", "max_tokens": 3, "stream": True},
}


@pytest.mark.parametrize(
    "value",
    [
        b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
        b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # no trace id
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # no parent id
        b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the forbidden version
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        CLIENTS.encode() + b", " + CLIENTS.encode(),  # two headers, joined
        b"",
    ],
)
def test_anything_but_w3cs_version_00_form_is_not_a_traceparent(value: bytes) -> None:
    assert not valid_traceparent(value)


def test_new_traceparents_are_valid_sampled_and_never_repeat() -> None:
    made = {new_traceparent() for _ in range(100)}
    assert len(made) == 100
    assert all(valid_traceparent(t) and t.endswith(b"-01") for t in made)


async def traced(
    flow: Flow, engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, headers: dict[str, str]
) -> tuple[list[str | None], list[str | None]]:
    """The traceparent and tracestate each engine call saw, for one request of each path."""
    p, d = await engines("p0", nixl=flow == "nixl"), await engines("d0")
    boot = await bootstrap(["e0"])
    r: RunningRouter = await start_router(flow, [p], [d], mooncake_bootstrap_port=boot.port)
    seen_parents: list[str | None] = []
    seen_states: list[str | None] = []
    for body in BODIES.values():
        before = (len(p.generations), len(d.generations))
        async with await r.post(COMPLETIONS, body, headers) as answer:
            assert answer.status == 200, await answer.text()
            await answer.read()
        calls: list[Seen] = [*p.generations[before[0] :], *d.generations[before[1] :]]
        assert len(calls) == 2
        parents = {call.headers.get("traceparent") for call in calls}
        assert len(parents) == 1, parents  # both legs: one trace
        seen_parents += parents
        seen_states += {call.headers.get("tracestate") for call in calls}
    return seen_parents, seen_states


@pytest.mark.parametrize("flow", FLOWS)
async def test_the_clients_trace_context_reaches_both_legs_unchanged(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, flow: Flow
) -> None:
    state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    parents, states = await traced(
        flow, engines, start_router, bootstrap, {"traceparent": CLIENTS, "tracestate": state}
    )
    assert parents == [CLIENTS, CLIENTS]
    assert states == [state, state]


@pytest.mark.parametrize("flow", FLOWS)
async def test_without_a_trace_context_both_legs_share_a_new_one(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, flow: Flow
) -> None:
    parents, states = await traced(flow, engines, start_router, bootstrap, {"tracestate": "a=b"})
    assert all(p is not None and valid_traceparent(p.encode()) for p in parents), parents
    assert parents[0] != parents[1]  # one trace per request
    assert states == [None, None]  # a state without its parent is not passed on


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": CLIENTS.upper(), "tracestate": "a=b"},
        {"traceparent": CLIENTS, "tracestate": "a=" + "b" * MAX_TRACESTATE},
    ],
    ids=["bad-parent", "long-state"],
)
async def test_a_bad_trace_context_is_replaced_or_dropped_not_passed_on(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, headers: dict[str, str]
) -> None:
    parents, states = await traced("dllm", engines, start_router, bootstrap, headers)
    if headers["traceparent"] == CLIENTS:
        assert parents == [CLIENTS, CLIENTS]
    else:
        assert CLIENTS.upper() not in parents
        assert all(p is not None and valid_traceparent(p.encode()) for p in parents)
    assert states == [None, None]
