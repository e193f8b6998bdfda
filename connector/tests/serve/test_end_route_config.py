"""Where POST /v1/dllm/end_transfer's target comes from: the engine's env (ports, TP size, timeout,
vLLM's keys, the side channel token), refused by name where a value is bad; vLLM builds the route from
its app alone, by the middleware name dllm-serve gives it.
"""

from __future__ import annotations

from typing import Any

import pytest
from end_route_cases import API_KEY, TOKEN, FakeEngineApp

from dllm_connector.end_route import EndRouteConfigError, EndTarget, EndTransferRoute
from dllm_connector.end_route_names import END_ROUTE_MIDDLEWARE
from dllm_connector.transport.sidechannel import PeerAuth

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def _env(**changes: str) -> dict[str, str]:
    env = {
        "VLLM_KV_CONNECTOR": "mooncake",
        "VLLM_KV_ROLE": "decode",
        "VLLM_KV_LISTEN_PORT": "50051",
        "VLLM_KV_TRANSFER_TIMEOUT_MS": "1500",
        "VLLM_HOST_IP": "10.0.0.6",
        "DLLM_END_ROUTE_TP_SIZE": "4",
        "VLLM_API_KEY": API_KEY,
        "DLLM_KV_AUTH_TOKEN": TOKEN,
    }
    return {**env, **changes}


def test_the_target_comes_from_the_engines_env() -> None:
    target = EndTarget.from_env(_env())
    assert (target.host, target.port, target.tp_size, target.timeout_s) == ("10.0.0.6", 50051, 4, 1.5)
    assert target.api_keys == (API_KEY,)
    assert target.auth == PeerAuth.from_token(TOKEN)
    bare = EndTarget.from_env({k: v for k, v in _env().items() if k.startswith("VLLM_KV_")})
    assert (bare.host, bare.tp_size, bare.api_keys, bare.auth) == ("127.0.0.1", 1, (), None)
    flagged = EndTarget.from_env(_env(DLLM_END_ROUTE_API_KEY="flag-key-1\nflag-key-2"))
    assert flagged.api_keys == ("flag-key-1", "flag-key-2")  # vLLM's --api-key wins over VLLM_API_KEY


@pytest.mark.parametrize("size", ["0", "-1", "two", "100000"])
def test_a_bad_tp_size_in_the_env_names_the_variable(size: str) -> None:
    with pytest.raises(EndRouteConfigError, match="DLLM_END_ROUTE_TP_SIZE"):
        EndTarget.from_env(_env(DLLM_END_ROUTE_TP_SIZE=size))


def test_vllm_builds_it_from_the_app_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's --middleware calls app.add_middleware(cls): the class takes the app only, env for the rest."""
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    route: Any = EndTransferRoute(FakeEngineApp())
    assert route.target.port == 50051


def test_the_path_dllm_serve_gives_vllm_names_this_route() -> None:
    """dllm-serve passes the middleware by name (it never imports the route): the name is this class."""
    assert f"{EndTransferRoute.__module__}.{EndTransferRoute.__qualname__}" == END_ROUTE_MIDDLEWARE
