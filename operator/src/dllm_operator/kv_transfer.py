"""KVTransferVerified and status.kvTransfer, from the KV check pages of the resource's router pods. Pure.

The router runs the check (dllm_router.kv_check): it already holds the engines' key and is the one pod
their NetworkPolicy admits, so the check needs no new credential and no wider policy. Each router pod
checks every ready pair on its own; the operator reads each ready router pod's page (kv_poll.py) and
keeps, for each pair, the latest verdict any of them gave. A page is the router's word about engines
the operator cannot see itself: it is parsed strictly and bounded, never trusted for more than display
and this condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from dllm_contract.kv_check import FAILURES, WORST_FIRST, Reason

CONDITION = "KVTransferVerified"
MAX_PAGE_BYTES = 256 * 1024
MAX_PAIRS = 256  # per page; a resource's pairs are prefill x decode pods
MAX_STATUS_PAIRS = 32  # in status: the failures first, so the object stays small at any scale
MAX_MESSAGE = 1000


def _cut(text: Any) -> Any:
    return text[:MAX_MESSAGE] if isinstance(text, str) else text


Message = Annotated[str, BeforeValidator(_cut)]
PodName = Annotated[str, Field(max_length=253)]


class PairVerdict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    prefill: PodName
    decode: PodName
    reason: Reason
    message: Message = ""
    checked_at: float = Field(alias="checkedAt", ge=0, allow_inf_nan=False)


class RouterPage(BaseModel):
    """GET /dllm/kv-check of one router pod (dllm_contract.kv_check.PAGE_PATH)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    enabled: bool
    reason: Reason
    message: Message = ""
    pairs: tuple[PairVerdict, ...] = Field((), max_length=MAX_PAIRS)


class PageInvalid(ValueError):
    """A router's page that is not what the contract says."""


def parse_page(raw: bytes) -> RouterPage:
    if len(raw) > MAX_PAGE_BYTES:
        raise PageInvalid(f"the page is over {MAX_PAGE_BYTES} bytes")
    try:
        return RouterPage.model_validate_json(raw)
    except ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(part) for part in problem["loc"]) or "body"
        raise PageInvalid(f"the page is not a KV check page: {field}: {problem['msg']}"[:300]) from None


@dataclass(frozen=True)
class KVCheckView:
    """What the operator knows of one resource's KV check.

    `checked`: the router is told to check (its flow and connector allow it, and the operator reads the
    pages); `pages`: each ready router pod's page, or why it could not be read, by pod name;
    `pod_names`: the engine pods' names by IP (the router names a pod by its address and port)."""

    checked: bool
    pages: Mapping[str, RouterPage | str]
    pod_names: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KVFinding:
    status: bool | None  # None: Unknown
    reason: str
    message: str
    pairs: tuple[PairVerdict, ...] = ()

    @property
    def failed(self) -> bool:
        return self.status is False and self.reason in FAILURES


def engine_pod_names(pods: Mapping[str, Iterable[Mapping[str, Any]]]) -> dict[str, str]:
    """The prefill and decode pods' names by IP, from the pods by component."""
    return {
        pod["status"]["podIP"]: pod["metadata"]["name"]
        for component in ("prefill", "decode")
        for pod in pods.get(component, ())
        if pod.get("status", {}).get("podIP") and pod.get("metadata", {}).get("name")
    }


def pod_name(address: str, pod_names: Mapping[str, str]) -> str:
    """The pod at "ip:port" (or "[ip]:port") by its name where it is known, else the address."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return pod_names.get(host, address)


def latest_per_pair(
    pages: Mapping[str, RouterPage | str], pod_names: Mapping[str, str] | None = None
) -> tuple[PairVerdict, ...]:
    """Each pair's latest verdict across the router pods, its pods named, sorted by pair."""
    names = pod_names or {}
    latest: dict[tuple[str, str], PairVerdict] = {}
    for page in pages.values():
        if isinstance(page, str):
            continue
        for pair in page.pairs:
            named = pair.model_copy(
                update={"prefill": pod_name(pair.prefill, names), "decode": pod_name(pair.decode, names)}
            )
            key = (named.prefill, named.decode)
            if key not in latest or named.checked_at > latest[key].checked_at:
                latest[key] = named
    return tuple(latest[key] for key in sorted(latest))


def finding(view: KVCheckView | None) -> KVFinding:
    if view is None or not view.checked:
        return KVFinding(
            None,
            "NotChecked",
            "the router checks the KV path in its dllm flow with this project's connectors",
        )
    if not view.pages:
        return KVFinding(None, "Pending", "no ready router pod's KV check has been read yet")
    read = {pod: page for pod, page in view.pages.items() if not isinstance(page, str)}
    if not read:
        errors = "; ".join(f"{pod}: {error}" for pod, error in sorted(view.pages.items()))
        return KVFinding(None, "RouterUnreachable", f"no router pod's KV check could be read: {errors}")
    off = sorted(pod for pod, page in read.items() if not page.enabled)
    if off:
        return KVFinding(None, "NotChecked", f"router pod {off[0]} does not run the KV check")
    pairs = latest_per_pair(read, view.pod_names)
    if not pairs:
        some = read[min(read)]
        return KVFinding(False, "NoCompletePair", some.message or "no pair checked yet")
    worst = min(pairs, key=lambda p: WORST_FIRST.index(p.reason) if p.reason in WORST_FIRST else 0)
    if worst.reason == "Verified":
        return KVFinding(True, "Verified", f"{len(pairs)} pairs verified; latest: {worst.message}", pairs)
    return KVFinding(False, worst.reason, f"{worst.prefill} -> {worst.decode}: {worst.message}", pairs)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_of(found: KVFinding) -> dict[str, Any]:
    """status.kvTransfer: the reason, and the pairs (failures first, at most MAX_STATUS_PAIRS)."""
    shown = sorted(found.pairs, key=lambda p: (p.reason == "Verified", p.prefill, p.decode))[
        :MAX_STATUS_PAIRS
    ]
    return {
        "reason": found.reason,
        "message": found.message[:4000],
        "pairs": [
            {
                "prefill": p.prefill,
                "decode": p.decode,
                "reason": p.reason,
                "message": p.message,
                "checkedAt": _iso(p.checked_at),
            }
            for p in shown
        ],
    }
