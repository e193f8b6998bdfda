"""The autoscaler's signals from metrics pages as vLLM and the router write them (autoscale/signals.py):
queued prompt tokens from waiting requests and recent prompt lengths, mean KV-cache usage, latency
percentiles between two scrapes; a page that lacks a metric or does not parse gives no value."""

from __future__ import annotations

import pytest

from dllm_operator.api.autoscaling import AutoscalingSpec
from dllm_operator.autoscale.decide import Signal
from dllm_operator.autoscale.signals import (
    ITL_HISTOGRAM,
    TTFT_HISTOGRAM,
    Histogram,
    latency,
    mean_kv_usage,
    queued_prompt_tokens,
    read_page,
    signals_for,
)

ENGINE = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny-llama"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="tiny-llama"}} {usage}
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{{engine="0",le="1000.0",model_name="tiny-llama"}} {small}
vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf",model_name="tiny-llama"}} {count}
vllm:request_prompt_tokens_count{{engine="0",model_name="tiny-llama"}} {count}
vllm:request_prompt_tokens_sum{{engine="0",model_name="tiny-llama"}} {total}
"""


def engine(waiting: float, usage: float, count: float, total: float, small: float | None = None) -> str:
    return ENGINE.format(
        waiting=waiting, usage=usage, count=count, total=total, small=count if small is None else small
    )


def router(
    ttft: list[tuple[str, float]],
    pairs: list[list[tuple[str, float]]],
    busy: tuple[float, float] = (0, 0),
    answered: float = 0,
) -> str:
    """A router's page: its histograms, `busy` requests in flight on a prefill and a decode pod, and
    `answered` requests so far."""
    lines = [
        "# TYPE dllm_router_requests_total counter",
        f'dllm_router_requests_total{{route="/v1/completions",code="200"}} {answered}',
        "# TYPE dllm_router_inflight gauge",
        f'dllm_router_inflight{{role="prefill",pod="p0"}} {busy[0]}',
        f'dllm_router_inflight{{role="decode",pod="d0"}} {busy[1]}',
        "# TYPE dllm_router_ttft_seconds histogram",
    ]
    lines += [f'dllm_router_ttft_seconds_bucket{{le="{le}"}} {n}' for le, n in ttft]
    lines += ["dllm_router_ttft_seconds_sum 1.0", f"dllm_router_ttft_seconds_count {ttft[-1][1]}"]
    lines.append("# TYPE dllm_router_pair_inter_token_seconds histogram")
    for i, pair in enumerate(pairs):
        labels = f'prefill="p{i}",decode="d{i}"'
        lines += [f'dllm_router_pair_inter_token_seconds_bucket{{{labels},le="{le}"}} {n}' for le, n in pair]
        lines += [
            f"dllm_router_pair_inter_token_seconds_sum{{{labels}}} 1.0",
            f"dllm_router_pair_inter_token_seconds_count{{{labels}}} {pair[-1][1]}",
        ]
    return "\n".join(lines) + "\n"


def test_queued_prompt_tokens_weigh_waiting_requests_by_their_pods_recent_prompts() -> None:
    # pod a: 4 waiting; 10 prompts of 100 tokens before, then 10 of 3000 between the scrapes
    a = (read_page(engine(0, 0.1, 10, 1000)), read_page(engine(4, 0.1, 20, 31_000)))
    # pod b: 2 waiting, no prompt finished between the scrapes: its lifetime mean (500)
    b = (read_page(engine(0, 0.1, 4, 2000)), read_page(engine(2, 0.1, 4, 2000)))
    assert queued_prompt_tokens([a, b]) == 4 * 3000 + 2 * 500
    assert queued_prompt_tokens([(None, read_page(engine(0, 0.1, 0, 0)))]) == 0  # a fresh, idle pod
    # requests waiting where none ever finished (stuck, or just started): not zero load, unknown
    assert queued_prompt_tokens([(None, read_page(engine(50, 0.1, 0, 0)))]) is None


def test_a_page_without_a_metric_or_that_does_not_parse_gives_no_value() -> None:
    missing = read_page("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n")
    assert missing is not None
    assert queued_prompt_tokens([(None, missing)]) is None
    assert mean_kv_usage([missing]) is None
    assert read_page("vllm:num_requests_waiting{engine=} oops\n") is None
    assert queued_prompt_tokens([(None, None)]) is None  # an unreachable pod is not idle


def test_kv_usage_is_the_mean_over_decode_pods() -> None:
    pages = [read_page(engine(0, usage, 1, 10)) for usage in (0.2, 0.6, 1.0)]
    assert mean_kv_usage(pages) == pytest.approx(0.6)
    assert mean_kv_usage([]) is None


def test_latency_is_the_90th_percentile_of_what_came_between_two_scrapes() -> None:
    # before: 100 fast answers; between: 10 more in (0.1, 0.5] and 10 in (0.5, 1.0]
    before = read_page(router([("0.1", 100), ("0.5", 100), ("1.0", 100), ("+Inf", 100)], []))
    after = read_page(router([("0.1", 100), ("0.5", 110), ("1.0", 120), ("+Inf", 120)], []))
    # rank 18 of 20: 8 into the (0.5, 1.0] bucket of 10 -> 0.5 + 0.5 * 0.8
    assert latency(TTFT_HISTOGRAM, [(before, after)]) == pytest.approx(0.9)
    # the whole series: 90 of 100 in (0, 0.1]
    assert latency(TTFT_HISTOGRAM, [(None, before)]) == pytest.approx(0.09)


def test_an_idle_router_reads_as_no_latency_and_a_busy_unmeasured_one_as_no_value() -> None:
    pair: list[tuple[str, float]] = [("0.01", 50), ("+Inf", 50)]
    idle = read_page(router([("0.1", 100), ("+Inf", 100)], [pair], answered=100))
    assert latency(TTFT_HISTOGRAM, [(idle, idle)]) == 0  # nothing answered, observed or in flight
    assert latency(ITL_HISTOGRAM, [(idle, idle)]) == 0
    # two prompts in flight, none has its first token yet: not measured, and not zero
    waiting = read_page(router([("0.1", 100), ("+Inf", 100)], [pair], busy=(2, 0), answered=100))
    assert latency(TTFT_HISTOGRAM, [(idle, waiting)]) is None
    # unstreamed answers between the scrapes give no inter-token time: a busy decode, not an idle one
    unstreamed = read_page(router([("0.1", 100), ("+Inf", 140)], [pair], answered=140))
    assert latency(ITL_HISTOGRAM, [(idle, unstreamed)]) is None
    # a router page without its counters cannot say idle, nor can a first page alone
    bare = read_page("\n".join(router([("+Inf", 100)], [pair]).splitlines()[5:]) + "\n")
    assert bare is not None
    assert latency(TTFT_HISTOGRAM, [(bare, bare)]) is None
    assert latency(TTFT_HISTOGRAM, [(None, idle)]) is not None  # the whole series: observations


def test_inter_token_latency_sums_the_router_pairs_and_a_restarted_router_counts_afresh() -> None:
    pair: list[tuple[str, float]] = [("0.01", 50), ("0.05", 90), ("+Inf", 100)]
    after = read_page(router([("+Inf", 0)], [pair, pair]))
    assert latency(ITL_HISTOGRAM, [(None, after)]) == pytest.approx(0.05)  # rank 180 of 200: the 0.05 bound
    restarted = read_page(router([("+Inf", 0)], [[("0.01", 10), ("0.05", 10), ("+Inf", 10)]]))
    assert latency(ITL_HISTOGRAM, [(after, restarted)]) == pytest.approx(0.009)


def test_a_quantile_past_the_last_finite_bound_is_that_bound() -> None:
    slow = Histogram(((0.1, 0.0), (1.0, 0.0), (float("inf"), 5.0)), 50.0, 5.0)
    assert slow.quantile(0.9) == 1.0


def test_two_routers_latencies_are_one_distribution_and_each_role_gets_its_measure() -> None:
    fast = read_page(router([("0.1", 9), ("1.0", 9), ("+Inf", 9)], []))
    slow = read_page(router([("0.1", 0), ("1.0", 1), ("+Inf", 1)], []))
    assert latency(TTFT_HISTOGRAM, [(None, fast), (None, slow)]) == pytest.approx(0.1)  # rank 9 of 10
    spec = AutoscalingSpec.model_validate(
        {
            "mode": "advisory",
            "prefill": {"maxReplicas": 4, "target": {"timeToFirstTokenSeconds": 0.5}},
            "decode": {"maxReplicas": 4, "target": {"kvCacheUsage": 0.5}},
        }
    )
    decode = [(None, read_page(engine(0, 0.8, 1, 10)))]
    found = signals_for(spec, [], decode, [(None, fast), (None, slow)], 7.0)
    prefill = found["prefill"]
    assert prefill is not None
    assert prefill.value == pytest.approx(0.1)
    assert prefill.at == 7.0
    assert found["decode"] == Signal(0.8, 7.0)
    assert signals_for(spec, [], [], [], 7.0) == {"prefill": None, "decode": None}  # no pod: no signal


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-3", "1e999"])
def test_a_page_with_a_value_that_is_no_count_is_not_read(value: str) -> None:
    """Engines' pages come over the network: NaN, inf or a negative reading never reaches the decision."""
    text = engine(1, 0.5, 1, 10).replace(
        'kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.5',
        f'kv_cache_usage_perc{{engine="0",model_name="tiny-llama"}} {value}',
    )
    assert value in text
    assert read_page(text) is None
    nan_bound = router([("0.1", 1), ("NaN", 1), ("+Inf", 1)], [])
    assert read_page(nan_bound) is None


def test_a_pair_the_router_dropped_takes_nothing_away_from_the_others() -> None:
    """A pod left: its pair's series is gone from the later page. Each series is compared with its own
    earlier value, so the remaining pair's new observations are what counts (never a negative bucket)."""
    slow: list[tuple[str, float]] = [("0.01", 0), ("0.05", 0), ("+Inf", 1000)]
    fast_before: list[tuple[str, float]] = [("0.01", 10), ("0.05", 10), ("+Inf", 10)]
    fast_after: list[tuple[str, float]] = [("0.01", 20), ("0.05", 20), ("+Inf", 20)]
    before = read_page(router([("+Inf", 0)], [fast_before, slow]))
    after = read_page(router([("+Inf", 0)], [fast_after]))
    assert latency(ITL_HISTOGRAM, [(before, after)]) == pytest.approx(0.009)  # 10 new, all under 0.01
