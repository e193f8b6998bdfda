"""The preStop drain waits for in-flight requests on a real HTTP /metrics endpoint."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dllm_connector.drain import drain, in_flight

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} %d
vllm:num_requests_waiting{engine="0",model_name="m"} %d
vllm:num_requests_swapped{engine="0",model_name="m"} 7
"""


def test_in_flight_sums_running_and_waiting_only() -> None:
    assert in_flight(METRICS % (2, 3)) == 5
    assert in_flight("") == 0


class MetricsDouble:
    """A test double of vLLM's /metrics endpoint whose in-flight count the test controls."""

    def __init__(self) -> None:
        self.running = 1
        double = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (METRICS % (double.running, 0)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                double.requests += 1
                if double.requests >= 3:  # the third scrape sees the last request finish
                    double.running = 0

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]


@pytest.fixture
def engine() -> Iterator[MetricsDouble]:
    double = MetricsDouble()
    thread = threading.Thread(target=double.server.serve_forever, daemon=True)
    thread.start()
    yield double
    double.server.shutdown()


def test_drain_returns_once_the_engine_is_idle(engine: MetricsDouble) -> None:
    assert drain(engine.port, timeout=10, interval=0.01)
    assert engine.requests >= 3


def test_drain_gives_up_at_the_timeout(engine: MetricsDouble) -> None:
    engine.running = 5
    engine.requests = -(10**9)  # never reaches the point where it finishes
    assert not drain(engine.port, timeout=0.2, interval=0.01)


def test_drain_does_not_block_when_the_engine_is_gone() -> None:
    assert drain(1, timeout=5)
