"""Surge rollouts on the real control plane (the StatefulSet controller, the scheduler, kwok's nodes):
a change of the KV fingerprint (compression none to fp8) rolls both roles with new pods first, and at
every moment observed there is a ready prefill pod and a ready decode pod of one fingerprint; at the
end every pod is new, each made once (the surge pods are the ones that stay), and each role has its
replicas again. A rollback rolls back the same way; a paused
rollout adds and replaces nothing."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from dllm_cases import ROOT, load_cr, merged
from e2e.fixtures import Cluster, holds_for, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import on_kwok_nodes

from dllm_operator.render import labels

pytestmark = pytest.mark.k8s
CPU_SAMPLE = ROOT / "crds" / "samples" / "cpu-tiny.yaml"


def surge_cr(prefill_replicas: int, decode_replicas: int, **rollout: Any) -> dict[str, Any]:
    spec = {
        "prefill": {"replicas": prefill_replicas},
        "decode": {"replicas": decode_replicas},
        "rollout": {"maxSurge": 1} | rollout,
    }
    return merged(on_kwok_nodes(load_cr(CPU_SAMPLE)), {"metadata": {"name": "surge"}, "spec": spec})


def pods(cluster: Cluster, namespace: str) -> dict[str, list[dict[str, Any]]]:
    items = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=surge")["items"]
    by_role: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for pod in items:
        role = pod["metadata"]["labels"].get(labels.COMPONENT)
        if role in by_role:
            by_role[role].append(pod)
    return by_role


def ready_fingerprints(role_pods: list[dict[str, Any]]) -> set[str]:
    return {
        p["metadata"]["labels"].get(labels.KV_FINGERPRINT, "")
        for p in role_pods
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    }


def fingerprint_of(cluster: Cluster, namespace: str) -> str:
    sts = cluster.get_json("statefulset", "surge-prefill", "-n", namespace)
    return str(sts["spec"]["template"]["metadata"]["labels"][labels.KV_FINGERPRINT])


def settled(cluster: Cluster, namespace: str, prefill: int, decode: int, fingerprint: str) -> bool:
    now = pods(cluster, namespace)
    for role, count in (("prefill", prefill), ("decode", decode)):
        live = [p for p in now[role] if not p["metadata"].get("deletionTimestamp")]
        if (
            len(live) != count
            or ready_fingerprints(live) != {fingerprint}
            or len(ready_fingerprints(live)) != 1
        ):
            return False
        sts = cluster.get_json("statefulset", f"surge-{role}", "-n", namespace)
        if sts["spec"]["replicas"] != count or sts["status"].get("readyReplicas") != count:
            return False
    return True


def patch_surge(cluster: Cluster, namespace: str, spec: dict[str, Any]) -> None:
    cluster.run("patch", "dllm", "surge", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))


def rollout_condition(cluster: Cluster, namespace: str) -> dict[str, Any]:
    cr = cluster.get_json("dllm", "surge", "-n", namespace)
    return next(
        (c for c in cr.get("status", {}).get("conditions", []) if c["type"] == "RolloutProgressing"), {}
    )


def up(cluster: Cluster, namespace: str, cr: dict[str, Any], prefill: int, decode: int) -> str:
    """The resource created and every pod ready: its fingerprint."""
    cluster.apply(cr, "-n", namespace)
    wait_until(
        lambda: cluster.exists("statefulset", "surge-prefill", "-n", namespace), 60, "the StatefulSets"
    )
    first = fingerprint_of(cluster, namespace)
    wait_until(lambda: settled(cluster, namespace, prefill, decode, first), 120, "the resource up")
    return first


def events(text: str) -> Iterator[dict[str, Any]]:
    """The watch events `kubectl get -w -o json --output-watch-events` printed, one JSON value each
    (those printed whole)."""
    decoder, at = json.JSONDecoder(), 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return
        try:
            event, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return  # the rest is still being printed
        yield event


def roll_watching_pairs(
    cluster: Cluster, namespace: str, patch: dict[str, Any], prefill: int, decode: int
) -> tuple[str, dict[str, int], dict[str, int], dict[str, int]]:
    """Patch the resource and watch every pod event until the rollout settles; after each event, some
    ready prefill pod and some ready decode pod must share a fingerprint. The new fingerprint, the most
    pods of each role alive at once, the fewest ready, and how many pods of each were made."""
    before = fingerprint_of(cluster, namespace)
    existing = {p["metadata"]["name"] for role in pods(cluster, namespace).values() for p in role}
    watch = subprocess.Popen(
        [cluster.kubectl_path, "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=surge",
         "--watch", "--output-watch-events", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=cluster.env(),
    )  # fmt: skip
    printed: list[str] = []
    stdout = watch.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: printed.extend(iter(stdout.readline, "")), daemon=True)
    reader.start()
    try:
        # the patch only once the watch has listed what is there: no event of the rollout is missed
        wait_until(lambda: len(list(events("".join(printed)))) >= len(existing), 30, "the watch's listing")
        patch_surge(cluster, namespace, patch)
        wait_until(lambda: fingerprint_of(cluster, namespace) != before, 30, "the new template applied")
        after = fingerprint_of(cluster, namespace)
        wait_until(lambda: settled(cluster, namespace, prefill, decode, after), 180, f"every pod at {after}")
    finally:
        watch.terminate()
        watch.wait(timeout=30)
        reader.join(timeout=30)
    out = "".join(printed)
    state: dict[str, dict[str, Any]] = {}
    made: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    most = {"prefill": 0, "decode": 0}
    least = {"prefill": prefill, "decode": decode}
    for number, event in enumerate(events(out)):
        pod = event["object"]
        if event["type"] == "DELETED":
            state.pop(pod["metadata"]["name"], None)
        else:
            state[pod["metadata"]["name"]] = pod
            role = pod["metadata"]["labels"].get(labels.COMPONENT, "")
            if pod["metadata"]["name"] not in existing and role in made:
                made[role].add(pod["metadata"]["uid"])
        if not existing <= state.keys():
            continue  # the watch's first listing is not complete yet
        by_role = {role: [p for p in state.values() if p["metadata"]["labels"].get(labels.COMPONENT) == role]
                   for role in most}  # fmt: skip
        for role, role_pods in by_role.items():
            most[role] = max(most[role], sum(not p["metadata"].get("deletionTimestamp") for p in role_pods))
            least[role] = min(least[role], sum(1 for p in role_pods if ready_fingerprints([p])))
        shared = ready_fingerprints(by_role["prefill"]) & ready_fingerprints(by_role["decode"])
        assert shared, f"no complete pair after event {number}: {event['type']} {pod['metadata']['name']}"
    return after, most, least, {role: len(uids) for role, uids in made.items()}


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 4), (4, 2)])
def test_a_fingerprint_change_rolls_both_roles_with_a_complete_pair_throughout(
    cluster: Cluster, namespace: str, operator: OperatorProcess, prefill: int, decode: int
) -> None:
    # maxSkew 25: the roles move in step; the rollout still completes (the role behind may always move)
    first = up(cluster, namespace, surge_cr(prefill, decode, maxSkew=25), prefill, decode)
    patched_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fp8, most, least, made = roll_watching_pairs(
        cluster, namespace, {"kvTransfer": {"compression": "fp8"}}, prefill, decode
    )
    assert fp8 != first
    assert most == {"prefill": prefill + 1, "decode": decode + 1}  # the surge pod, and no more
    assert least == {"prefill": prefill, "decode": decode}  # maxUnavailable 0: never one short
    assert made == {"prefill": prefill, "decode": decode}  # each new pod started once: one model load

    def status_shows_it_done() -> bool:
        status = cluster.get_json("dllm", "surge", "-n", namespace).get("status", {})
        roles = [(status.get(role, {}), count) for role, count in (("prefill", prefill), ("decode", decode))]
        times = status.get("rollout", {})
        return all(
            role.get("kvFingerprint") == fp8
            and role.get("podFingerprints") == [{"fingerprint": fp8, "pods": count, "ready": count}]
            for role, count in roles
        ) and patched_at <= times.get("startedAt", "~") <= times.get("completedAt", "")  # kwok: within 1 s

    wait_until(
        status_shows_it_done, 60, "status: both roles' pods at the fp8 fingerprint, the rollout's times"
    )
    back, most, _, made = roll_watching_pairs(
        cluster, namespace, {"kvTransfer": {"compression": "none"}}, prefill, decode
    )
    assert back == first  # a rollback is the same template, so the same fingerprint
    assert most == {"prefill": prefill + 1, "decode": decode + 1}
    assert made == {"prefill": prefill, "decode": decode}
    wait_until(lambda: rollout_condition(cluster, namespace).get("reason") == "Complete", 30, "Complete said")


def test_a_change_that_keeps_the_fingerprint_rolls_only_its_role_with_a_surge_pod_first(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """decode's maxNumSeqs is not in the KV fingerprint: decode's pod is replaced, prefill's is not
    touched, and the fingerprint stays."""
    first = up(cluster, namespace, surge_cr(1, 1), 1, 1)
    prefill_uids = {p["metadata"]["uid"] for p in pods(cluster, namespace)["prefill"]}
    decode_uids = {p["metadata"]["uid"] for p in pods(cluster, namespace)["decode"]}
    revision = cluster.get_json("statefulset", "surge-decode", "-n", namespace)["status"]["updateRevision"]
    patch_surge(cluster, namespace, {"decode": {"maxNumSeqs": 6}})

    def decode_replaced() -> bool:
        sts = cluster.get_json("statefulset", "surge-decode", "-n", namespace)
        now = {p["metadata"]["uid"] for p in pods(cluster, namespace)["decode"]}
        return (
            sts["status"].get("updateRevision") != revision
            and not now & decode_uids
            and settled(cluster, namespace, 1, 1, first)
        )

    wait_until(decode_replaced, 180, "decode's pod replaced, every pod ready at the same fingerprint")
    assert fingerprint_of(cluster, namespace) == first
    assert {p["metadata"]["uid"] for p in pods(cluster, namespace)["prefill"]} == prefill_uids


def test_per_role_budgets_one_role_replacing_in_place_the_other_surging_two(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Prefill 2 without surge, one pod short at most; decode 4 with two surge pods: a pair throughout."""
    budgets = {"maxSurge": 0, "prefill": {"maxUnavailable": 1}, "decode": {"maxSurge": 2}}
    first = up(cluster, namespace, surge_cr(2, 4, **budgets), 2, 4)
    fp8, most, least, made = roll_watching_pairs(
        cluster, namespace, {"kvTransfer": {"compression": "fp8"}}, 2, 4
    )
    assert fp8 != first
    assert most == {"prefill": 2, "decode": 6}
    assert least == {"prefill": 1, "decode": 4}
    assert made == {"prefill": 2, "decode": 4}


def test_a_paused_rollout_adds_and_replaces_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    first = up(cluster, namespace, surge_cr(1, 1, paused=True), 1, 1)
    names = {p["metadata"]["uid"] for role in pods(cluster, namespace).values() for p in role}
    patch = {"kvTransfer": {"compression": "fp8"}}
    cluster.run("patch", "dllm", "surge", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": patch}))

    def changed() -> bool:
        return {p["metadata"]["uid"] for role in pods(cluster, namespace).values() for p in role} != names

    assert not holds_for(changed, 5), "a paused rollout changed the pods"
    wait_until(lambda: rollout_condition(cluster, namespace).get("reason") == "Paused", 30, "Paused said")
    patch_surge(cluster, namespace, {"rollout": {"paused": False}})
    wait_until(
        lambda: (
            settled(cluster, namespace, 1, 1, fingerprint_of(cluster, namespace))
            and fingerprint_of(cluster, namespace) != first
        ),
        120,
        "the rollout done once resumed",
    )


def test_a_rollout_whose_new_pods_never_come_up_stops_at_its_deadline_and_undoing_it_heals(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """A change no node can take (prefill's new pods unschedulable): the surge pod stays Pending, the
    old pods serve on, and past progressDeadlineSeconds the rollout is stopped and says so; undoing
    the change brings the resource back to Complete with its old pods untouched."""
    up(cluster, namespace, surge_cr(1, 1, progressDeadlineSeconds=30), 1, 1)
    old = {p["metadata"]["uid"] for role in pods(cluster, namespace).values() for p in role}
    nowhere = {"prefill": {"nodeSelector": {"dllm.dev/no-such-node": "x"}}}
    cluster.run(
        "patch", "dllm", "surge", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": nowhere})
    )
    stopped = wait_until(
        lambda: (
            (c := rollout_condition(cluster, namespace)).get("reason") == "ProgressDeadlineExceeded" and c
        ),
        120,
        "the rollout stopped at its deadline",
    )
    assert "surge-prefill" in stopped["message"], stopped
    cr = cluster.get_json("dllm", "surge", "-n", namespace)
    degraded = next(c for c in cr["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True", degraded
    live = {p["metadata"]["uid"] for role in pods(cluster, namespace).values() for p in role}
    assert old <= live  # the old pods serve on
    undo = {"prefill": {"nodeSelector": {"dllm.dev/no-such-node": None}}}
    cluster.run("patch", "dllm", "surge", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": undo}))
    wait_until(
        lambda: rollout_condition(cluster, namespace).get("reason") == "Complete", 120, "Complete again"
    )
    # the old pods untouched, and the surge pod (made again from the undone template) gone once it has
    # drained: Complete may be said while it still terminates
    wait_until(
        lambda: {p["metadata"]["uid"] for role in pods(cluster, namespace).values() for p in role} == old,
        60,
        "the old pods alone",
    )
