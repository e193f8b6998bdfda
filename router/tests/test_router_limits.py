"""What one request may cost the router (H2, L1, L7), over real HTTP against engine doubles and as pure
functions: bodies too costly to parse, prompt and `n` caps, per-request upstream concurrency, request
ids, and the upstream stream parsers' linear time. Every refusal is a 400 with a message a client can
act on, nothing reaches an engine, and no ERROR line or traceback is logged."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import tracemalloc
from collections.abc import Callable

import pytest
from router_engine_double import FakeVllmEngine
from router_harness import EngineFactory, RouterFactory, RunningRouter, wait_until

from dllm_router import jsonshape
from dllm_router import openai as oa
from dllm_router.jsonshape import TooComplex, check_shape
from dllm_router.openai import COMPLETIONS
from dllm_router.upstream import chunk_size

pytestmark = pytest.mark.timeout(30)


def best_time(job: Callable[[], object], runs: int = 3) -> float:
    """The fastest of a few runs: the least disturbed by the other jobs on these two shared cores."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        job()
        times.append(time.perf_counter() - started)
    return min(times)


# ---- the shape check, as a function ----


def test_five_mib_of_one_element_lists_is_refused_quickly_and_small() -> None:
    """The review's H2 body: 5 MiB of `[1],` is 1.3M lists (~120 MB and seconds in json.loads)."""
    raw = b'{"prompt":[' + b"[1]," * (5 * 1024 * 1024 // 4) + b"[1]]}"
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(TooComplex, match="more than 20000 arrays and objects"):
            check_shape(raw)
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 0.5  # ~20 ms alone; generous for two shared cores
    assert peak < 3 * len(raw)  # bytes copies only, no objects per element


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt":[' + b'"ab",' * 300_000 + b'"ab"]}', "more than 200000 strings"),
        (b'{"prompt":[' + b"1," * 1_100_000 + b"1]}", "more than 1000000 values"),
        (b'{"prompt":' + b"[" * 65 + b"]" * 65 + b"}", "nests deeper than 64 levels"),
        (b"[" * 200_000, "more than 20000 arrays and objects"),
    ],
)
def test_costly_shapes_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(TooComplex, match=message):
        check_shape(raw)


def test_brackets_quotes_and_commas_inside_strings_do_not_count() -> None:
    text = 'code: f(a[0], {"k": [1, 2]}) \\ "quoted" ' * 100_000  # 4 MB of brackets in one string
    raw = json.dumps({"prompt": text, "max_tokens": 3}).encode()
    check_shape(raw)  # exact: only what lies outside strings is counted
    assert oa.parse_request(raw, COMPLETIONS)["prompt"] == text
    deep_ok = b'{"a":' + b"[" * 63 + b"]" * 63 + b"}"
    check_shape(deep_ok)


def test_a_full_size_body_within_the_limits_checks_in_milliseconds() -> None:
    raw = json.dumps({"prompt": list(range(100_000, 1_100_000)), "max_tokens": 1}).encode()  # 8 MB
    assert best_time(lambda: check_shape(raw)) < 0.5


# ---- refusals over HTTP ----


def assert_clean_400(status: int, text: str, message: str, caplog: pytest.LogCaptureFixture) -> None:
    assert status == 400, text
    error = json.loads(text)["error"]
    assert (error["type"], error["code"]) == ("bad_request", 400)
    assert message in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def refused_before_any_engine(
    engines: EngineFactory,
    start_router: RouterFactory,
    caplog: pytest.LogCaptureFixture,
    body: dict[str, object],
    message: str,
) -> tuple[RunningRouter, FakeVllmEngine]:
    """A router over one engine pair answers `body` a clean 400 naming `message`, and neither engine
    was called; the router and its prefill engine, for what the test asks next."""
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    route = oa.CHAT if "messages" in body else COMPLETIONS
    status, text = await r.text_of(route, body)
    assert_clean_400(status, text, message, caplog)
    assert p.generations == d.generations == []
    return r, p


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "p", "n": 100_000}, "'n' is 100000; this router allows at most 16 (--max-n)"),
        ({"prompt": "p", "best_of": 17}, "'best_of' is 17; this router allows at most 16 (--max-n)"),
        ({"messages": [], "n": 17}, "at most 16 (--max-n)"),
        ({"prompt": ["p"] * 65}, "too many prompts: 65; this router allows at most 64 (--max-prompts)"),
        ({"prompt": [[1]] * 65}, "too many prompts: 65"),
        # M2: what decode would refuse after prefill ran (prefill sees max_tokens=1, no min_tokens)
        ({"prompt": "p", "min_tokens": 5, "max_tokens": 2}, "'min_tokens' (5) is above the maximum"),
        ({"messages": [], "min_tokens": 3, "max_completion_tokens": 1}, "'min_tokens' (3) is above"),
        ({"prompt": "p", "max_tokens": 0}, "'max_tokens' must be an integer of at least 1"),
        ({"prompt": "p", "min_tokens": -1}, "'min_tokens' must be an integer of at least 0"),
    ],
)
async def test_fan_out_over_the_caps_is_400(
    engines: EngineFactory,
    start_router: RouterFactory,
    caplog: pytest.LogCaptureFixture,
    body: dict[str, object],
    message: str,
) -> None:
    r, p = await refused_before_any_engine(engines, start_router, caplog, body, message)
    status, text = await r.text_of(COMPLETIONS, {"prompt": ["p"] * 64, "max_tokens": 1, "n": 16})
    assert status == 200, text  # at the caps
    assert len(p.generations) == 64


ASK_BEYOND = [
    # the review's NEW-1 request: 64 prompts, each answered with 21 logprobs per prompt token
    (
        {"prompt": ["p"] * 64, "max_tokens": 1, "prompt_logprobs": 20},
        "'prompt_logprobs' (20) over 64 prompts",
    ),
    ({"prompt": "p", "max_tokens": 2, "prompt_logprobs": -1}, "'prompt_logprobs' must be a whole number"),
    ({"prompt": "p", "max_tokens": 2, "prompt_logprobs": 21}, "'prompt_logprobs' is 21; this router allows"),
    ({"prompt": "p", "max_tokens": 2, "logprobs": 50}, "'logprobs' is 50; this router allows at most 20"),
    (
        {"prompt": ["p"] * 2, "max_tokens": 2, "logprobs": 20, "n": 16},
        "logprobs x n x prompts is 20 x 16 x 2",
    ),
    (
        {"messages": [{"role": "user", "content": "m"}], "logprobs": True, "top_logprobs": 30},
        "'logprobs' is 30",
    ),
    ({"prompt": ["p"] * 4, "max_tokens": 2, "echo": True, "n": 8}, "n x prompts is 8 x 4"),
]


@pytest.mark.parametrize(("body", "message"), ASK_BEYOND, ids=range(len(ASK_BEYOND)))
async def test_answers_asked_beyond_the_bounds_are_400_before_any_engine_call(
    engines: EngineFactory,
    start_router: RouterFactory,
    caplog: pytest.LogCaptureFixture,
    body: dict[str, object],
    message: str,
) -> None:
    """NEW-1: logprobs, prompt logprobs and echo grow an answer far past its request: refused by name."""
    r, _ = await refused_before_any_engine(engines, start_router, caplog, body, message)
    at_the_bounds = [
        {"prompt": "p", "max_tokens": 2, "prompt_logprobs": 20, "logprobs": 20, "n": 16},
        {"prompt": ["p"] * 16, "max_tokens": 2, "logprobs": 20, "echo": True},
        {"prompt": ["p"] * 21, "max_tokens": 2, "prompt_logprobs": 0},
    ]
    for fine in at_the_bounds:
        status, text = await r.text_of(COMPLETIONS, fine)
        assert status == 200, text


async def test_five_mib_body_of_lists_is_400_fast_and_reaches_no_engine(
    engines: EngineFactory, start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    raw = b'{"prompt":[' + b"[1]," * (5 * 1024 * 1024 // 4) + b"[1]]}"
    started = time.perf_counter()
    async with r.client.post(r.url + COMPLETIONS, data=raw) as answer:
        text = await answer.text()
    assert time.perf_counter() - started < 2.0  # the review's 100 ms, with room for shared cores
    assert_clean_400(answer.status, text, "more than 20000 arrays and objects", caplog)
    assert p.generations == d.generations == []


@pytest.mark.parametrize(
    ("raw", "headers", "message"),
    [
        (b'{"prompt":"p"}', {"X-Request-Id": "r" * 300}, "X-Request-Id must be 1-128 visible ASCII"),
        (b'{"prompt":"p"}', {"X-Request-Id": "has space"}, "X-Request-Id must be"),
        (b'{"prompt":"p","max_tokens":' + b"9" * 4301 + b"}", {}, "request body is not JSON"),
        (b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "more than 20000 arrays"),
        (b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", {}, "nests deeper than 64 levels"),
        (b'{"prompt":"\xff"}', {}, "request body is not JSON"),
    ],
)
@pytest.mark.parametrize("flow", ["dllm", "mooncake"])  # the fast path and the coroutine path
async def test_l1_bodies_and_ids_are_400_without_a_traceback(
    engines: EngineFactory,
    start_router: RouterFactory,
    bootstrap: object,
    caplog: pytest.LogCaptureFixture,
    raw: bytes,
    headers: dict[str, str],
    message: str,
    flow: str,
) -> None:
    caplog.set_level(logging.INFO)
    boot = await bootstrap(["e0"])  # type: ignore[operator]
    p, d = await engines("p0"), await engines("d0")
    r = await start_router(flow, [p], [d], mooncake_bootstrap_port=boot.port)
    async with r.client.post(r.url + COMPLETIONS, data=raw, headers=headers) as answer:
        text = await answer.text()
    assert_clean_400(answer.status, text, message, caplog)
    assert p.generations == d.generations == []
    assert r.router.metrics.requests[(COMPLETIONS, 400)] == 1


async def test_a_malformed_request_id_on_v1_models_is_400_without_a_traceback(
    engines: EngineFactory, start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """NEW-8: /v1/models read the id outside its error handling, so this was a 500 and a traceback."""
    caplog.set_level(logging.INFO)
    d = await engines("d0")
    r = await start_router("dllm", [await engines("p0")], [d])
    async with r.client.get(r.url + "/v1/models", headers={"X-Request-Id": "a" * 200}) as answer:
        text = await answer.text()
    assert_clean_400(answer.status, text, "X-Request-Id must be", caplog)
    assert "/v1/models" not in [seen.path for seen in d.seen]


def untempered(output: int) -> int:
    """The Mersenne Twister state word behind one 32-bit output (its tempering undone)."""
    y = output ^ (output >> 18)
    y ^= (y << 15) & 0xEFC60000
    x = y
    for _ in range(5):
        x = y ^ ((x << 7) & 0x9D2C5680)
    y = x
    for _ in range(3):
        x = y ^ (x >> 11)
    return x & 0xFFFFFFFF


async def test_request_ids_the_router_makes_cannot_be_predicted_from_earlier_ones(
    start_router: RouterFactory, engines: EngineFactory
) -> None:
    """NEW-9: 156 ids of 128 bits are the 624 words of Mersenne Twister's state, so with `random` a
    client that saw them predicted every later id (another client's, and the engines' request id)."""
    r = await start_router("dllm", [await engines("p0")], [await engines("d0")])

    async def an_id() -> int:  # a refusal before any engine, with the id the router made
        async with r.client.post(r.url + COMPLETIONS, data=b"not json") as answer:
            assert answer.status == 400
            return int(answer.headers["X-Request-Id"], 16)

    seen = [await an_id() for _ in range(156)]
    words = [(rid >> (32 * i)) & 0xFFFFFFFF for rid in seen for i in range(4)]
    replica = random.Random()
    replica.setstate((3, (*(untempered(w) for w in words), 624), None))
    predicted = {replica.getrandbits(128) for _ in range(8)}
    later = {await an_id() for _ in range(4)}
    assert not later & predicted
    assert len(set(seen) | later) == 160


async def test_one_requests_prompts_run_at_most_16_pairs_at_once(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    p.hold = asyncio.Event()
    r = await start_router("dllm", [p], [d])
    ask = asyncio.ensure_future(
        r.text_of(COMPLETIONS, {"prompt": [f"q{i}" for i in range(40)], "max_tokens": 2})
    )
    await wait_until(lambda: p.active == 16, "16 prompts at prefill")
    p.hold.set()
    status, text = await ask
    assert status == 200
    assert len(json.loads(text)["choices"]) == 40
    assert p.max_active <= 16
    assert d.max_active <= 16


# ---- upstream parsing (L7) ----


@pytest.mark.parametrize("line", [b"-1", b"0x10", b"1_0", b" 10", b"10 ", b"", b"+a", b"1" * 16, b"\xd9\xa1"])
def test_chunk_sizes_are_strict_hex(line: bytes) -> None:
    assert chunk_size(line) is None


def test_chunk_size_reads_hex_and_ignores_extensions() -> None:
    assert (chunk_size(b"1f"), chunk_size(b"A;name=v"), chunk_size(b"0")) == (31, 10, 0)


def test_sse_splitter_is_linear_in_the_chunk() -> None:
    def split(events: int) -> Callable[[], object]:
        chunk = b'data: {"choices":[{"text":"x"}]}\n\n' * events

        def run() -> object:
            return oa.SseSplitter().feed(chunk)

        return run

    assert len(oa.SseSplitter().feed(b'data: {"a":1}\n\n' * 10)) == 10
    small, large = best_time(split(20_000)), best_time(split(200_000))
    assert large < 30 * small  # linear: ~10x; the old copy of the rest per event: ~100x


def test_sse_event_without_an_end_is_bounded() -> None:
    splitter = oa.SseSplitter()
    piece = b"data: " + b"x" * (1024 * 1024)
    for _ in range(oa.MAX_SSE_EVENT // len(piece)):
        splitter.feed(piece)
    with pytest.raises(ValueError, match="SSE event is over"):
        splitter.feed(piece)


def test_limits_are_what_the_docs_say() -> None:
    assert (jsonshape.MAX_STRINGS, jsonshape.MAX_CONTAINERS, jsonshape.MAX_VALUES, jsonshape.MAX_DEPTH) == (
        200_000,
        20_000,
        1_000_000,
        64,
    )
