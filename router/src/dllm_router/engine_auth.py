"""Which credentials go to the engines (L5).

With the engines' own key configured (DLLM_ENGINE_API_KEY), every engine call and probe carries it
instead of the client's Authorization; without one, the client's Authorization is passed on, and
probes carry none. The key is kept as header bytes and never logged (RouterConfig's repr leaves it out).
"""

from __future__ import annotations

from dllm_router.http_messages import Request

_JSON_LINE = b"Content-Type: application/json\r\n"


class EngineAuth:
    def __init__(self, key: str | None) -> None:
        self._key_line = b"Authorization: Bearer " + key.encode("ascii") + b"\r\n" if key else None
        self.probe_headers = {"Authorization": f"Bearer {key}"} if key else {}

    def call_headers(self, request: Request) -> bytes:
        """The header lines both engine calls carry besides X-Request-Id: the engines' key when one is
        configured (DLLM_ENGINE_API_KEY, instead of the client's), else the client's Authorization."""
        if self._key_line is not None:
            return _JSON_LINE + self._key_line
        auth = request.header(b"authorization")
        if auth is None:
            return _JSON_LINE
        return _JSON_LINE + b"Authorization: " + auth + b"\r\n"  # the parser refuses line breaks in values

    def models_headers(self, request: Request) -> dict[str, str]:
        """/v1/models is asked of a decode pod with the engines' key, else with the client's own."""
        headers = dict(self.probe_headers)
        auth = request.header(b"authorization")
        if not headers and auth is not None:
            headers["Authorization"] = auth.decode("latin-1")
        return headers
