"""The autoscaler's decision, pure: from each role's measured signal to the replicas it should run.

Each role on its own first, as an HPA would: its signal against its target gives a raw count
(`raw_replicas`), within a tolerance of the target the count stays. Then, in order:

1. scale-down stabilization: a role goes down only to the highest raw count of the window (so a
   dip in load does not shed pods that the next burst needs); up is not delayed;
2. the role's min and max;
3. the prefill:decode ratio bounds: a role outside them moves the other (up where it has room,
   else itself back), never a role that has no fresh signal.

A role without a fresh signal keeps its replicas and says why. The history of raw counts, which the
window reads, is returned updated; the caller keeps it between decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from dllm_operator.api.autoscaling import AutoscalingSpec, DecodeAutoscaling, PrefillAutoscaling, RatioBounds

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")
# Within this share of the target a role keeps its count (an HPA's default tolerance).
TOLERANCE = 0.1


@dataclass(frozen=True)
class Signal:
    """One role's measure for its target (see `measure_of`), and when it was taken (seconds)."""

    value: float
    at: float


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    current: int
    measure: str  # what was measured, e.g. "queued prompt tokens"
    value: float | None  # the measure's value; None: no fresh signal
    reason: str


@dataclass(frozen=True)
class Decision:
    roles: Mapping[Role, Recommendation]
    history: Mapping[Role, tuple[tuple[float, int], ...]] = field(default_factory=dict)


def raw_replicas(current: int, value: float, target: float, total: bool) -> int:
    """The count that brings the measure to its target: total / target for a total, else
    current * value / target; the current count while within TOLERANCE of the target."""
    load = value / target if total else current * value / target
    if current and abs(load / current - 1) <= TOLERANCE:
        return current
    return max(1, math.ceil(load - 1e-9))


def _stabilized(
    raw: int, current: int, history: tuple[tuple[float, int], ...], now: float, window: float
) -> int:
    """Down only to the highest count of the window, and never up past what is asked now (as an HPA:
    min(highest of the window, max(current, raw)))."""
    recent = [count for at, count in history if now - at <= window]
    return min(max([raw, *recent]), max(current, raw))


def decide(
    spec: AutoscalingSpec,
    current: Mapping[Role, int],
    signals: Mapping[Role, Signal | None],
    history: Mapping[Role, tuple[tuple[float, int], ...]],
    now: float,
) -> Decision:
    """The replicas each configured role should run now (see the module's docstring)."""
    out: dict[Role, Recommendation] = {}
    kept: dict[Role, tuple[tuple[float, int], ...]] = {}
    window = spec.scale_down_stabilization_seconds
    fresh: set[Role] = set()
    for role in ROLES:
        role_spec = spec.prefill if role == "prefill" else spec.decode
        if role_spec is None:
            continue
        measure, target, total = role_spec.target.measure()
        have, signal = current[role], signals.get(role)
        past = tuple((at, n) for at, n in history.get(role, ()) if now - at <= window)
        if signal is None or now - signal.at > spec.signal_max_age_seconds:
            age = "none" if signal is None else f"{now - signal.at:.0f}s old"
            out[role] = Recommendation(have, have, measure, None, f"no fresh signal ({age}); not scaled")
            kept[role] = past
            continue
        fresh.add(role)
        raw = raw_replicas(have, signal.value, target, total)
        kept[role] = (*past, (now, raw))
        wanted = _stabilized(raw, have, past, now, window)
        bounded = min(max(wanted, role_spec.min_replicas), role_spec.max_replicas)
        reason = f"{measure} {signal.value:g} against {target:g}: {raw}"
        if wanted != raw:
            reason += f", held at {wanted} (the highest of the last {window}s)"
        if bounded != wanted:
            reason += f", bounded to {bounded} ({role_spec.min_replicas}..{role_spec.max_replicas})"
        out[role] = Recommendation(bounded, have, measure, signal.value, reason)
    if spec.prefill is not None and spec.decode is not None:
        out = _within_ratio(spec.ratio, spec.prefill, spec.decode, out, fresh)
    return Decision(out, kept)


def _within_ratio(
    ratio: RatioBounds,
    prefill: PrefillAutoscaling,
    decode: DecodeAutoscaling,
    out: dict[Role, Recommendation],
    fresh: set[Role],
) -> dict[Role, Recommendation]:
    """Prefill per decode within the bounds: the role the ratio needs more of goes up as far as its max
    allows, then the other comes down to what that supports; a role without a fresh signal stays."""
    low, high = ratio.min_prefill_per_decode, ratio.max_prefill_per_decode
    p, d = out["prefill"].replicas, out["decode"].replicas
    if p > high * d and "decode" in fresh:  # too few decode: as many more as its max allows
        d = max(d, min(math.ceil(p / high - 1e-9), decode.max_replicas))
    if p > high * d and "prefill" in fresh:  # still too many prefill for them
        p = max(prefill.min_replicas, math.floor(high * d + 1e-9))
    if p < low * d and "prefill" in fresh:  # too few prefill
        p = max(p, min(math.ceil(low * d - 1e-9), prefill.max_replicas))
    if p < low * d and "decode" in fresh:
        d = max(decode.min_replicas, math.floor(p / low + 1e-9))
    note = f"; ratio {low:g}..{high:g} prefill per decode"
    counts: dict[Role, int] = {"prefill": p, "decode": d}
    for role, count in counts.items():
        if count != out[role].replicas:
            out[role] = replace(out[role], replicas=count, reason=out[role].reason + f"{note}: {count}")
    return out
