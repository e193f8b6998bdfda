"""Engine pods of one role: discovery (DNS or static), health state and least-outstanding choice.

A headless Service has one A record per ready pod, so each resolved address is one pod. Sources are
plain async callables returning the current address set, so tests can feed changing sets.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from dllm_router.config import Address, Upstreams

if TYPE_CHECKING:
    from dllm_router.upstream import UpstreamPool

log = logging.getLogger(__name__)

AddressSource = Callable[[], Awaitable[frozenset[Address]]]
Resolver = Callable[[str], Awaitable[frozenset[str]]]


def fits(fingerprint: str | None, partners: Collection[str | None]) -> bool:
    """Whether a pod with `fingerprint` may pair with a pod of one of `partners`: equal ones, or where
    either side names none (a pod from before fingerprints, as every pod paired then)."""
    return fingerprint is None or None in partners or fingerprint in partners


@dataclass(eq=False)
class Endpoint:
    """One engine pod. `healthy` is False until its first health check passes."""

    role: str
    host: str
    port: int
    scheme: str = "http"
    inflight: int = 0
    healthy: bool = False
    slow_probes: int = 0  # health checks in a row that timed out while it was healthy
    last_pick: int = 0
    engine_ids: tuple[str, ...] = ()  # mooncake: engine id per data-parallel rank
    # its KV-compatibility fingerprint, from its /health answer (None: it names none); a prefill pod
    # and a decode pod pair only when theirs are equal
    fingerprint: str | None = None
    next_dp_rank: int = 0
    upstream: UpstreamPool | None = None  # keep-alive connections, attached by the router
    url: str = field(init=False)
    name: str = field(init=False)  # host:port, as logs and metrics show the pod

    def __post_init__(self) -> None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{self.scheme}://{host}:{self.port}"
        self.name = f"{self.host}:{self.port}"


class Pool:
    """The pods of one role, as last discovered."""

    def __init__(self, role: str, scheme: str = "http") -> None:
        self.role = role
        self.scheme = scheme
        self.endpoints: dict[Address, Endpoint] = {}
        self._picks = 0

    def update(self, addresses: Iterable[Address]) -> tuple[list[Endpoint], list[Endpoint]]:
        """Make the pool match `addresses`; returns (added, removed). Kept pods keep their state."""
        wanted = set(addresses)
        removed = [ep for addr, ep in self.endpoints.items() if addr not in wanted]
        for ep in removed:
            del self.endpoints[(ep.host, ep.port)]
        added = [Endpoint(self.role, h, p, self.scheme) for h, p in sorted(wanted - self.endpoints.keys())]
        for ep in added:
            self.endpoints[(ep.host, ep.port)] = ep
        return added, removed

    def ready(self) -> list[Endpoint]:
        return [ep for ep in self.endpoints.values() if ep.healthy]

    def pick(
        self, exclude: Iterable[Endpoint] = (), fingerprints: Collection[str | None] | None = None
    ) -> Endpoint | None:
        """The ready pod with the fewest outstanding requests, among those that fit one of
        `fingerprints` when given; ties go to the least recently picked."""
        skip = set(exclude)
        best: Endpoint | None = None
        for ep in self.endpoints.values():
            if not ep.healthy or ep in skip:
                continue
            if fingerprints is not None and not fits(ep.fingerprint, fingerprints):
                continue
            if best is None or (ep.inflight, ep.last_pick) < (best.inflight, best.last_pick):
                best = ep
        if best is None and skip:
            return self.pick((), fingerprints)  # every other pod is out: the excluded one beats a 503
        if best is not None:
            self._picks += 1
            best.last_pick = self._picks
        return best


async def resolve_host(host: str) -> frozenset[str]:
    """The addresses of `host`: one per pod. An unknown name (a headless Service with no ready pod) is
    empty. A dual-stack Service lists each pod twice (A and AAAA): then only the IPv4 addresses count."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return frozenset()
        raise
    v4 = frozenset(str(i[4][0]) for i in infos if i[0] == socket.AF_INET)
    return v4 or frozenset(str(i[4][0]) for i in infos)


class DnsSource:
    """A headless Service name re-resolved on each call; a failed lookup keeps the previous set."""

    def __init__(self, host: str, port: int, resolve: Resolver = resolve_host) -> None:
        self.host, self.port, self._resolve = host, port, resolve
        self._last: frozenset[Address] = frozenset()

    async def __call__(self) -> frozenset[Address]:
        try:
            ips = await self._resolve(self.host)
        except OSError as e:
            log.warning("resolving %s failed (%s); keeping %d known pods", self.host, e, len(self._last))
            return self._last
        self._last = frozenset((ip, self.port) for ip in ips)
        return self._last


class StaticSource:
    def __init__(self, urls: Iterable[str]) -> None:
        addresses = set()
        for url in urls:
            parts = urlsplit(url)
            if parts.hostname is None or parts.port is None:
                raise ValueError(f"not a base URL: {url!r}")
            addresses.add((parts.hostname, parts.port))
        self._addresses = frozenset(addresses)

    async def __call__(self) -> frozenset[Address]:
        return self._addresses


def source_for(upstreams: Upstreams) -> AddressSource:
    if upstreams.dns is not None:
        return DnsSource(*upstreams.dns)
    return StaticSource(upstreams.urls)


def scheme_of(upstreams: Upstreams) -> str:
    return urlsplit(upstreams.urls[0]).scheme if upstreams.urls else "http"
