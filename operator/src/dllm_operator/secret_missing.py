"""Whether a resource's pods wait on its auth Secret (NEW-10): deleted to rotate the keys, it would
otherwise come back only at the next full resync, and every restarting pod fails until then. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def pods_wait_on_secret(pods: Iterable[dict[str, Any]], secret: str) -> bool:
    """A container of these pods cannot start because Secret `secret` is missing (the kubelet's
    CreateContainerConfigError names it: `secret "<name>" not found`)."""
    wanted = f'secret "{secret}" not found'
    for pod in pods:
        status_of = pod.get("status", {})
        # A new list: the pods are the store's own, never to be changed here.
        statuses = [
            *(status_of.get("containerStatuses") or []),
            *(status_of.get("initContainerStatuses") or []),
        ]
        for status in statuses:
            waiting = status.get("state", {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError" and wanted in waiting.get("message", ""):
                return True
    return False
