"""The autoscaler's decision (autoscale/decide.py) replayed over recorded signal series, no cluster:
a burst scales prefill up at once and back down only after the window; steady load holds; a signal
flapping around its target moves nothing; a missing or stale signal scales nothing and says why; the
ratio bounds and min/max hold at every step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from pydantic import ValidationError

from dllm_operator.api.autoscaling import AutoscalingSpec
from dllm_operator.autoscale.decide import ROLES, Decision, Role, Signal, decide, raw_replicas

QUEUE = {"maxReplicas": 8, "target": {"queuedPromptTokensPerReplica": 2000}}
KV = {"maxReplicas": 8, "target": {"kvCacheUsage": 0.7}}


def spec(**over: Any) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate({"mode": "advisory", "prefill": QUEUE, "decode": KV} | over)


Sample = tuple[float, float | None, float | None]  # seconds, prefill's value, decode's value


def replay(
    autoscaling: AutoscalingSpec, series: Iterable[Sample], start: tuple[int, int] = (1, 1)
) -> list[Decision]:
    """Each sample decided on, its recommendation applied before the next (the fastest a cluster could)."""
    current: dict[Role, int] = dict(zip(ROLES, start, strict=True))
    history: dict[Role, tuple[tuple[float, int], ...]] = {}
    seen = []
    for at, prefill, decode in series:
        signals: dict[Role, Signal | None] = {
            role: None if value is None else Signal(value, at)
            for role, value in zip(ROLES, (prefill, decode), strict=True)
        }
        decision = decide(autoscaling, current, signals, history, at)
        history = dict(decision.history)
        current = {role: decision.roles[role].replicas for role in decision.roles}
        seen.append(decision)
    return seen


def counts(decisions: list[Decision]) -> list[tuple[int, int]]:
    return [(d.roles["prefill"].replicas, d.roles["decode"].replicas) for d in decisions]


def test_raw_counts_follow_the_hpa_rule_with_its_tolerance() -> None:
    assert raw_replicas(2, 9000, 2000, total=True) == 5  # 9000 queued tokens at 2000 a replica
    assert raw_replicas(2, 0, 2000, total=True) == 1  # nothing queued: the fewest
    assert raw_replicas(4, 0.9, 0.7, total=False) == 6  # 4 x 0.9 / 0.7 = 5.14
    assert raw_replicas(4, 0.75, 0.7, total=False) == 4  # within 10% of the target: stays
    assert raw_replicas(4, 0.6, 0.7, total=False) == 4  # 14% under, but 3.43 rounds up to 4
    assert raw_replicas(4, 0.3, 0.7, total=False) == 2


def test_a_burst_of_long_prompts_scales_prefill_up_at_once_and_down_after_the_window() -> None:
    burst = [(t, 12_000.0, 0.5) for t in range(0, 60, 10)]
    quiet = [(t, 0.0, 0.5) for t in range(60, 500, 10)]
    seen = counts(replay(spec(scaleDownStabilizationSeconds=300), burst + quiet))
    assert seen[0] == (6, 1)  # 12000 tokens at 2000 each, at the first sample
    first_down = next(i for i, (p, _) in enumerate(seen) if p < 6)
    assert quiet[first_down - len(burst)][0] - burst[-1][0] > 300  # not before the window passed
    assert seen[-1] == (1, 1)


def test_steady_load_holds_its_count_and_a_flapping_signal_moves_nothing() -> None:
    steady = counts(replay(spec(), [(t, 4000.0, 0.7) for t in range(0, 300, 10)], start=(2, 3)))
    assert set(steady) == {(2, 3)}
    flapping = [(t, 4000.0, 0.7 * (1.08 if t % 20 else 0.93)) for t in range(0, 300, 10)]
    assert set(counts(replay(spec(), flapping, start=(2, 3)))) == {(2, 3)}


def test_a_decode_spike_and_dip_goes_up_at_once_and_stays_through_the_window() -> None:
    series = [(0.0, 2000.0, 0.7), (10.0, 2000.0, 1.0), (20.0, 2000.0, 0.2), (30.0, 2000.0, 0.2)]
    seen = counts(replay(spec(), series, start=(1, 4)))
    assert [d for _, d in seen] == [4, 6, 6, 6]  # 4 x 1.0 / 0.7 = 5.7; the dip waits for the window


def test_a_missing_or_stale_signal_scales_nothing_and_says_why() -> None:
    autoscaling = spec()
    stale = Signal(50_000.0, at=0.0)
    decision = decide(autoscaling, {"prefill": 2, "decode": 2}, {"prefill": stale, "decode": None}, {}, 61.0)
    ages: dict[Role, str] = {"prefill": "61s old", "decode": "none"}
    for role, age in ages.items():
        found = decision.roles[role]
        assert (found.replicas, found.value) == (2, None)
        assert found.reason == f"no fresh signal ({age}); not scaled"
    assert decision.history == {"prefill": (), "decode": ()}


def test_min_and_max_bound_every_step() -> None:
    bounded = spec(prefill={"minReplicas": 2, "maxReplicas": 3, "target": QUEUE["target"]})
    seen = replay(bounded, [(0.0, 100_000.0, 0.7), (200.0, 0.0, 0.7), (400.0, 0.0, 0.7)])
    assert [c[0] for c in counts(seen)] == [3, 3, 2]
    assert "bounded to 3 (2..3)" in seen[0].roles["prefill"].reason


def test_the_ratio_bounds_raise_the_role_that_lacks_and_never_move_a_role_without_a_signal() -> None:
    ratio = spec(ratio={"minPrefillPerDecode": 0.5, "maxPrefillPerDecode": 1})
    # prefill wants 6 while decode wants 1: decode comes up to 6 (at most 1 prefill per decode)
    decision = replay(ratio, [(0.0, 12_000.0, 0.5)])[0]
    assert (decision.roles["prefill"].replicas, decision.roles["decode"].replicas) == (6, 6)
    assert decision.roles["decode"].reason.endswith("ratio 0.5..1 prefill per decode: 6")
    # decode at its max of 8 cannot follow prefill's 10: prefill comes back to 8
    wide = spec(prefill={"maxReplicas": 16, "target": QUEUE["target"]}, ratio={"maxPrefillPerDecode": 1})
    capped = replay(wide, [(0.0, 20_000.0, 0.5)])[0]
    assert (capped.roles["prefill"].replicas, capped.roles["decode"].replicas) == (8, 8)
    # decode without a signal is not moved: prefill gives way instead
    alone = decide(
        ratio, {"prefill": 1, "decode": 1}, {"prefill": Signal(12_000.0, 0.0), "decode": None}, {}, 0.0
    )
    assert (alone.roles["prefill"].replicas, alone.roles["decode"].replicas) == (1, 1)
    for step in counts(replay(ratio, [(t, 3000.0 * (t % 50), 0.9) for t in range(0, 600, 10)])):
        assert 0.5 <= step[0] / step[1] <= 1, step


def test_a_role_left_unconfigured_is_not_decided_on() -> None:
    only_decode = AutoscalingSpec.model_validate({"mode": "advisory", "decode": KV})
    decision = decide(only_decode, {"prefill": 3, "decode": 1}, {"decode": Signal(1.0, 0.0)}, {}, 0.0)
    assert set(decision.roles) == {"decode"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prefill": {"maxReplicas": 2, "target": {}}}, "exactly one target"),
        ({"decode": {"minReplicas": 3, "maxReplicas": 2, "target": {"kvCacheUsage": 0.5}}}, "may not exceed"),
        ({"decode": {"maxReplicas": 2, "target": {"kvCacheUsage": 1.5}}}, "less than or equal to 1"),
        ({"mode": "on"}, "Input should be 'off', 'advisory' or 'active'"),
    ],
)
def test_bad_autoscaling_is_refused_with_the_reason(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AutoscalingSpec.model_validate(bad)


def test_the_window_never_raises_a_role_past_what_is_asked_now() -> None:
    """Advisory mode applies nothing: a burst's count of 10 stays in the window, and a later ask of 5
    from 3 pods recommends 5, not 10 (an HPA's min(window max, max(current, raw)))."""
    history: dict[Role, tuple[tuple[float, int], ...]] = {"prefill": ((0.0, 10),)}
    decision = decide(spec(), {"prefill": 3, "decode": 1}, {"prefill": Signal(10_000.0, 60.0)}, history, 60.0)
    assert decision.roles["prefill"].replicas == 5
    down = decide(spec(), {"prefill": 8, "decode": 1}, {"prefill": Signal(2_000.0, 60.0)}, history, 60.0)
    assert down.roles["prefill"].replicas == 8  # down only to the window's highest (10), capped at 8
