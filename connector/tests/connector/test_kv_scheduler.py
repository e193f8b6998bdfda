"""The scheduler-side rules of the dllm connector (scheduler.SchedulerState): pure, no vLLM or I/O.

vLLM recomputes a prompt's last token after a full external hit; for a one-token prompt that leaves
0 computed tokens, and vLLM asks the connector again as if the request were new.
"""

from __future__ import annotations

from typing import Any

import pytest

from dllm_connector.scheduler import SchedulerState
from dllm_contract.kvconfig import (
    Connector,
    ConnectorExtraConfig,
    KVTransferSettings,
    Role,
    kv_transfer_config,
)
from dllm_contract.pd_params import DecodeParams, PrefillParams

pytestmark = pytest.mark.timeout(10)

BLOCK = 16
DECODE_KV_PORT = 15000


def state(peer_tp_size: int | None = None) -> SchedulerState:
    settings = KVTransferSettings(
        connector=Connector.MOONCAKE,
        role=Role.BOTH,
        listen_port=DECODE_KV_PORT,
        buffer_size_gb=0.01,
        peer_tp_size=peer_tp_size,
    )
    extra = kv_transfer_config(settings, "engine-a")["kv_connector_extra_config"]
    return SchedulerState(
        ConnectorExtraConfig.model_validate(extra), block_size=BLOCK, kv_port=DECODE_KV_PORT
    )


def decode_params(transfer_id: str) -> dict[str, Any]:
    return DecodeParams(transfer_id=transfer_id).model_dump()


def prefill_params(transfer_id: str) -> dict[str, Any]:
    return PrefillParams(
        transfer_id=transfer_id, decode_host="127.0.0.1", decode_kv_port=DECODE_KV_PORT
    ).model_dump()


def test_one_token_prompt_neither_loads_nor_sends() -> None:
    decode, prefill = state(), state()
    assert decode.matched_tokens(decode_params("tx-1"), 1, 0, "d-1") == (0, False)
    decode.after_alloc("d-1", decode_params("tx-1"), "h", 1, [7], 1)
    assert decode.take_plan().loads == []
    assert not prefill.finished("p-1", prefill_params("tx-1"), "h", 1, [3], True)
    assert prefill.take_plan().sends == []
    assert not prefill.has_pending_sends


def test_two_token_prompt_loads_and_sends_one_block() -> None:
    decode, prefill = state(), state()
    assert decode.matched_tokens(decode_params("tx-2"), 2, 0, "d-2") == (2, True)
    decode.after_alloc("d-2", decode_params("tx-2"), "h", 2, [7], 2)
    (load,) = decode.take_plan().loads
    assert (load.transfer_id, load.block_ids, load.skip) == ("tx-2", (7,), 0)
    assert prefill.finished("p-2", prefill_params("tx-2"), "h", 2, [3], True)
    (send,) = prefill.take_plan().sends
    assert (send.transfer_id, send.block_ids, send.port) == ("tx-2", (3,), DECODE_KV_PORT)


def test_a_request_whose_load_ended_is_not_loaded_again() -> None:
    decode = state()
    params = decode_params("tx-3")
    assert decode.matched_tokens(params, 40, 0, "d-3") == (40, True)
    decode.after_alloc("d-3", params, "h", 40, [1, 2, 3], 40)
    assert len(decode.take_plan().loads) == 1
    decode.loaded({"d-3"})
    # vLLM reset it to 0 computed tokens (preemption, recompute after a failed load): prefill sent
    # this transfer once, so waiting again would only time out; decode computes the prompt itself.
    assert decode.matched_tokens(params, 40, 0, "d-3") == (0, False)
    decode.after_alloc("d-3", params, "h", 40, [4, 5, 6], 40)
    assert decode.take_plan().loads == []
    assert not decode.finished("d-3", params, "h", 40, [4, 5, 6], False)
    assert decode.matched_tokens(params, 40, 0, "d-3") == (40, True)  # forgotten once finished


def test_matched_tokens_stays_side_effect_free_until_the_load_is_planned() -> None:
    decode = state()
    params = decode_params("tx-4")
    assert decode.matched_tokens(params, 40, 0, "d-4") == (40, True)
    assert decode.matched_tokens(params, 40, 32, "d-4") == (8, True)  # asked again after a skip
    assert decode.take_plan().loads == []


def test_aborted_load_is_cancelled_once_and_forgotten() -> None:
    decode = state()
    params = decode_params("tx-5")
    decode.after_alloc("d-5", params, "h", 40, [1, 2, 3], 40)
    decode.take_plan()
    assert not decode.finished("d-5", params, "h", 40, [], False)
    assert decode.take_plan().cancels == ["tx-5"]
    decode.loaded({"d-5"})  # the cancelled receive is reported as ended afterwards
    assert decode.matched_tokens(params, 40, 0, "d-5") == (40, True)


def test_plans_carry_the_other_sides_tp_size_from_the_request() -> None:
    decode, prefill = state(peer_tp_size=4), state(peer_tp_size=2)  # the deployment's, which requests name
    params = DecodeParams(transfer_id="tx-6", prefill_tp_size=4).model_dump()
    decode.after_alloc("d-6", params, "h", 40, [1, 2, 3], 40)
    (load,) = decode.take_plan().loads
    assert load.prefill_tp_size == 4
    sent = PrefillParams(
        transfer_id="tx-6", decode_host="127.0.0.1", decode_kv_port=DECODE_KV_PORT, decode_tp_size=2
    ).model_dump()
    assert prefill.finished("p-6", sent, "h", 40, [7, 8, 9], True)
    (send,) = prefill.take_plan().sends
    assert (send.port, send.decode_tp_size) == (DECODE_KV_PORT, 2)  # rank r of decode at port + r


def test_a_request_that_names_no_tp_size_assumes_equal_sizes() -> None:
    decode, prefill = state(), state()
    decode.after_alloc("d-7", {"dllm": 1, "transfer_id": "tx-7", "do_remote_prefill": True}, "h", 40, [1], 40)
    assert decode.take_plan().loads[0].prefill_tp_size is None  # the receiver takes its own TP size
    params = {"dllm": 1, "transfer_id": "tx-7", "do_remote_decode": True, "decode_host": "127.0.0.1"}
    assert prefill.finished("p-7", params | {"decode_kv_port": DECODE_KV_PORT}, "h", 40, [1, 2, 3], True)
    assert prefill.take_plan().sends[0].decode_tp_size is None
