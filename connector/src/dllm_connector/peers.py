"""Where a prefill engine may send KV (C1): only to the decode peers its own config names.

A request's `decode_host` comes from whoever reached the engine's HTTP port. Prefill connects to
it, sends its Mooncake endpoint and model signature, and writes wherever the accept says, so an
unchecked host is an SSRF and a write primitive. The rule: the request's host must resolve only
to addresses that the configured decode peer (`VLLM_KV_DECODE_IP`, which the operator sets to the
decode role's headless Service, so it resolves to the ready decode pods) resolves to, and its port
must be the configured decode port. An engine configured with no decode peer (kv_both in one pod)
sends only to its own host. The connection then goes to the address that was checked, so a name
that resolves differently a moment later cannot redirect it.

The Service lists ready pods only, and a decode pod leaves it as soon as it starts terminating,
while requests routed to it before still wait for their KV (its preStop drain). So an address stays
allowed for `REMEMBER_S` after the Service last listed it: only recent decode pods, never others.

A decode pod that just became ready can reach the router before this engine's last lookup saw it
(the router resolves the same Service on its own clock). An address not yet allowed is therefore
looked up again, at most once per `_MISS_REFRESH_S`, until `miss_wait_s` has passed (the transfer
timeout): refusing at once turned a scale-up into a failed request (issue 31). Only then is the
address refused; a stranger costs its own send thread that wait, nothing else.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

# The decode Service's addresses are looked up again after this long, or on a miss after
# _MISS_REFRESH_S (a decode pod that just became ready), never more often.
_REFRESH_S = 30.0
_MISS_REFRESH_S = 1.0
MISS_WAIT_S = 5.0  # a Service's DNS answer is cached for 5 s by CoreDNS's default TTL
REMEMBER_S = 600.0  # the router's longest request: a request routed to a pod may outlive its listing

Resolver = Callable[[str], set[str]]


class PeerNotAllowed(ValueError):
    """The decode peer a request named is not one this engine may send to."""


def resolve(host: str) -> set[str]:
    """Every address `host` resolves to (none when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


class DecodePeers:
    """`address(host, port)`: the address to connect to for a request's decode peer, or PeerNotAllowed."""

    def __init__(
        self,
        decode_host: str | None,
        decode_port: int | None,
        own_host: str,
        *,
        lookup: Resolver = resolve,
        remember_s: float = REMEMBER_S,
        miss_wait_s: float = MISS_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._allowed_name = decode_host or own_host
        self._port = decode_port
        self._lookup = lookup
        self._remember_s = remember_s
        self._miss_wait_s = miss_wait_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # address -> when the Service last listed it
        self._looked_up = -float("inf")

    def address(self, host: str, port: int) -> str:
        if self._port is not None and port != self._port:
            raise PeerNotAllowed(f"decode KV port {port} is not this deployment's ({self._port})")
        addresses = self._lookup(host)
        if not addresses:
            raise PeerNotAllowed(f"decode host {host[:100]!r} does not resolve")
        deadline = self._clock() + self._miss_wait_s
        allowed = self._allowed_now(refresh=False)
        while not addresses <= allowed:
            next_lookup = max(self._looked_up + _MISS_REFRESH_S, self._clock())
            if next_lookup > deadline:
                raise PeerNotAllowed(
                    f"decode host {host[:100]!r} is not one of the decode peers ({self._allowed_name[:100]})"
                )
            self._sleep(max(0.0, next_lookup - self._clock()))
            allowed = self._allowed_now(refresh=True)
        return min(addresses)

    def _allowed_now(self, *, refresh: bool) -> set[str]:
        with self._lock:
            now = self._clock()
            age = now - self._looked_up
            if age >= _REFRESH_S or (refresh and age >= _MISS_REFRESH_S):
                self._seen.update(dict.fromkeys(self._lookup(self._allowed_name), now))
                self._looked_up = now
            self._seen = {addr: seen for addr, seen in self._seen.items() if now - seen <= self._remember_s}
            return set(self._seen)
