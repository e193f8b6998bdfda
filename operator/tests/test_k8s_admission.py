"""The real API server admits what the model admits and refuses what it refuses, naming the field: the
CRD's schema and CEL rules on bad specs, its defaults, printer columns and explain text, and the rendered
children under server dry-run. The chart's policies are in test_k8s_admission_policy.py, Pod Security in
test_k8s_engine_security.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from dllm_cases import INVALID, SAMPLES, invalid_body, load_cr, minimal
from e2e.fixtures import Cluster

from dllm_operator.api import MAX_NAME_LENGTH, parse
from dllm_operator.render import render_all

pytestmark = pytest.mark.k8s


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_every_sample_is_admitted(cluster: Cluster, crd: str, namespace: str, path: Path) -> None:
    cluster.run("apply", "--server-side", "-n", namespace, "-f", "-", input_text=json.dumps(load_cr(path)))


def test_minimal_resource_is_admitted_and_defaulted_like_the_model(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(minimal()))
    stored = cluster.get_json("dllm", "minimal", "-n", namespace)
    # The API server's defaults and the model's defaults are the same values.
    assert parse(stored).spec == parse(minimal()).spec
    assert stored["spec"]["kvTransfer"]["port"] == 50051
    assert stored["spec"]["decode"]["enableChunkedPrefill"] is False


def test_a_name_of_the_longest_length_is_admitted(cluster: Cluster, crd: str, namespace: str) -> None:
    name = "a" * MAX_NAME_LENGTH  # one more is refused (INVALID's name-too-long)
    cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(minimal(name)))
    assert cluster.exists("dllm", name, "-n", namespace)


@pytest.mark.parametrize(("case", "patch", "path"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_resource_is_refused_naming_the_field(
    cluster: Cluster, crd: str, namespace: str, case: str, patch: dict[str, object], path: str
) -> None:
    body = invalid_body(patch, "bad")
    result = cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(body), check=False)
    assert result.returncode != 0, f"{case} was admitted"
    assert "no matches for kind" not in result.stderr
    # The whole path, not a prefix of a longer one (spec.model must not pass for spec.model.name).
    whole = rf"(?<![\w.\[]){re.escape(path)}(?![\w\[]|\.\w)"
    assert re.search(whole, result.stderr), f"{case}: {path} not named in: {result.stderr}"
    name = body["metadata"]["name"]
    assert not cluster.exists("dllm", name, "-n", namespace)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_rendered_children_pass_server_dry_run(
    cluster: Cluster, crd: str, namespace: str, path: Path
) -> None:
    body = load_cr(path)
    body["metadata"] |= {"namespace": namespace, "uid": "00000000-0000-0000-0000-000000000001"}
    manifests = render_all(parse(body))
    text = yaml.safe_dump_all(manifests)
    result = cluster.run(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager=dllm-operator",
        "-n",
        namespace,
        "-f",
        "-",
        input_text=text,
    )
    assert result.stdout.count("(server dry run)") == len(manifests)


def test_kubectl_explain_reads_well(cluster: Cluster, crd: str) -> None:
    text = cluster.run("explain", "dllm.spec.kvTransfer").stdout
    assert "How KV cache moves from prefill to decode" in text
    for field in ("connector", "compression", "bufferSizeGB", "timeoutMs", "async", "loadFailurePolicy"):
        assert f"  {field}\t" in text or f"  {field} " in text


def test_printer_columns(cluster: Cluster, crd: str, namespace: str) -> None:
    cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(minimal("cols")))
    header = cluster.run("get", "dllm", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PREFILL", "DECODE", "READY", "CONNECTOR", "KV", "AGE"]
