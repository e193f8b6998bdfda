"""NEW-10: a deleted auth Secret (a key rotation) is made again as soon as a pod reports it missing."""

from __future__ import annotations

import copy
from typing import Any

from dllm_operator.secret_missing import pods_wait_on_secret


def waiting(reason: str, message: str, *, init: bool = False) -> dict[str, Any]:
    status = {"name": "vllm", "state": {"waiting": {"reason": reason, "message": message}}}
    return {"status": {"initContainerStatuses" if init else "containerStatuses": [status]}}


def test_a_pod_that_cannot_start_for_the_missing_auth_secret_is_seen() -> None:
    missing = waiting("CreateContainerConfigError", 'secret "tiny-cpu-dllm-auth" not found')
    assert pods_wait_on_secret([{"status": {}}, missing], "tiny-cpu-dllm-auth")
    assert pods_wait_on_secret(
        [waiting("CreateContainerConfigError", 'secret "tiny-cpu-dllm-auth" not found', init=True)],
        "tiny-cpu-dllm-auth",
    )


def test_the_pods_looked_at_are_left_as_they_were() -> None:
    pod = waiting("CreateContainerConfigError", 'secret "hf-token" not found')
    pod["status"]["initContainerStatuses"] = [{"name": "init", "state": {"running": {}}}]
    before = copy.deepcopy(pod)
    assert not pods_wait_on_secret([pod, pod], "tiny-cpu-dllm-auth")
    assert pod == before


def test_other_secrets_and_other_waits_are_not_the_auth_secret() -> None:
    assert not pods_wait_on_secret(
        [waiting("CreateContainerConfigError", 'secret "hf-token" not found')], "tiny-cpu-dllm-auth"
    )
    assert not pods_wait_on_secret(
        [waiting("CreateContainerConfigError", 'secret "tiny-cpu-dllm-auth-x" not found')],
        "tiny-cpu-dllm-auth",
    )
    assert not pods_wait_on_secret(
        [waiting("ContainerCreating", 'secret "tiny-cpu-dllm-auth" not found')], "tiny-cpu-dllm-auth"
    )
    assert not pods_wait_on_secret([], "tiny-cpu-dllm-auth")
