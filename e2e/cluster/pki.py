"""The local control plane's certificates (openssl), its admin kubeconfig and its audit policy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from e2e.cluster.layout import Layout
from e2e.cluster.nodeconfig import HOST_IP


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=dllm-local-ca",
        cwd=pki,
    )
    sans = (
        f"subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:{HOST_IP},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n"
    )
    (pki / "server.ext").write_text(sans)
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject, ext in (
        ("apiserver", "/CN=kube-apiserver", "server.ext"),
        ("admin", "/O=system:masters/CN=dllm-admin", "client.ext"),
        ("kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "client.ext"),
    ):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            subject,
            cwd=pki,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-extfile",
            ext,
            "-out",
            f"{name}.crt",
            cwd=pki,
        )
    openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(layout: Layout) -> None:
    pki = layout.state / "pki"
    # JSON is YAML: no YAML library needed.
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "dllm-local",
        "clusters": [{"name": "dllm-local", "cluster": {
            "server": layout.server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": "dllm-admin", "user": {
            "client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")}}],
        "contexts": [{"name": "dllm-local", "context": {"cluster": "dllm-local", "user": "dllm-admin"}}],
    }  # fmt: skip
    layout.kubeconfig.write_text(json.dumps(config, indent=2))


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}
