"""What the CR's status says of a pod: broken (named, with the reason) or merely starting."""

from __future__ import annotations

from typing import Any

from dllm_operator.status import pod_problem


def pod(*container_statuses: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny-cpu-decode-0"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": list(container_statuses),
        },
    }


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
