"""Fixtures for the KV connector tests (codec, transport, pipe, vLLM plugin)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kv_peer import Prefill

    from dllm_connector.transport.base import Transport
    from dllm_connector.transport.mooncake import MooncakeTransport

# Every test here drives torch (and most Mooncake or vLLM), which `make venv` installs: without them
# collection fails loudly (an ImportError naming the module), never silently collects nothing.

_TEST_ENV = {
    # The C codec kernels (the default; built in about a second): torch.compile's cost tens of seconds
    # on two shared cores. Tests compare every kernel set with the plain torch ops explicitly.
    "DLLM_KV_CODEC_KERNELS": "native",
    # Mooncake binds the first LAN address unless told otherwise; everything here stays on loopback.
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
}


@pytest.fixture(scope="session", autouse=True)
def _connector_test_env() -> Iterator[None]:
    """Set for this directory's tests (and the peer processes they start), restored afterwards."""
    saved = {name: os.environ.get(name) for name in _TEST_ENV}
    os.environ.update(_TEST_ENV)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def transports() -> Iterator[tuple[MooncakeTransport, MooncakeTransport]]:
    """A decode and a prefill Mooncake transport on loopback, shared by a module's tests (a module may
    define its own `transports`, which takes precedence)."""
    from dllm_connector.transport.mooncake import MooncakeTransport

    decode, prefill = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    yield decode, prefill
    decode.close()
    prefill.close()


@pytest.fixture(scope="module", params=["mooncake", "gloo"])
def kind(request: pytest.FixtureRequest) -> str:
    """The transport a two-process module runs over: the one-sided Mooncake engine (TCP), a gloo pair."""
    return str(request.param)


@pytest.fixture(scope="module")
def transport(kind: str) -> Iterator[Transport]:
    """Decode's transport of that kind, in this process."""
    from kv_peer import make_transport

    engine = make_transport(kind)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prefill(kind: str) -> Iterator[Prefill]:
    """A prefill worker of that kind in its own process (kv_peer.py)."""
    from kv_peer import Prefill

    peer = Prefill(kind)
    yield peer
    peer.close()
