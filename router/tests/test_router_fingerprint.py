"""Pairing by KV fingerprint (issue 34), over real HTTP against engine doubles whose /health names a
fingerprint as dllm-serve's does: a prefill pod sends only to a decode pod of its fingerprint, on both
request paths and for every request of a mixed pool; a fingerprint without a complete pair gets none;
no complete pair at all is a clear 503; pods that name none pair as before; the KV check checks only
the pairs requests take."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_engine_double import FakeVllmEngine
from router_harness import EngineFactory, RouterFactory, RunningRouter

from dllm_router.endpoints import fits
from dllm_router.fingerprint_pairs import MAX_PAIRS, OTHER, FingerprintPairs
from dllm_router.openai import COMPLETIONS

pytestmark = pytest.mark.timeout(20)

OLD, NEW = "01d01d01d0", "0e00e00e00"
BODIES = [{"prompt": "f", "max_tokens": 3}, {"prompt": "f", "max_tokens": 3, "stream": True}]


async def engine(engines: EngineFactory, name: str, fingerprint: str | None) -> FakeVllmEngine:
    pod = await engines(name)
    pod.fingerprint = fingerprint
    return pod


async def half_rolled(
    engines: EngineFactory, start_router: RouterFactory
) -> tuple[RunningRouter, FakeVllmEngine, FakeVllmEngine, FakeVllmEngine]:
    """Prefill at both fingerprints, decode at the new one only: the router, old and new prefill, decode."""
    p_old, p_new = await engine(engines, "p-old", OLD), await engine(engines, "p-new", NEW)
    d_new = await engine(engines, "d-new", NEW)
    return await start_router("dllm", [p_old, p_new], [d_new]), p_old, p_new, d_new


def test_pods_fit_when_equal_or_when_either_names_none() -> None:
    assert fits(OLD, {OLD})
    assert not fits(OLD, {NEW})
    assert fits(None, {NEW})
    assert fits(OLD, {None, NEW})
    assert not fits(OLD, set())


async def test_mid_rollout_every_request_goes_through_a_pair_of_one_fingerprint(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    """Old and new prefill and decode pods at once: 20 requests on each path, none crossing."""
    p_old, p_new = await engine(engines, "p-old", OLD), await engine(engines, "p-new", NEW)
    d_old, d_new = await engine(engines, "d-old", OLD), await engine(engines, "d-new", NEW)
    r = await start_router("dllm", [p_old, p_new], [d_old, d_new])
    for body in BODIES * 10:
        async with await r.post(COMPLETIONS, body) as answer:
            assert answer.status == 200, await answer.text()
            await answer.read()
    for prefill, decode in ((p_old, d_old), (p_new, d_new)):
        sent = {seen.kv["transfer_id"] for seen in prefill.generations}
        loaded = {seen.kv["transfer_id"] for seen in decode.generations}
        assert sent == loaded, (prefill.name, decode.name)
        assert sent  # both fingerprints took requests
    text = await (await r.client.get(r.url + "/metrics")).text()
    assert (
        f'dllm_router_pod_kv_fingerprint{{fingerprint="{NEW}",pod="{d_new.url[7:]}",role="decode"}} 1.0'
        in text
    )
    counted = {
        (sample.labels["prefill_fingerprint"], sample.labels["decode_fingerprint"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "dllm_router_fingerprint_pairs"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert set(counted) == {(OLD, OLD), (NEW, NEW)}, counted  # both versions served, none crossed
    assert sum(counted.values()) == 20
    assert counted[(OLD, OLD)] == len(p_old.generations)


def test_fingerprint_pairs_are_bounded_and_count_a_pod_naming_none_under_empty() -> None:
    pairs = FingerprintPairs()
    pairs.count(None, NEW)
    for n in range(MAX_PAIRS + 5):
        pairs.count(f"{n:010x}", f"{n:010x}")
    assert pairs.counts[("", NEW)] == 1
    assert len(pairs.counts) == MAX_PAIRS + 1  # the bound, and "other"
    assert pairs.counts[OTHER] == 6
    # a scrape while full drops the pairs no pod names any more: room for the next version
    list(pairs.families({f"{MAX_PAIRS - 2:010x}"}))
    assert set(pairs.counts) == {(f"{MAX_PAIRS - 2:010x}",) * 2}
    pairs.count("1234567890", "1234567890")
    assert pairs.counts[("1234567890", "1234567890")] == 1


async def test_a_fingerprint_without_a_complete_pair_gets_no_request(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r, p_old, p_new, _ = await half_rolled(engines, start_router)
    for body in [*BODIES, {"prompt": "f", "max_tokens": 1}] * 4:  # the one-token path too
        async with await r.post(COMPLETIONS, body) as answer:
            assert answer.status == 200, await answer.text()
            await answer.read()
    assert p_old.generations == []
    assert len(p_new.generations) == 12


async def test_no_complete_pair_at_all_is_a_503_that_says_so(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p_old, d_new = await engine(engines, "p-old", OLD), await engine(engines, "d-new", NEW)
    r = await start_router("dllm", [p_old], [d_new])
    for body in BODIES:
        async with await r.post(COMPLETIONS, body) as answer:
            assert answer.status == 503
            error: dict[str, Any] = (await answer.json())["error"]
            assert error["type"] == "no_compatible_pair", error
            assert "KV fingerprint" in error["message"]
    assert p_old.generations == d_new.generations == []


async def test_pods_that_name_no_fingerprint_pair_as_before(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engine(engines, "p", None), await engine(engines, "d", NEW)
    r = await start_router("dllm", [p], [d])
    async with await r.post(COMPLETIONS, BODIES[0]) as answer:
        assert answer.status == 200, await answer.text()
    assert len(p.generations) == len(d.generations) == 1


async def test_the_kv_check_checks_only_pairs_of_one_fingerprint(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r, _, p_new, d_new = await half_rolled(engines, start_router)
    pairs = {(p.name, d.name) for p, d in r.router.kv_check.pairs()}
    assert pairs == {(f"127.0.0.1:{p_new.port}", f"127.0.0.1:{d_new.port}")}
