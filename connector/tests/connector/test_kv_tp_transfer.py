"""Prefill and decode with different TP sizes move a paged KV through the real transports.

The prefill TP ranks run in their own process (kv_peer.py), each with its own transport and its
share of a full model's KV heads; the decode TP ranks are KVReceivers in the test process, rank r
on port + r, each with its own transport. Mooncake runs over TCP on 127.0.0.1, gloo on real pair
groups. Every head each decode rank holds is compared with the full model's KV.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from kv_peer import (
    HOST,
    LAYOUTS,
    TP_BLOCKS,
    TP_GEOMETRY,
    Prefill,
    consecutive_free_ports,
    make_transport,
    rank_kv,
    receiver_config,
)

from dllm_connector.layout import PagedKV, TPMappingError, TPRank, plan_tp_mapping, rank_heads
from dllm_connector.pipe.common import PipeConfig
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender
from dllm_connector.scheduler import SchedulerState, StepPlan, prompt_hash
from dllm_connector.transport.base import Transport
from dllm_connector.worker import ConnectorWorker, WorkerIdentity
from dllm_contract.kvconfig import Compression, ConnectorExtraConfig, Protocol
from dllm_contract.pd_params import DecodeParams, PrefillParams

pytestmark = [pytest.mark.engine, pytest.mark.timeout(90)]

MAX_DECODE_TP = 4
SRC_BLOCKS = [int(b) for b in torch.randperm(TP_BLOCKS, generator=torch.Generator().manual_seed(3))[:40]]
DST_BLOCKS = [int(b) for b in torch.randperm(TP_BLOCKS, generator=torch.Generator().manual_seed(4))[:40]]
RELATIVE_ERROR = {Compression.NONE: 0.0, Compression.FP8: 0.04, Compression.INT8: 0.01}
HASH = prompt_hash([5, 6, 7])
STAGING_BYTES = 16 << 20  # each decode rank's


@pytest.fixture(scope="module")
def transports(kind: str) -> Iterator[list[Transport]]:
    """One transport per decode TP rank, as each rank's worker has its own."""
    engines = [make_transport(kind) for _ in range(MAX_DECODE_TP)]
    yield engines
    for engine in engines:
        engine.close()


@contextlib.contextmanager
def decode_ranks(
    transports: list[Transport], size: int, layout: str, config: PipeConfig
) -> Iterator[tuple[int, list[KVReceiver]]]:
    """Decode TP ranks 0..size-1 on consecutive ports: (the base port, the receivers)."""
    base = consecutive_free_ports(size)
    receivers = [
        KVReceiver(transports[rank], rank_kv(None, layout, TPRank(rank, size)), config, HOST, base + rank)
        for rank in range(size)
    ]
    try:
        yield base, receivers
    finally:
        for receiver in receivers:
            receiver.close()
    for receiver in receivers:
        assert receiver.staging.in_use == 0
        assert not receiver.pending


def tp_spec(prefill_tp: int, decode_tp: int, layout: str, **changes: Any) -> dict[str, Any]:
    return {
        "size": prefill_tp,
        "ranks": list(range(prefill_tp)),
        "decode_tp": decode_tp,
        "layout": layout,
    } | changes


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


CASES = [(2, 1, "cpu"), (1, 2, "cpu"), (2, 4, "cpu"), (2, 1, "nhd"), (1, 2, "nhd")]


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.FP8])
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "layout"), CASES)
def test_every_head_arrives_from_its_prefill_rank(
    transports: list[Transport],
    prefill: Prefill,
    prefill_tp: int,
    decode_tp: int,
    layout: str,
    compression: Compression,
) -> None:
    transfer_id = f"tp-{prefill_tp}-{decode_tp}-{layout}-{compression.value}"
    with decode_ranks(transports, decode_tp, layout, receiver_config(STAGING_BYTES)) as (port, receivers):
        for receiver in receivers:
            receiver.expect(transfer_id, DST_BLOCKS, prompt_hash=HASH, prefill_tp_size=prefill_tp)
        jobs = [{"transfer_id": transfer_id, "block_ids": SRC_BLOCKS, "hash": HASH}]
        # Mooncake writes head ranges zero-copy however short their runs (the test KV is small)
        spec = tp_spec(prefill_tp, decode_tp, layout, min_zero_copy_run=0)
        prefill.send(port, jobs, compression=compression.value, tp=spec)
        assert [receiver.wait_for(transfer_id, timeout=60) for receiver in receivers] == [""] * decode_tp
        report = prefill.report()
        for rank, receiver in enumerate(receivers):
            want = rank_kv(7, layout, TPRank(rank, decode_tp)).gather(SRC_BLOCKS)  # the full model's heads
            got = receiver.kv.gather(DST_BLOCKS)
            assert relative_error(got, want) <= RELATIVE_ERROR[compression]
            untouched = sorted(set(range(TP_BLOCKS)) - set(DST_BLOCKS))
            assert not bool(receiver.kv.gather(untouched).any())
    assert [line["error"] for line in report if "transfer_id" in line] == [None] * prefill_tp
    stats = [line["stats"] for line in report if "stats" in line]
    assert all(line["staging_in_use"] == 0 for line in report if "stats" in line)
    # one part per (prefill rank, decode rank) pair of the mapping, each head once per decode rank
    assert sum(s["sent"] for s in stats) == len(plan_tp_mapping(8, prefill_tp, decode_tp).pairs)
    delivered = sum(receiver.kv.batch_nbytes(len(SRC_BLOCKS)) for receiver in receivers)
    assert sum(s["raw_bytes"] for s in stats) == delivered
    if compression is Compression.FP8:
        assert sum(s["bytes_on_wire"] for s in stats) <= 0.55 * delivered


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 2), (2, 1), (2, 4)])
def test_an_mla_latent_reaches_each_decode_rank_once(
    transports: list[Transport], prefill: Prefill, prefill_tp: int, decode_tp: int
) -> None:
    """MLA's latent is the same on every TP rank (issue 35): each decode rank takes it once, from one
    prefill rank, never once per prefill rank. The bytes prove it: prefill sends exactly one latent per
    decode rank, however many prefill ranks hold it, and prefill ranks with no decode rank to serve
    send nothing and fail nothing."""
    transfer_id = f"mla-{prefill_tp}-{decode_tp}"
    with decode_ranks(transports, decode_tp, "mla", receiver_config(STAGING_BYTES)) as (port, receivers):
        for receiver in receivers:
            receiver.expect(transfer_id, DST_BLOCKS, prompt_hash=HASH, prefill_tp_size=prefill_tp)
        jobs = [{"transfer_id": transfer_id, "block_ids": SRC_BLOCKS, "hash": HASH}]
        prefill.send(port, jobs, tp=tp_spec(prefill_tp, decode_tp, "mla"))
        assert [receiver.wait_for(transfer_id, timeout=60) for receiver in receivers] == [""] * decode_tp
        report = prefill.report()
        latent = rank_kv(7, "mla", TPRank(0, 1)).gather(SRC_BLOCKS)
        for receiver in receivers:
            assert torch.equal(receiver.kv.gather(DST_BLOCKS), latent)
    assert [line["error"] for line in report if "transfer_id" in line] == [None] * prefill_tp
    stats = [line["stats"] for line in report if "stats" in line]
    assert sum(s["sent"] for s in stats) == decode_tp
    assert sum(s["raw_bytes"] for s in stats) == decode_tp * latent.numel() * latent.element_size()


def test_a_prefill_rank_that_never_sends_fails_the_load_within_the_wait(
    transports: list[Transport], prefill: Prefill
) -> None:
    config = receiver_config(STAGING_BYTES, prefill_wait_ms=1000)
    with decode_ranks(transports, 1, "cpu", config) as (port, (receiver,)):
        started = time.monotonic()
        receiver.expect("tp-half", DST_BLOCKS, prefill_tp_size=2)
        jobs = [{"transfer_id": "tp-half", "block_ids": SRC_BLOCKS}]
        prefill.send(port, jobs, compression="fp8", tp=tp_spec(2, 1, "cpu", ranks=[0]))  # rank 1 never sends
        outcome = receiver.wait_for("tp-half", timeout=20)
        assert outcome == "prefill TP ranks [1] of 2 sent nothing within 1.0s"
        assert time.monotonic() - started < 4
        assert prefill.report()[0] == {"rank": 0, "transfer_id": "tp-half", "error": None}
        assert receiver.stats.timeouts == 1
        assert receiver.results() == {}  # reported once
    # decode_ranks checked: no staging reserved, nothing pending


def test_a_failing_prefill_rank_fails_the_load(transports: list[Transport], prefill: Prefill) -> None:
    with decode_ranks(transports, 1, "cpu", receiver_config(STAGING_BYTES)) as (port, (receiver,)):
        receiver.expect("tp-bad", DST_BLOCKS, prefill_tp_size=2)
        jobs = [{"transfer_id": "tp-bad", "block_ids": SRC_BLOCKS}]
        spec = tp_spec(2, 1, "cpu", doubles={"1": "corrupt"})
        prefill.send(port, jobs, compression="fp8", tp=spec)
        outcome = receiver.wait_for("tp-bad", timeout=60)
        assert outcome is not None
        assert "checksum" in outcome
        errors = {line["rank"]: line["error"] for line in prefill.report() if "transfer_id" in line}
        assert "checksum" in errors[1]
        assert receiver.stats.checksum_failures == 1
        assert receiver.stats.failed_receives == 1


def test_unmappable_tp_sizes_are_refused_on_both_sides(transports: list[Transport], prefill: Prefill) -> None:
    with decode_ranks(transports, 2, "cpu", receiver_config(STAGING_BYTES)) as (port, receivers):
        with pytest.raises(TPMappingError, match="cannot map 8 KV heads from prefill TP 3 to decode TP 2"):
            receivers[0].expect("tp-3", DST_BLOCKS, prefill_tp_size=3)
        prefill.send(port, [{"transfer_id": "tp-3", "block_ids": SRC_BLOCKS}], tp=tp_spec(2, 3, "cpu"))
        errors = [line["error"] for line in prefill.report() if "transfer_id" in line]
        assert len(errors) == 2
        assert all("cannot map 8 KV heads from prefill TP 2 to decode TP 3" in error for error in errors)


def test_the_request_must_name_the_prefill_tp_size_that_sends(
    transports: list[Transport], prefill: Prefill
) -> None:
    with decode_ranks(transports, 1, "cpu", receiver_config(STAGING_BYTES)) as (port, (receiver,)):
        receiver.expect("tp-wrong", DST_BLOCKS, prefill_tp_size=1)
        prefill.send(port, [{"transfer_id": "tp-wrong", "block_ids": SRC_BLOCKS}], tp=tp_spec(2, 1, "cpu"))
        outcome = receiver.wait_for("tp-wrong", timeout=30)
        assert outcome is not None
        assert "prefill TP size 2 offered, decode (TP 1) expects prefill TP 1 for this request" in outcome
        # Both ranks are refused by decode; the first offer it reads is told why, the other that the
        # transfer is no longer awaited.
        errors = [line["error"] for line in prefill.report() if "transfer_id" in line]
        assert len(errors) == 2
        assert all(error.startswith("peer answered nack instead of accept") for error in errors), errors
        assert any("prefill TP size 2 offered" in error for error in errors), errors


# ---- the connector's workers, from the scheduler's plans ------------------------------------------


def caches_of(kv: PagedKV) -> dict[str, torch.Tensor]:
    return dict(zip(kv.names, kv.caches, strict=True))


def worker_extra(**changes: Any) -> ConnectorExtraConfig:
    base: dict[str, Any] = {
        "compression": Compression.INT8,
        "buffer_size_gb": 0.01,
        "transfer_threshold_tokens": 32,
        "transfer_timeout_ms": 10000,
        "prefill_wait_ms": 20000,
        "hold_seconds": 10,
        "async_transfer": True,
        "protocol": Protocol.TCP,
    }
    return ConnectorExtraConfig(**(base | changes))


def worker(extra: ConnectorExtraConfig, tp: TPRank, port: int, *, sends: bool) -> ConnectorWorker:
    """A prefill (sends) or decode TP rank's connector worker over Mooncake, its caches registered."""
    start, stop = rank_heads(8, tp.size, tp.rank)
    identity = WorkerIdentity(port, tp_rank=tp.rank, tp_size=tp.size, sends=sends, receives=not sends)
    connector = ConnectorWorker(extra, replace(TP_GEOMETRY, num_kv_heads=stop - start), identity, "mooncake")
    connector.register_kv_caches(caches_of(rank_kv(7 if sends else None, "cpu", tp)), TP_BLOCKS)
    return connector


def worker_plans(
    extra: ConnectorExtraConfig, prefill_tp: int, decode_tp: int, port: int
) -> tuple[StepPlan, StepPlan]:
    """The scheduler's plans for one 80-token prompt, from the router's params with both TP sizes."""
    prompt_len = 16 * 5
    decode_params = DecodeParams(transfer_id="tx-tp", prefill_tp_size=prefill_tp).model_dump()
    prefill_params = PrefillParams(
        transfer_id="tx-tp", decode_host=HOST, decode_kv_port=port, decode_tp_size=decode_tp
    ).model_dump()
    # each engine knows the other's TP size (DLLM_KV_PEER_TP_SIZE), the only one a request may name
    decode_extra = extra.model_copy(update={"peer_tp_size": prefill_tp})
    decode_state = SchedulerState(decode_extra, block_size=16, kv_port=port, tp_size=decode_tp)
    count, _ = decode_state.matched_tokens(decode_params, prompt_len, 0)
    decode_state.after_alloc("d-1", decode_params, "h", prompt_len, DST_BLOCKS[:5], count)
    prefill_extra = extra.model_copy(update={"peer_tp_size": decode_tp})
    prefill_state = SchedulerState(prefill_extra, block_size=16, kv_port=0, tp_size=prefill_tp)
    assert prefill_state.finished("p-1", prefill_params, "h", prompt_len, SRC_BLOCKS[:5], True)
    return prefill_state.take_plan(), decode_state.take_plan()


def test_workers_with_tp_one_feed_decode_tp_two() -> None:
    """A prefill worker of TP 1 feeds two decode workers of TP 2 (Mooncake), planned from the params."""
    extra, port = worker_extra(), consecutive_free_ports(2)
    prefill = worker(extra, TPRank(0, 1), 0, sends=True)
    decode = [worker(extra, TPRank(rank, 2), port, sends=False) for rank in range(2)]
    try:
        prefill_plan, decode_plan = worker_plans(extra, 1, 2, port)
        for connector in decode:
            connector.start(decode_plan)  # every TP rank's worker gets the same plan
        prefill.start(prefill_plan)
        for connector in decode:
            assert connector.receiver is not None
            assert connector.receiver.wait_settled("tx-tp", timeout=30)
        assert prefill.sender is not None
        assert prefill.sender.wait_idle(timeout=30)
        assert prefill.results().finished_sending == {"p-1"}
        for rank, connector in enumerate(decode):
            results = connector.results()
            assert (results.finished_recving, results.failed_recving) == ({"d-1"}, set())
            assert connector.kv is not None
            want = rank_kv(7, "cpu", TPRank(rank, 2)).gather(SRC_BLOCKS[:5])
            got = connector.kv.gather(DST_BLOCKS[:5])
            assert relative_error(got, want) < RELATIVE_ERROR[Compression.INT8]
    finally:
        prefill.close()
        for connector in decode:
            connector.close()


def test_a_missing_prefill_rank_fails_the_workers_load_with_its_blocks() -> None:
    """Prefill TP 2 to decode TP 1, and only prefill rank 0 runs: the load fails, its blocks listed."""
    extra, port = worker_extra(prefill_wait_ms=1000), consecutive_free_ports(1)
    prefill = worker(extra, TPRank(0, 2), 0, sends=True)
    decode = worker(extra, TPRank(0, 1), port, sends=False)
    try:
        prefill_plan, decode_plan = worker_plans(extra, 2, 1, port)
        decode.start(decode_plan)
        prefill.start(prefill_plan)
        assert decode.receiver is not None
        assert decode.receiver.wait_settled("tx-tp", timeout=20)
        results = decode.results()
        assert (results.finished_recving, results.failed_recving) == ({"d-1"}, {"d-1"})
        assert decode.take_load_errors() == set(DST_BLOCKS[:5])
        assert decode.failures["tx-tp"] == "prefill TP ranks [1] of 2 sent nothing within 1.0s"
        assert prefill.sender is not None
        assert prefill.sender.wait_idle(timeout=20)
        assert prefill.results().finished_sending == {"p-1"}  # rank 0's part was delivered
        assert decode.receiver.staging.in_use == 0
        assert not decode.receiver.pending
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equal_tp_sizes_keep_the_one_to_one_path(
    transports: list[Transport], prefill: Prefill, layout: str
) -> None:
    """TP 2 to TP 2: rank r sends all its heads to rank r, with no head ranges in the offer."""
    with decode_ranks(transports, 2, layout, receiver_config(STAGING_BYTES)) as (port, receivers):
        for receiver in receivers:
            receiver.expect("tp-same", DST_BLOCKS, prefill_tp_size=2)
        prefill.send(port, [{"transfer_id": "tp-same", "block_ids": SRC_BLOCKS}], tp=tp_spec(2, 2, layout))
        assert [receiver.wait_for("tp-same", timeout=60) for receiver in receivers] == ["", ""]
        for rank, receiver in enumerate(receivers):
            want = rank_kv(7, layout, TPRank(rank, 2)).gather(SRC_BLOCKS)
            assert torch.equal(receiver.kv.gather(DST_BLOCKS), want)
        stats = [line["stats"] for line in prefill.report() if "stats" in line]
        assert [s["sent"] for s in stats] == [1, 1]


def test_a_cancelled_load_ends_once_and_late_parts_are_refused_at_once(
    transports: list[Transport], prefill: Prefill
) -> None:
    with decode_ranks(transports, 1, "cpu", receiver_config(STAGING_BYTES)) as (port, (receiver,)):
        receiver.expect("tp-gone", DST_BLOCKS, prefill_tp_size=2)
        receiver.cancel("tp-gone")  # decode aborted the request before any KV came
        assert receiver.results() == {"tp-gone": "cancelled by decode"}
        started = time.monotonic()
        prefill.send(port, [{"transfer_id": "tp-gone", "block_ids": SRC_BLOCKS}], tp=tp_spec(2, 1, "cpu"))
        errors = [line["error"] for line in prefill.report() if "transfer_id" in line]
        assert len(errors) == 2
        assert all("not awaited any more" in error for error in errors)
        assert time.monotonic() - started < 5  # not the 10 s hold
        assert receiver.results() == {}
        assert not bool(receiver.kv.gather(DST_BLOCKS).any())


def test_short_head_runs_travel_through_staging(transports: list[Transport], prefill: Prefill) -> None:
    """NHD head ranges are one short run per token: codec none gathers them instead of writing each."""
    sender_kv = rank_kv(7, "nhd", TPRank(0, 2))
    sender = KVSender(transports[0], sender_kv, receiver_config(STAGING_BYTES))
    try:
        assert sender.zero_copy == transports[0].one_sided
        assert sender.kv.run_nbytes((0, 2)) == 2 * 32 * 2  # two heads of one token
        assert not sender._zero_copy_for((0, 2))
        assert sender._zero_copy_for(None) == sender.zero_copy  # equal TP sizes: as before
    finally:
        sender.close()
    with decode_ranks(transports, 1, "nhd", receiver_config(STAGING_BYTES)) as (port, (receiver,)):
        receiver.expect("tp-staged", DST_BLOCKS, prefill_tp_size=2)
        prefill.send(port, [{"transfer_id": "tp-staged", "block_ids": SRC_BLOCKS}], tp=tp_spec(2, 1, "nhd"))
        assert receiver.wait_for("tp-staged", timeout=60) == ""
        assert torch.equal(receiver.kv.gather(DST_BLOCKS), rank_kv(7, "nhd", TPRank(0, 1)).gather(SRC_BLOCKS))
        stats = [line["stats"] for line in prefill.report() if "stats" in line]
        assert sum(s["bytes_on_wire"] for s in stats) == receiver.kv.batch_nbytes(len(SRC_BLOCKS))
