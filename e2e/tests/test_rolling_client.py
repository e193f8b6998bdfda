"""The rolling tests' client retries a connect only when no route led to the router's Service (the
request reached no part of the product); every other failure is the request's outcome."""

from __future__ import annotations

import errno
import http.client
import urllib.error

import pytest
from e2e.rolling import unrouted


@pytest.mark.parametrize("code", [errno.ENETUNREACH, errno.EHOSTUNREACH])
def test_a_connect_with_no_route_is_retried(code: int) -> None:
    assert unrouted(urllib.error.URLError(OSError(code, "no route")))


@pytest.mark.parametrize(
    "error",
    [
        urllib.error.URLError(ConnectionRefusedError(errno.ECONNREFUSED, "refused")),  # no endpoint
        urllib.error.URLError(TimeoutError("timed out")),
        urllib.error.URLError("unknown url type"),
        http.client.RemoteDisconnected("closed mid-answer"),
        ConnectionResetError(errno.ECONNRESET, "reset"),
    ],
)
def test_every_other_failure_counts_against_the_roll(error: BaseException) -> None:
    assert not unrouted(error)
