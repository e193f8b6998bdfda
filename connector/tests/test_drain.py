"""The preStop drain waits until the engine stays idle, read from a real HTTP /metrics endpoint (M4)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

import pytest

from dllm_connector.drain import drain, finished, in_flight

pytestmark = pytest.mark.timeout(60)

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} %d
vllm:num_requests_waiting{engine="0",model_name="m"} %d
vllm:num_requests_swapped{engine="0",model_name="m"} 7
"""
SENDS = 'vllm:dllm_kv_sends_in_flight{engine="0",model_name="m"} %d.0\n'
FINISHED = (
    'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} %d.0\n'
    'vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9\n'
    'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0\n'
)


def test_in_flight_sums_running_and_waiting_only() -> None:
    assert in_flight(METRICS % (2, 3)) == 5
    assert in_flight("") == 0


def test_kv_sends_in_flight_count_too() -> None:
    sends = 'vllm:dllm_kv_sends_in_flight{engine="0",model_name="m"} 4.0\n'
    assert in_flight(METRICS % (0, 0) + sends) == 4


def test_finished_sums_the_success_counter_only() -> None:
    assert finished(FINISHED % 4) == 5
    assert finished(METRICS % (1, 1)) == 0


class MetricsDouble:
    """A test double of vLLM's /metrics endpoint (a real HTTP server on port 0) that serves a script of
    in-flight counts, one per scrape, repeating the last; it records when each scrape came. With
    `sends`, the counts are a prefill's KV sends in flight while no request runs; with `done`, a script
    of finished-request totals beside zero gauges (requests that came and went between scrapes)."""

    def __init__(self, script: Sequence[int], *, sends: bool = False, done: Sequence[int] = ()) -> None:
        self.script = list(script)
        self.done = list(done)
        self.scrapes: list[float] = []
        double = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                scrape = len(double.scrapes)
                index = min(scrape, len(double.script) - 1)
                double.scrapes.append(time.monotonic())
                count = double.script[index]
                text = METRICS % (0, 0) + SENDS % count if sends else METRICS % (count, 0)
                if double.done:
                    text += FINISHED % double.done[min(scrape, len(double.done) - 1)]
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class StartEngine(Protocol):
    """The `engine` fixture: starts a MetricsDouble with the given script."""

    def __call__(
        self, script: Sequence[int], *, sends: bool = False, done: Sequence[int] = ()
    ) -> MetricsDouble: ...


@pytest.fixture
def engine() -> Iterator[StartEngine]:
    started: list[MetricsDouble] = []

    def start(script: Sequence[int], *, sends: bool = False, done: Sequence[int] = ()) -> MetricsDouble:
        double = MetricsDouble(script, sends=sends, done=done)
        started.append(double)
        return double

    yield start
    for double in started:
        double.server.shutdown()
        double.server.server_close()


def test_one_zero_between_busy_readings_does_not_end_the_drain(engine: StartEngine) -> None:
    metrics = engine([0, 2, 0, 0, 0])
    started = time.monotonic()
    assert drain(metrics.port, timeout=20, interval=0.02, settle=0.5, zeros=3)
    ended = time.monotonic()
    assert len(metrics.scrapes) >= 5  # not the first 0, and three zeros after the busy reading
    assert ended - metrics.scrapes[2] >= 0.5  # idle for the whole settle time since the last busy one
    assert ended - started < 10


def test_several_zeros_within_the_settle_time_are_not_enough(engine: StartEngine) -> None:
    metrics = engine([0])
    started = time.monotonic()
    assert drain(metrics.port, timeout=20, interval=0.01, settle=0.6, zeros=3)
    assert time.monotonic() - started >= 0.6
    assert len(metrics.scrapes) > 3  # many zeros came in before the settle time was up


def test_slow_readings_still_need_the_count_of_zeros(engine: StartEngine) -> None:
    metrics = engine([0])
    assert drain(metrics.port, timeout=20, interval=0.2, settle=0.01, zeros=4)
    assert len(metrics.scrapes) == 4


def test_a_busy_reading_inside_the_settle_time_starts_it_again(engine: StartEngine) -> None:
    metrics = engine([0, 0, 0, 3, 0])
    assert drain(metrics.port, timeout=20, interval=0.02, settle=0.4, zeros=3)
    assert time.monotonic() - metrics.scrapes[4] >= 0.4


def test_a_request_that_came_and_went_between_readings_starts_the_settle_time_again(
    engine: StartEngine,
) -> None:
    """Every gauge reads 0, but the finished count moved between the 3rd and 4th scrape: the engine was
    busy then, so the settle time runs from the 4th."""
    metrics = engine([0], done=[7, 7, 7, 8, 8])
    assert drain(metrics.port, timeout=20, interval=0.02, settle=0.4, zeros=3)
    assert time.monotonic() - metrics.scrapes[3] >= 0.4
    assert len(metrics.scrapes) >= 7  # the 4th counted as busy, then three idle ones after it


def test_a_prefill_drain_waits_while_kv_sends_are_in_flight(engine: StartEngine) -> None:
    metrics = engine([2, 1, 1, 0], sends=True)
    assert drain(metrics.port, timeout=20, interval=0.02, settle=0.2, zeros=2)
    assert len(metrics.scrapes) >= 5  # three readings with sends in flight, then two idle ones
    assert time.monotonic() - metrics.scrapes[3] >= 0.2


def test_drain_gives_up_at_the_timeout(engine: StartEngine) -> None:
    metrics = engine([5])
    started = time.monotonic()
    assert not drain(metrics.port, timeout=0.3, interval=0.01, settle=0.1)
    assert time.monotonic() - started < 5


def test_an_engine_that_goes_away_mid_drain_means_done(engine: StartEngine) -> None:
    metrics = engine([4])
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(drain(metrics.port, timeout=30, interval=0.02, settle=5))
    )
    thread.start()
    deadline = time.monotonic() + 10
    while len(metrics.scrapes) < 3 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    metrics.server.shutdown()
    metrics.server.server_close()
    thread.join(10)
    assert result == [True]


def test_drain_does_not_block_when_the_engine_is_gone() -> None:
    started = time.monotonic()
    assert drain(1, timeout=5)
    assert time.monotonic() - started < 4


def test_the_command_line_takes_the_settle_time(engine: StartEngine) -> None:
    metrics = engine([1, 0])
    command = [sys.executable, "-m", "dllm_connector.drain", "--port", str(metrics.port), "--timeout", "20"]
    options = ["--interval", "0.02", "--settle", "0.3", "--zeros", "2"]
    result = subprocess.run([*command, *options], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0
    assert result.stdout.strip() == "drained"
    assert metrics.scrapes[-1] - metrics.scrapes[1] >= 0.3
