"""`make demo`: the whole control flow on the local control plane, as a user would run it.

1. the local control plane (built once per machine, then reused), 2. `helm install` of the chart (CRD,
RBAC, the operator Deployment), 3. the operator itself on this host, with the chart's ServiceAccount
identity (kwok runs no containers, so the operator pod Helm creates is only a placeholder here),
4. the CPU sample applied, 5. its status shown until Ready, 6. the children and the KV env of each role.
`make demo-down` (python -m e2e.demo down) stops the operator, uninstalls, and stops the control plane.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from e2e.cluster import controlplane as cp

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "dllm-operator"
SAMPLE = ROOT / "crds" / "samples" / "cpu-tiny.yaml"
SYSTEM_NAMESPACE = "dllm-system"
RELEASE = "dllm"
_PAUSE = threading.Event()  # never set: wait(t) is an interruptible pause


def step(message: str, started: float) -> None:
    print(f"\n==> [{time.monotonic() - started:5.1f}s] {message}", flush=True)


def run(layout: cp.Layout, tool: str, *args: str, check: bool = True, quiet: bool = False) -> str:
    binary = str(layout.tools_bin / tool)
    result = subprocess.run(
        [binary, f"--kubeconfig={layout.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check and result.returncode != 0:
        raise SystemExit(f"{tool} {' '.join(args)} failed:\n{result.stderr}")
    if not quiet and result.stdout.strip():
        print(result.stdout.rstrip(), flush=True)
    return result.stdout


def operator_paths(layout: cp.Layout) -> tuple[Path, Path, Path]:
    base = layout.state / "demo"
    base.mkdir(parents=True, exist_ok=True)
    return base / "operator.pid", base / "operator.log", base / "operator.kubeconfig"


def service_account_kubeconfig(layout: cp.Layout, path: Path) -> Path:
    """A kubeconfig holding only a TokenRequest token of the chart's ServiceAccount."""
    token = run(
        layout,
        "kubectl",
        "create",
        "token",
        f"{RELEASE}-dllm-operator",
        "-n",
        SYSTEM_NAMESPACE,
        "--duration=24h",
        quiet=True,
    ).strip()
    config = json.loads(
        run(layout, "kubectl", "config", "view", "--raw", "--minify", "-o", "json", quiet=True)
    )
    config["users"] = [{"name": "dllm-operator", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "dllm-operator"
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def start_operator(layout: cp.Layout, started: float) -> Path:
    pid_file, log_file, kubeconfig = operator_paths(layout)
    stop_operator(layout)
    service_account_kubeconfig(layout, kubeconfig)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env |= {
        "PYTHONUNBUFFERED": "1",
        "POD_NAMESPACE": SYSTEM_NAMESPACE,
        "DLLM_ENGINE_IMAGE": "ghcr.io/dllm-operator/vllm:0.1.0",
    }
    with log_file.open("ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dllm_operator",
                "run",
                "--all-namespaces",
                "--kubeconfig",
                str(kubeconfig),
                "--health-host",
                "127.0.0.1",
                "--health-port",
                "18080",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
    pid_file.write_text(str(process.pid))
    step(
        f"operator running on this host as system:serviceaccount:{SYSTEM_NAMESPACE}:{RELEASE}-dllm-operator "
        f"(pid {process.pid}, log {log_file})",
        started,
    )
    return log_file


def stop_operator(layout: cp.Layout) -> None:
    pid_file, _, _ = operator_paths(layout)
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    if cp.pid_alive(pid):
        os.killpg(pid, signal.SIGTERM)
        cp.wait_for(lambda: not cp.pid_alive(pid), 20, "the demo operator to stop")
    pid_file.unlink()


def describe_status(cr: dict[str, object]) -> str:
    status = cr.get("status") or {}
    assert isinstance(status, dict)
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    ready = conditions.get("Ready", {})
    counts = ", ".join(
        f"{role} {status.get(role, {}).get('ready', '-')}" for role in ("prefill", "decode", "router")
    )
    return f"{counts}, Ready={ready.get('status', '?')} ({ready.get('reason', 'waiting for the operator')})"


def wait_ready(layout: cp.Layout, namespace: str, name: str, timeout: float, log_file: Path) -> None:
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        cr = json.loads(
            run(layout, "kubectl", "get", "dllm", name, "-n", namespace, "-o", "json", quiet=True)
        )
        line = describe_status(cr)
        if line != last:
            print(f"    {line}", flush=True)
            last = line
        if "Ready=True" in line:
            return
        _PAUSE.wait(0.5)
    raise SystemExit(f"{name} not Ready after {timeout:.0f}s; operator log: {log_file}")


def print_kv_env(layout: cp.Layout, namespace: str, name: str) -> None:
    for role in ("prefill", "decode"):
        sts = json.loads(
            run(layout, "kubectl", "get", "sts", f"{name}-{role}", "-n", namespace, "-o", "json", quiet=True)
        )
        container = sts["spec"]["template"]["spec"]["containers"][0]
        print(
            f"\n--- {role}: KV-transfer env of {name}-{role} (dllm-serve turns it into --kv-transfer-config)"
        )
        for var in container["env"]:
            value = var.get("value") or f"<{next(iter(var.get('valueFrom', {})))}>"
            if var["name"].startswith(("VLLM_", "MOONCAKE_", "MC_", "DLLM_")):
                print(f"    {var['name']}={value}")
        print(f"    engine args: {' '.join(container['args'][1:])}")


def up(namespace: str, timeout: float) -> None:
    started = time.monotonic()
    step(
        "local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok) on 127.0.0.1",
        started,
    )
    layout = cp.up()
    step(
        f"helm install {RELEASE} charts/dllm-operator (CRD, least-privilege RBAC, operator Deployment)",
        started,
    )
    run(
        layout,
        "helm",
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout=120s",
        quiet=True,
    )
    run(
        layout,
        "kubectl",
        "wait",
        "--for=condition=Established",
        "crd/disaggregatedllms.disagg.dev",
        "--timeout=60s",
        quiet=True,
    )
    log_file = start_operator(layout, started)
    step(f"kubectl apply -n {namespace} -f crds/samples/cpu-tiny.yaml", started)
    run(layout, "kubectl", "create", "namespace", namespace, check=False, quiet=True)
    run(layout, "kubectl", "apply", "--server-side", "-n", namespace, "-f", str(SAMPLE))
    step("waiting until tiny-cpu is Ready", started)
    wait_ready(layout, namespace, "tiny-cpu", timeout, log_file)
    step(f"kubectl get dllm,statefulsets,pods,svc -n {namespace}", started)
    run(layout, "kubectl", "get", "dllm,statefulsets,pods,svc", "-n", namespace)
    print_kv_env(layout, namespace, "tiny-cpu")
    step(
        f'done. Try: eval "$(make -s cluster-env)"; kubectl get dllm -n {namespace}; make demo-down', started
    )


def down(namespace: str, keep_cluster: bool) -> None:
    layout = cp.Layout.from_env()
    if set(cp.running_components(layout)) == set(cp.COMPONENTS):
        stop_operator(layout)
        run(
            layout,
            "kubectl",
            "delete",
            "namespace",
            namespace,
            "--ignore-not-found",
            "--wait=false",
            quiet=True,
        )
        run(layout, "helm", "uninstall", RELEASE, "-n", SYSTEM_NAMESPACE, "--ignore-not-found", quiet=True)
    if not keep_cluster:
        cp.down()
    print("demo stopped", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo")
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--namespace", default=os.environ.get("DLLM_DEMO_NAMESPACE", "demo"))
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--keep-cluster", action="store_true", help="down: leave the control plane running")
    args = parser.parse_args()
    try:
        if args.command == "up":
            up(args.namespace, args.timeout)
        else:
            down(args.namespace, args.keep_cluster)
    except cp.ClusterError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
