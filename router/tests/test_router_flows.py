"""The three PD flows end to end over real HTTP on 127.0.0.1, against engine doubles."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from router_engine_double import expected_text
from router_harness import EngineFactory, RouterFactory, wait_event, wait_until

from dllm_contract.pd_params import DecodeParams, PrefillParams
from dllm_router.openai import CHAT, COMPLETIONS

pytestmark = pytest.mark.timeout(20)


def sse_payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def streamed_text(text: str, chat: bool = False) -> dict[int, str]:
    """Per choice index, the text a client assembles from an SSE answer (asserts one final [DONE])."""
    payloads = sse_payloads(text)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    out: dict[int, str] = {}
    for payload in payloads[:-1]:
        for choice in json.loads(payload)["choices"]:
            piece = choice["delta"].get("content", "") if chat else choice["text"]
            out[choice["index"]] = out.get(choice["index"], "") + piece
    return out


async def test_dllm_non_streaming_sends_protocol_params_to_both_pods(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d], decode_kv_port=50051, prefill_tp_size=2, decode_tp_size=4)
    async with await r.post(COMPLETIONS, {"model": "m", "prompt": "hello", "max_tokens": 5},
                            headers={"X-Request-Id": "req-42"}) as resp:  # fmt: skip
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "req-42"
        answer = await resp.json()
    assert answer["choices"][0]["text"] == expected_text("hello", 5)

    [pre], [dec] = p.generations, d.generations
    assert (pre.body["max_tokens"], pre.body["n"], pre.body["stream"]) == (1, 1, False)
    prefill = PrefillParams.model_validate(pre.kv)
    decode = DecodeParams.model_validate(dec.kv)
    assert prefill.transfer_id == decode.transfer_id
    assert prefill.transfer_id.startswith("req-42-0-")
    assert (prefill.decode_host, prefill.decode_kv_port, prefill.decode_tp_size) == ("127.0.0.1", 50051, 4)
    assert (decode.prefill_host, decode.prefill_tp_size) == ("127.0.0.1", 2)
    assert dec.body["max_tokens"] == 5
    assert pre.headers["X-Request-Id"] == dec.headers["X-Request-Id"] == "req-42"


async def test_dllm_streaming_completions_and_chat(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    body = {"prompt": "stream me", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with await r.post(COMPLETIONS, body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = await resp.text()
    assert streamed_text(text) == {0: expected_text("stream me", 4)}
    assert json.loads(sse_payloads(text)[-2])["usage"]["completion_tokens"] == 4
    assert "stream_options" not in p.generations[0].body
    assert p.generations[0].body["stream"] is False

    messages = [{"role": "user", "content": "hi"}]
    chat = {"messages": messages, "max_completion_tokens": 3, "stream": True}
    status, text = await r.text_of(CHAT, chat)
    assert status == 200
    assert streamed_text(text, chat=True) == {0: expected_text(messages, 3)}
    assert p.generations[-1].body["max_completion_tokens"] == 1


async def test_mooncake_flow_uses_bootstrap_address_and_engine_id(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: object
) -> None:
    p, d = await engines("p0"), await engines("d0")
    boot = await bootstrap(["prefill-engine-7"])  # type: ignore[operator]
    r = await start_router("mooncake", [p], [d], mooncake_bootstrap_port=boot.port)
    status, text = await r.text_of(COMPLETIONS, {"prompt": "moon", "max_tokens": 3})
    assert status == 200
    assert json.loads(text)["choices"][0]["text"] == expected_text("moon", 3)
    [pre], [dec] = p.generations, d.generations
    assert pre.kv == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": pre.kv["transfer_id"],
    }
    assert dec.kv == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": f"http://127.0.0.1:{boot.port}",
        "remote_engine_id": "prefill-engine-7",
        "transfer_id": pre.kv["transfer_id"],
    }


async def test_mooncake_prefill_without_bootstrap_is_not_ready(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: object
) -> None:
    p, d = await engines("p0"), await engines("d0")
    boot = await bootstrap(["e0"])  # type: ignore[operator]
    boot.up = False
    r = await start_router("mooncake", [p], [d], mooncake_bootstrap_port=boot.port)
    status, text = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert status == 503
    assert json.loads(text)["error"]["message"] == "no ready prefill pod"
    boot.up = True
    await r.router.check_health()
    status, _ = await r.text_of(COMPLETIONS, {"prompt": "x"})
    assert status == 200


async def test_nixl_forwards_what_prefill_returns(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0", nixl=True), await engines("d0")
    r = await start_router("nixl", [p], [d])
    status, text = await r.text_of(
        COMPLETIONS, {"prompt": "pull", "max_tokens": 6, "min_tokens": 2, "stream": True}
    )
    assert status == 200
    assert streamed_text(text) == {0: expected_text("pull", 6)}
    [pre], [dec] = p.generations, d.generations
    assert pre.kv["do_remote_decode"] is True
    assert pre.kv["remote_block_ids"] is None
    assert "min_tokens" not in pre.body
    assert dec.body["min_tokens"] == 2
    assert dec.kv["remote_engine_id"] == "p0-engine"
    assert dec.kv["remote_block_ids"] == [[1, 2, 3]]
    assert pre.answered_at is not None
    assert dec.at > pre.answered_at  # sequential: decode only after prefill answered


async def test_multi_prompt_is_split_per_prompt_and_merged_in_order(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    prompts = ["alpha", "beta", "gamma"]
    status, text = await r.text_of(COMPLETIONS, {"prompt": prompts, "max_tokens": 2, "n": 2})
    assert status == 200
    answer = json.loads(text)
    got = {c["index"]: c["text"] for c in answer["choices"]}
    assert got == {i * 2 + c: expected_text(pr, 2, c) for i, pr in enumerate(prompts) for c in range(2)}
    assert answer["usage"]["completion_tokens"] == 3 * 2 * 2
    assert "kv_transfer_params" not in answer
    assert sorted(s.body["prompt"] for s in p.generations) == sorted(prompts)
    ids = {s.kv["transfer_id"] for s in p.generations}
    assert ids == {s.kv["transfer_id"] for s in d.generations}
    assert len(ids) == 3

    body = {
        "prompt": [[1, 2], [3, 4]],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, text = await r.text_of(COMPLETIONS, body)
    assert streamed_text(text) == {0: expected_text([1, 2], 3), 1: expected_text([3, 4], 3)}
    usage = [json.loads(x)["usage"] for x in sse_payloads(text)[:-1] if not json.loads(x)["choices"]]
    assert usage == [{"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}]


async def test_token_id_prompt_is_one_prompt(engines: EngineFactory, start_router: RouterFactory) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    status, _ = await r.text_of(COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 200
    assert [s.body["prompt"] for s in d.generations] == [[5, 6, 7]]


@pytest.mark.parametrize("flow", ["dllm", "nixl"])
@pytest.mark.parametrize("stream", [False, True])
async def test_eos_at_prefill_is_answered_without_decode(
    engines: EngineFactory, start_router: RouterFactory, flow: str, stream: bool
) -> None:
    p, d = await engines("p0", nixl=flow == "nixl"), await engines("d0")
    p.eos_at_prefill = True
    d.hold = asyncio.Event()  # like a decode engine waiting for KV that an EOS prefill never sends
    r = await start_router(flow, [p], [d])
    status, text = await r.text_of(COMPLETIONS, {"prompt": "short", "max_tokens": 9, "stream": stream})
    assert status == 200
    first_token = expected_text("short", 1)
    if stream:
        assert streamed_text(text) == {0: first_token}
    else:
        answer = json.loads(text)
        assert answer["choices"][0]["text"] == first_token
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert "kv_transfer_params" not in answer
    if flow == "nixl":
        assert d.generations == []
    else:  # concurrent flow: the decode request was sent, then cancelled
        await wait_event(d.cancelled_event, "decode request cancelled")
    assert r.router.decode.endpoints[("127.0.0.1", d.port)].inflight == 0


async def test_max_tokens_one_goes_to_prefill_alone(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    body = {"prompt": "one", "max_tokens": 1, "stream": True}
    status, text = await r.text_of(COMPLETIONS, body)
    assert status == 200
    assert streamed_text(text) == {0: expected_text("one", 1)}
    [seen] = p.generations
    assert seen.body == body  # forwarded as the client sent it: no KV transfer
    assert d.generations == []


async def test_request_id_is_made_when_absent_and_models_are_relayed(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    async with await r.post(COMPLETIONS, {"prompt": "id"}) as resp:
        rid = resp.headers["X-Request-Id"]
    assert len(rid) >= 16
    assert p.generations[0].headers["X-Request-Id"] == rid
    async with r.client.get(r.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "fake-model"


async def test_prompt_over_aiohttp_default_body_limit(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d])
    prompt = "x" * (3 * 1024 * 1024)
    status, text = await r.text_of(COMPLETIONS, {"prompt": prompt, "max_tokens": 2})
    assert status == 200
    assert json.loads(text)["choices"][0]["text"] == expected_text(prompt, 2)


@pytest.mark.parametrize("flow", ["dllm", "nixl"])
async def test_request_id_appears_in_the_logs(
    engines: EngineFactory, start_router: RouterFactory, caplog: pytest.LogCaptureFixture, flow: str
) -> None:
    p, d = await engines("p0", nixl=flow == "nixl"), await engines("d0")
    r = await start_router(flow, [p], [d])
    caplog.set_level(logging.INFO, logger="dllm_router")
    async with await r.post(COMPLETIONS, {"prompt": "x"}, headers={"X-Request-Id": "trace-ok"}) as resp:
        assert resp.status == 200
    access = f"trace-ok /v1/completions 200 prefill=127.0.0.1:{p.port} decode=127.0.0.1:{d.port} "
    await wait_until(lambda: any(m.startswith(access) for m in caplog.messages), "the access line")
    d.fail_status = 400
    async with await r.post(COMPLETIONS, {"prompt": "x"}, headers={"X-Request-Id": "trace-bad"}) as resp:
        assert resp.status == 400
    assert f"trace-bad decode_error: decode pod 127.0.0.1:{d.port} answered 400" in caplog.messages


@pytest.mark.parametrize("flow", ["dllm", "mooncake", "nixl"])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_every_flow_route_and_mode_answers_in_full(
    engines: EngineFactory,
    start_router: RouterFactory,
    bootstrap: object,
    flow: str,
    route: str,
    stream: bool,
) -> None:
    p, d = await engines("p0", nixl=flow == "nixl"), await engines("d0")
    boot = await bootstrap(["e0"])  # type: ignore[operator]
    r = await start_router(flow, [p], [d], mooncake_bootstrap_port=boot.port)
    chat = route == CHAT
    prompt: object = [{"role": "user", "content": "hey"}] if chat else "hey"
    body = {("messages" if chat else "prompt"): prompt, "max_tokens": 4, "stream": stream}
    status, text = await r.text_of(route, body)
    assert status == 200
    if stream:
        assert streamed_text(text, chat=chat) == {0: expected_text(prompt, 4)}
    else:
        choice = json.loads(text)["choices"][0]
        assert (choice["message"]["content"] if chat else choice["text"]) == expected_text(prompt, 4)
    [pre], [dec] = p.generations, d.generations
    assert pre.is_prefill
    assert dec.kv.get("do_remote_prefill") is True
