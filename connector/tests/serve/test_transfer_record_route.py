"""POST /v1/dllm/transfer_record: decode's own account of one transfer, asked of its side channel
through the same route as the router's ends. After a real load over Mooncake it says loaded, with the
blocks, the bytes in the cache and on the wire and the transport; a transfer decode still waits for is
pending, one it gave up is failed with the reason, an id it never saw is unknown; the engine key and
the body are checked as for an end.

The middleware runs in front of a TEST DOUBLE of vLLM's app over httpx's ASGI transport, with a real
KVReceiver and KVSender over real Mooncake transports on 127.0.0.1 (end_route_cases.py).
"""

from __future__ import annotations

import end_route_cases
import httpx
import pytest
from e2e.waiting import wait_until_async
from end_route_cases import HASH, HOST, TID, TIMEOUT, FakeEngineApp, authorized, send_outcome

from dllm_connector.end_route import RECORD_PATH
from dllm_connector.pipe.messages import TransferRecord
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

transports = end_route_cases.transports  # the shared fixtures, collected from this module's names
receiver = end_route_cases.receiver
sender = end_route_cases.sender
engine = end_route_cases.engine
BLOCKS = (3, 4, 5)
# 3 blocks x 16 tokens x 2 heads x (K and V of 64) x bf16 x 2 layers, as end_route_cases' caches hold them
KV_BYTES = 3 * 16 * 2 * 2 * 64 * 2 * 2


async def ask(client: httpx.AsyncClient, tid: str = TID) -> dict[str, object]:
    answer = await client.post(RECORD_PATH, json={"transfer_id": tid}, headers=authorized())
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def test_a_loaded_transfer_reads_loaded_with_its_blocks_bytes_and_transport(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver, sender: KVSender
) -> None:
    client, inner = engine
    receiver.expect(TID, [7, 8, 9], prompt_hash=HASH)
    assert (await ask(client))["state"] == "pending"
    sender.submit(SendJob(TID, BLOCKS, HOST, receiver.port, HASH))
    assert await send_outcome(sender, TID, 3 * TIMEOUT) is None  # delivered
    await wait_until_async(lambda: receiver.record(TID).state == "loaded", "the load to end", 5)
    record = await ask(client)
    assert record == {
        "transfer_id": TID,
        "state": "loaded",
        "reason": "",
        "blocks": 3,
        "kv_bytes": KV_BYTES,
        "wire_bytes": KV_BYTES,  # codec none: the cache's bytes, as they are
        "seconds": record["seconds"],
        "transport": "mooncake (tcp)",
        "ranks": 1,
    }
    assert 0 < float(str(record["seconds"])) < 3 * TIMEOUT
    assert inner.seen == []  # the route never reaches vLLM's app


async def test_a_transfer_decode_gave_up_is_failed_with_the_reason_and_a_stranger_is_unknown(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver
) -> None:
    client, _ = engine
    receiver.expect(TID, [7, 8], prompt_hash=HASH)
    receiver.cancel(TID)
    record = await ask(client)
    assert record["state"] == "failed"
    assert "cancel" in str(record["reason"]), record
    assert (record["blocks"], record["kv_bytes"], record["wire_bytes"]) == (0, 0, 0)
    assert (await ask(client, "client-req-8-0-ffffffffffff"))["state"] == "unknown"


async def test_the_record_needs_the_engine_key_and_a_transfer_id(
    engine: tuple[httpx.AsyncClient, FakeEngineApp],
) -> None:
    client, inner = engine
    keyless = await client.post(RECORD_PATH, json={"transfer_id": TID})
    wrong = await client.post(RECORD_PATH, json={"transfer_id": TID}, headers={"Authorization": "Bearer x"})
    bad = await client.post(RECORD_PATH, json={"transfer_id": "../etc"}, headers=authorized())
    get = await client.get(RECORD_PATH, headers=authorized())
    assert [r.status_code for r in (keyless, wrong, bad, get)] == [401, 401, 400, 405]
    assert inner.seen == []


def test_a_record_a_peer_sends_is_bounded_like_every_side_channel_message() -> None:
    from dllm_connector.pipe.messages import MalformedMessage, parse

    with pytest.raises(MalformedMessage):
        parse(TransferRecord, {"type": "record", "state": "loaded", "kv_bytes": -1})
    with pytest.raises(MalformedMessage):
        parse(TransferRecord, {"type": "record", "state": "moved"})
    with pytest.raises(MalformedMessage):
        parse(TransferRecord, {"type": "record", "state": "failed", "reason": "x" * 1000})


def test_ranks_merge_into_the_worst_state_the_bytes_summed_and_the_longest_time() -> None:
    from dllm_connector.end_route import merge_records

    def rank(state: str, kv: int, seconds: float, reason: str = "") -> TransferRecord:
        fields = {"state": state, "blocks": 3, "kv_bytes": kv, "wire_bytes": kv // 2}
        extra = {"seconds": seconds, "reason": reason, "transport": "mooncake (rdma)"}
        return TransferRecord.model_validate({"type": "record"} | fields | extra)

    loaded = merge_records([rank("loaded", 100, 0.5), rank("loaded", 100, 0.7)])
    assert loaded == {
        "state": "loaded",
        "reason": "",
        "blocks": 3,  # each rank holds its heads of the same 3 blocks
        "kv_bytes": 200,
        "wire_bytes": 100,
        "seconds": 0.7,
        "transport": "mooncake (rdma)",
        "ranks": 2,
    }
    one_failed = merge_records([rank("loaded", 100, 0.5), rank("failed", 0, 0.1, "checksum mismatch")])
    assert (one_failed["state"], one_failed["reason"]) == ("failed", "checksum mismatch")
    assert merge_records([rank("loaded", 1, 0), rank("pending", 0, 0)])["state"] == "pending"
    assert merge_records([rank("unknown", 0, 0), rank("loaded", 1, 0)])["state"] == "unknown"
