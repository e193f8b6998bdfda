"""Pod pools and DNS discovery: injected resolvers with changing answers, and the real one on localhost."""

from __future__ import annotations

import socket

import pytest

from dllm_router.endpoints import DnsSource, Pool, StaticSource, resolve_host

pytestmark = pytest.mark.timeout(10)


def ready_pool(*ports: int) -> Pool:
    pool = Pool("decode")
    pool.update(("10.0.0.1", p) for p in ports)
    for ep in pool.endpoints.values():
        ep.healthy = True
    return pool


def test_pick_least_outstanding_then_least_recently_picked() -> None:
    pool = ready_pool(1, 2, 3)
    a, b, c = (pool.endpoints[("10.0.0.1", p)] for p in (1, 2, 3))
    assert [pool.pick() for _ in range(3)] == [a, b, c]  # idle pods take turns
    a.inflight, b.inflight, c.inflight = 2, 0, 1
    assert pool.pick() is b
    b.inflight = 5
    assert pool.pick() is c
    c.healthy = False
    assert pool.pick() is a


def test_pick_skips_excluded_unless_nothing_else_is_ready() -> None:
    pool = ready_pool(1, 2)
    a, b = pool.endpoints.values()
    assert pool.pick(exclude=[a]) is b
    b.healthy = False
    assert pool.pick(exclude=[a]) is a
    a.healthy = False
    assert pool.pick() is None
    assert Pool("prefill").pick() is None


def test_update_keeps_state_of_pods_that_stay() -> None:
    pool = ready_pool(1, 2)
    kept = pool.endpoints[("10.0.0.1", 2)]
    kept.inflight = 3
    added, removed = pool.update([("10.0.0.1", 2), ("10.0.0.9", 2)])
    assert [e.name for e in added] == ["10.0.0.9:2"]
    assert [e.name for e in removed] == ["10.0.0.1:1"]
    assert pool.endpoints[("10.0.0.1", 2)] is kept
    assert kept.inflight == 3
    assert not pool.endpoints[("10.0.0.9", 2)].healthy  # joins after its health check


async def test_dns_source_follows_changing_answers_and_survives_failures() -> None:
    answers: list[frozenset[str] | OSError] = [
        frozenset({"10.0.0.1"}),
        frozenset({"10.0.0.1", "10.0.0.2"}),
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        frozenset({"10.0.0.2"}),
        frozenset(),
    ]
    asked: list[str] = []

    async def resolver(host: str) -> frozenset[str]:
        asked.append(host)
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    source = DnsSource("llm-decode", 8001, resolve=resolver)
    assert await source() == {("10.0.0.1", 8001)}
    assert await source() == {("10.0.0.1", 8001), ("10.0.0.2", 8001)}
    assert await source() == {("10.0.0.1", 8001), ("10.0.0.2", 8001)}  # a failed lookup keeps the last set
    assert await source() == {("10.0.0.2", 8001)}
    assert await source() == frozenset()
    assert asked == ["llm-decode"] * 5


async def test_real_resolver_on_localhost_and_an_unknown_name() -> None:
    assert await resolve_host("localhost") == {"127.0.0.1"}  # IPv4 only, even where ::1 is listed too
    assert await resolve_host("::1") == {"::1"}
    assert await DnsSource("localhost", 8000)() >= {("127.0.0.1", 8000)}
    assert await resolve_host("no-such-service.invalid") == frozenset()


async def test_static_source() -> None:
    assert await StaticSource(["http://a:1", "https://b:2"])() == {("a", 1), ("b", 2)}
