"""A server-side dry-run create, shared by the admission policy and Pod Security tests."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from e2e.fixtures import Cluster


def create(cluster: Cluster, namespace: str, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    text = json.dumps(body)
    return cluster.run("create", "--dry-run=server", "-n", namespace, "-f", "-", input_text=text, check=False)
