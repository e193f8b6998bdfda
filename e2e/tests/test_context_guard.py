"""The test suites run against another cluster only when told its context by name: a kubeconfig whose
current context was not allowed is refused before any test creates or deletes anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from e2e.fixtures import _foreign_cluster


def kubeconfig(tmp_path: Path, context: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": context, "context": {"cluster": "c", "user": "u"}}],
                "current-context": context,
            }
        )
    )
    return path


def test_without_a_foreign_kubeconfig_the_local_control_plane_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DLLM_E2E_KUBECONFIG", raising=False)
    assert _foreign_cluster() is None


@pytest.mark.parametrize("allowed", [None, "staging", ""])
def test_a_context_not_allowed_by_name_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, allowed: str | None
) -> None:
    monkeypatch.setenv("DLLM_E2E_KUBECONFIG", str(kubeconfig(tmp_path, "prod-eu")))
    if allowed is None:
        monkeypatch.delenv("DLLM_E2E_ALLOW_CONTEXT", raising=False)
    else:
        monkeypatch.setenv("DLLM_E2E_ALLOW_CONTEXT", allowed)
    with pytest.raises(pytest.UsageError, match=r"refusing to run against kube context 'prod-eu'.*"
                       r"DLLM_E2E_ALLOW_CONTEXT=prod-eu"):  # fmt: skip
        _foreign_cluster()


def test_the_allowed_context_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, "prod-eu")
    monkeypatch.setenv("DLLM_E2E_KUBECONFIG", str(path))
    monkeypatch.setenv("DLLM_E2E_ALLOW_CONTEXT", "prod-eu")
    cluster = _foreign_cluster()
    assert cluster is not None
    assert cluster.kubeconfig == path
    assert cluster.layout is None  # nothing of the local control plane is started or stopped


def test_an_unreadable_kubeconfig_has_no_context_and_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DLLM_E2E_KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("DLLM_E2E_ALLOW_CONTEXT", "prod-eu")
    with pytest.raises(pytest.UsageError, match="refusing to run against kube context ''"):
        _foreign_cluster()
