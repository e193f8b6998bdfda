"""What the operator's k8s tests share: the real operator, as a process, watching the test's namespace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.fixtures import Cluster
from e2e.operator_process import OperatorProcess


@pytest.fixture
def operator(cluster: Cluster, crd: str, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace).start()
    yield process
    process.stop()
