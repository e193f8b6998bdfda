"""How an upstream call fails (a timeout raises TimeoutError)."""

from __future__ import annotations


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    pass


class Disconnected(UpstreamError):
    def __init__(self, message: str, before_head: bool) -> None:
        super().__init__(message)
        self.before_head = before_head


class BadResponse(UpstreamError):
    pass
