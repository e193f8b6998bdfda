"""Pure request/response shaping and the flows' parameters (no I/O)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import msgspec
import pytest

from dllm_contract.pd_params import DecodeParams, PrefillParams
from dllm_router import flows
from dllm_router import openai as oa
from dllm_router.config import RouterConfig, Upstreams
from dllm_router.engine_answer import EngineAnswer

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("prompt", "parts"),
    [
        ("one", ["one"]),
        (["one"], [["one"]]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [1]], [["a", [1]]]),  # mixed: left to the engine to judge
    ],
)
def test_split_prompts(prompt: object, parts: list[object]) -> None:
    bodies = oa.split_prompts(oa.COMPLETIONS, {"prompt": prompt, "max_tokens": 3})
    assert [b["prompt"] for b in bodies] == parts
    assert all(b["max_tokens"] == 3 for b in bodies)


def test_chat_is_never_split() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "prompt": ["a", "b"]}
    assert oa.split_prompts(oa.CHAT, body) == [body]


def test_prefill_request_is_one_token_one_choice_unstreamed() -> None:
    body = {
        "prompt": "p", "max_tokens": 50, "max_completion_tokens": 50, "n": 3, "stream": True,
        "stream_options": {"include_usage": True}, "min_tokens": 4, "temperature": 0.5,
    }  # fmt: skip
    out = oa.prefill_request(body, {"k": 1})
    assert out == {
        "prompt": "p", "max_tokens": 1, "max_completion_tokens": 1, "n": 1, "stream": False,
        "temperature": 0.5, "kv_transfer_params": {"k": 1},
    }  # fmt: skip
    assert body["max_tokens"] == 50  # the client's body is not changed


def raw(answer: Mapping[str, object]) -> EngineAnswer:
    """An engine's answer as the router holds it: its bytes, by raw top-level field."""
    return EngineAnswer.parse(json.dumps(answer).encode())


def test_finished_at_prefill_only_on_stop_with_one_choice() -> None:
    stop = raw({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]})
    length = raw({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})
    assert oa.finished_at_prefill(stop, {"prompt": "p"})
    assert not oa.finished_at_prefill(length, {"prompt": "p"})
    assert not oa.finished_at_prefill(stop, {"prompt": "p", "n": 2})
    for odd in ({"choices": "?"}, {"choices": ["stop"]}, {}, {"choices": [{"finish_reason": "stop"}] * 2}):
        assert not oa.finished_at_prefill(raw(odd), {})
    assert oa.asks_one_token({"max_tokens": 1})
    assert oa.asks_one_token({"max_tokens": 9, "max_completion_tokens": 1})
    assert not oa.asks_one_token({"prompt": "p"})


def test_finished_answer_as_stream_events() -> None:
    answer = {
        "id": "c1", "created": 5, "model": "m", "kv_transfer_params": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }  # fmt: skip
    events = oa.answer_as_events(oa.CHAT, raw(answer), {"stream_options": {"include_usage": True}})
    first, usage = (json.loads(e) for e in events)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop",
            "delta": {"role": "assistant", "content": "hi"},
        }
    ]
    assert usage["usage"]["total_tokens"] == 3
    assert oa.sse([b"{}"]) == b"data: {}\n\ndata: [DONE]\n\n"


def test_sse_splitter_handles_any_chunk_boundary() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(stream)):
        splitter = oa.SseSplitter()
        got = [p for i in range(0, len(stream), size) for p in splitter.feed(stream[i : i + size])]
        assert got == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_merge_answers_renumbers_choices_and_sums_usage() -> None:
    def answer(text: str) -> dict[str, object]:
        return {
            "id": "x", "kv_transfer_params": None,
            "choices": [{"index": 0, "text": text + "0"}, {"index": 1, "text": text + "1"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }  # fmt: skip

    merged = json.loads(oa.merge_answers([raw(answer("a")), raw(answer("b"))], n=2))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"),
        (1, "a1"),
        (2, "b0"),
        (3, "b1"),
    ]
    assert merged["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert "kv_transfer_params" not in merged


def test_merge_answers_splices_the_engines_bytes() -> None:
    """NEW-1: a merged answer is encoded from raw pieces: what the router does not rewrite keeps the
    engine's spelling (no parsed copy of logprobs); the first answer's fields keep their order, each
    choice's index is rewritten in its place (appended when absent), a non-object choice is kept."""
    first = (
        b'{"id": "x", "kv_transfer_params": {"k": 1}, "choices": [{"text": "a", "index": 0, '
        b'"prompt_logprobs": [null, {"7": {"logprob": -1.50, "rank": 1}}]}], "usage": {"prompt_tokens": 1,'
        b' "prompt_tokens_details": null}, "system_fingerprint": "\\u00e9"}'
    )
    second = b'{"id": "y", "choices": [{"text": "b"}, 3], "usage": {"prompt_tokens": 2}}'
    merged = oa.merge_answers([EngineAnswer.parse(first), EngineAnswer.parse(second)], n=1)
    assert merged == (
        b'{"id":"x","choices":[{"text":"a","index":0,"prompt_logprobs":[null, {"7": {"logprob": -1.50, '
        b'"rank": 1}}]},{"text":"b","index":1},3],"usage":{"prompt_tokens":3},"system_fingerprint":"\\u00e9"}'
    )


def test_engine_answer_decodes_only_what_is_read() -> None:
    answer = EngineAnswer.parse(b'{"kv_transfer_params": {"k": 1}, "choices": [{"index": 2, "x": [1]}]}')
    assert answer.value("kv_transfer_params") == {"k": 1}
    assert answer.value("usage", "none") == "none"
    assert answer.public() == b'{"choices":[{"index": 2, "x": [1]}]}'
    with pytest.raises(msgspec.ValidationError, match="Expected `object`"):
        EngineAnswer.parse(b"[1]")
    for bad in (b"{", b""):
        with pytest.raises(msgspec.DecodeError, match=r"truncated|malformed"):
            EngineAnswer.parse(bad)


def test_error_body_is_openai_shaped() -> None:
    assert json.loads(oa.error_body("no ready decode pod", "no_decode", 503)) == {
        "error": {"message": "no ready decode pod", "type": "no_decode", "param": None, "code": 503}
    }


CONFIG = RouterConfig(
    flow="dllm", prefill=Upstreams(urls=("http://p:1",)), decode=Upstreams(urls=("http://d:1",)),
    decode_kv_port=50100, prefill_tp_size=2, decode_tp_size=8,
)  # fmt: skip


def test_dllm_plan_speaks_the_connector_protocol() -> None:
    plan = flows.dllm_plan(CONFIG, "rid", 3, "10.0.0.1", "10.0.0.2")
    prefill = PrefillParams.model_validate(plan.prefill_kv)
    decode = DecodeParams.model_validate(plan.decode_kv)
    assert prefill.transfer_id == decode.transfer_id == plan.transfer_id
    assert prefill.transfer_id.startswith("rid-3-")
    assert (prefill.decode_host, prefill.decode_kv_port, prefill.decode_tp_size) == ("10.0.0.2", 50100, 8)
    assert prefill.decode_engine_id is None
    assert (decode.prefill_host, decode.prefill_tp_size) == ("10.0.0.1", 2)
    assert plan.concurrent
    other = flows.dllm_plan(CONFIG, "rid", 3, "10.0.0.1", "10.0.0.2")
    assert other.transfer_id != plan.transfer_id  # unique even when a client reuses its request id


def test_cached_dllm_plans_are_the_models_dumps() -> None:
    plans = flows.DllmPlans(CONFIG)
    for prefill_host, decode_host in [
        ("10.0.0.1", "10.0.0.2"),
        ("10.0.0.3", "10.0.0.2"),
        ("10.0.0.1", "10.0.0.2"),
    ]:
        plan = plans.plan("rid", 3, prefill_host, decode_host)
        assert plan.transfer_id is not None
        assert plan.transfer_id.startswith("rid-3-")
        same = flows.dllm_plan(CONFIG, "rid", 3, prefill_host, decode_host, plan.transfer_id)
        assert plan == same
        assert list(plan.prefill_kv) == list(same.prefill_kv)  # the same keys in the same order
        assert plan.decode_kv is not None
        assert same.decode_kv is not None
        assert list(plan.decode_kv) == list(same.decode_kv)
    assert plans.plan("rid", 3, "10.0.0.1", "10.0.0.2").transfer_id != plan.transfer_id


def test_cached_dllm_plans_refuse_what_the_protocol_refuses() -> None:
    with pytest.raises(ValueError, match="transfer_id"):
        flows.DllmPlans(CONFIG).plan("r" * 300, 0, "10.0.0.1", "10.0.0.2")


def test_mooncake_plan_and_data_parallel_header() -> None:
    plan = flows.mooncake_plan("rid", 0, "http://10.0.0.1:8998", "eng-1", dp_rank=1, dp_size=2)
    tid = plan.transfer_id
    assert tid is not None
    assert re.fullmatch(r"xfer-rid-0-[0-9a-f]{12}", tid), tid
    assert plan.prefill_kv == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    assert plan.decode_kv == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": "http://10.0.0.1:8998",
        "remote_engine_id": "eng-1", "transfer_id": tid,
    }  # fmt: skip
    assert plan.prefill_headers == b"X-data-parallel-rank: 1\r\n"
    assert flows.mooncake_plan("r", 0, "a", "e", 0, 1).prefill_headers == b""
    assert flows.bootstrap_url("fd00::1", 8998) == "http://[fd00::1]:8998"


def test_mooncake_transfer_ids_are_fresh_for_a_reused_request_id() -> None:
    """H9: one X-Request-Id twice never gives one transfer (a decode could load the other's KV)."""
    ids = {flows.mooncake_plan("same", 0, "a", "e", 0, 1).transfer_id for _ in range(100)}
    assert len(ids) == 100


def test_nixl_plan_lets_prefill_fill_in_the_remote_fields() -> None:
    plan = flows.nixl_plan()
    assert plan.decode_kv is None
    assert not plan.concurrent
    assert plan.prefill_kv["do_remote_decode"] is True
    assert plan.prefill_kv["remote_block_ids"] is None


def test_parse_bootstrap_query() -> None:
    answer = {"1": {"engine_id": "b", "worker_addr": {}}, "0": {"engine_id": "a", "worker_addr": {}}}
    assert flows.parse_bootstrap_query(answer) == ("a", "b")


@pytest.mark.parametrize(
    "answer",
    [{}, [], {"0": {}}, {"x": {"engine_id": "a"}}, {"1": {"engine_id": "a"}}, {"0": {"engine_id": 7}}],
)
def test_parse_bootstrap_query_refuses_unusable_answers(answer: object) -> None:
    with pytest.raises(flows.BootstrapError):
        flows.parse_bootstrap_query(answer)


def test_decode_payload_splices_params_into_the_client_bytes() -> None:
    raw = b' {"prompt": "p\\u00e9", "max_tokens": 9}\n'
    body = json.loads(raw)
    out = oa.decode_payload(body, raw, {"k": [1]})
    assert out == b'{"prompt": "p\\u00e9", "max_tokens": 9,"kv_transfer_params":{"k":[1]}}'
    assert json.loads(out) == {**body, "kv_transfer_params": {"k": [1]}}
    assert oa.decode_payload(body, raw, None) is raw


def test_decode_payload_re_encodes_when_splicing_would_be_wrong() -> None:
    theirs = {"prompt": "p", "kv_transfer_params": {"mine": 1}}
    out = oa.decode_payload(theirs, json.dumps(theirs).encode(), {"k": 2})
    assert json.loads(out) == {"prompt": "p", "kv_transfer_params": {"k": 2}}  # one key, the router's
    assert out.count(b"kv_transfer_params") == 1
    utf16 = json.dumps({"prompt": "p"}).encode("utf-16")
    assert json.loads(oa.decode_payload({"prompt": "p"}, utf16, {"k": 3})) == {
        "prompt": "p",
        "kv_transfer_params": {"k": 3},
    }
    assert json.loads(oa.decode_payload({"prompt": "q"}, None, {"k": 4}))["kv_transfer_params"] == {"k": 4}


@pytest.mark.parametrize(
    "data", [b'{"a":1,"b":[1,2]}', b' {"a": 1}\n', b"[1,2]", b'"x"', '{"é":"ü"}'.encode()]
)
def test_loads_reads_what_json_loads_reads(data: bytes) -> None:
    assert oa.loads(data) == json.loads(data)


@pytest.mark.parametrize(
    "data", [b"", b"not json", b'{"a":1}x', b'{"a":', b"\xff\xfe{", b"NaN", b"[Infinity]"]
)
def test_loads_raises_a_value_error_for_what_is_not_plain_json(data: bytes) -> None:
    """Callers turn a ValueError into a 400; NaN and Infinity, which json.loads takes, are refused too."""
    with pytest.raises(ValueError):  # noqa: PT011  # the type is the contract: callers catch ValueError
        oa.loads(data)
