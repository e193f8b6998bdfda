"""What the CR's status says of a pod (broken, named with the reason, or merely starting), and of a
role whose workload has not yet counted a pod's change."""

from __future__ import annotations

from typing import Any

from dllm_cases import minimal
from status_cases import pod, sample_status

from dllm_operator.api import parse
from dllm_operator.render import render_all
from dllm_operator.status import missing_pods, pod_problem, workloads_by_component


def test_a_pod_loading_its_model_is_not_a_problem() -> None:
    assert pod_problem(pod({"name": "engine", "ready": False, "started": False, "restartCount": 0})) is None


def test_a_killed_engine_that_is_not_back_is_named_with_how_it_ended() -> None:
    killed = {"name": "engine", "ready": False, "started": False, "restartCount": 1,
              "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}}}  # fmt: skip
    assert pod_problem(pod(killed)) == "tiny-cpu-decode-0 restarting: container engine Error (exit code 137)"


def test_an_engine_back_after_a_restart_is_fine_again() -> None:
    back = {"name": "engine", "ready": True, "started": True, "restartCount": 1,
            "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}}}  # fmt: skip
    assert pod_problem(pod(back, ready=True)) is None


def test_a_crash_loop_is_named_with_its_reason() -> None:
    looping = {"name": "engine", "ready": False, "restartCount": 3,
               "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}}}  # fmt: skip
    assert pod_problem(pod(looping)) == "tiny-cpu-decode-0 CrashLoopBackOff: back-off 40s"


def status_of(decode_pod_ready: bool) -> dict[str, Any]:
    return sample_status(decode_pod_ready)


def test_a_pod_not_ready_before_its_statefulset_counted_it_makes_its_role_not_ready() -> None:
    """The StatefulSet still says 1/1 ready; the pod says it is not: the status believes the pod, so
    Ready never stands beside a Degraded naming that pod."""
    status = status_of(decode_pod_ready=False)
    found = {c["type"]: c for c in status["conditions"]}
    assert found["Degraded"]["status"] == "True"
    assert "tiny-cpu-decode-0 not ready" in found["Degraded"]["message"]
    assert (found["DecodeReady"]["status"], found["Ready"]["status"], found["PrefillReady"]["status"]) == (
        "False",
        "False",
        "True",
    )
    assert status["decode"]["ready"] == "0/1"
    ready = {c["type"]: c["status"] for c in status_of(decode_pod_ready=True)["conditions"]}
    assert (ready["Ready"], ready["Degraded"], status_of(True)["decode"]["ready"]) == ("True", "False", "1/1")


def test_workloads_are_found_by_their_component_label_not_by_their_name() -> None:
    """By the component label each workload carries, whatever the CR is named."""
    uid = "00000000-0000-0000-0000-000000000001"
    cr = parse({**minimal("x-prefill"), "metadata": {"name": "x-prefill", "namespace": "ns", "uid": uid}})
    children = render_all(cr)
    found = workloads_by_component(children)
    assert {c: w["metadata"]["name"] for c, w in found.items()} == {
        "prefill": "x-prefill-prefill",
        "decode": "x-prefill-decode",
        "router": "x-prefill-router",
    }
    services = [c for c in children if c["kind"] == "Service"]
    assert workloads_by_component(services) == {}


def test_pods_going_do_not_stand_in_for_a_pod_the_statefulset_could_not_make() -> None:
    """After a rollout moved the window, an old pod drains while the new one above it fails to be
    created (say, a quota): the draining pod does not hide the failure."""
    sts = {"spec": {"replicas": 2}}
    draining = {"metadata": {"name": "x-decode-1", "deletionTimestamp": "2026-12-07T00:00:00Z"}}
    assert missing_pods(sts, [{"metadata": {"name": "x-decode-2"}}, draining])
    assert not missing_pods(sts, [{"metadata": {"name": "x-decode-2"}}, {"metadata": {"name": "x-decode-3"}}])
