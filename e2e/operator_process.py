"""The real operator (`python -m dllm_operator run`) as a subprocess, for tests and the demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import IO

from e2e.fixtures import wait_until
from e2e.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


class OperatorProcess:
    def __init__(
        self,
        kubeconfig: Path,
        namespaces: list[str],
        log_path: Path,
        lease_namespace: str,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.kubeconfig, self.namespaces, self.log_path = kubeconfig, namespaces, log_path
        self.lease_namespace, self.extra_args = lease_namespace, extra_args
        self.env = env or {}
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> OperatorProcess:
        args = [
            sys.executable,
            "-m",
            "dllm_operator",
            "run",
            "--kubeconfig",
            str(self.kubeconfig),
            "--health-host",
            "127.0.0.1",
            "--health-port",
            str(self.port),
            "--lease-namespace",
            self.lease_namespace,
            *self.extra_args,
        ]
        for namespace in self.namespaces:
            args += ["--namespace", namespace]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        # No reads of the routers' KV check pages, nor of metrics for autoscaling, from this machine:
        # kwok's pods have made-up addresses that route off it. The chart's operator, in the real node's
        # namespace, reads them there.
        env |= {
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            "DLLM_KV_CHECK_POLL_SECONDS": "0",
            "DLLM_AUTOSCALE_POLL_SECONDS": "0",
            # kwok's pods meet no router that must find them first: a rollout need not wait on them
            "DLLM_ROLLOUT_SETTLE_SECONDS": "0",
        }
        env |= self.env
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        wait_until(self.ready, 60, f"the operator's /readyz (log: {self.log_path})")
        return self

    def _get(self, path: str) -> str | None:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"the operator exited; log:\n{self.log_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as response:
                return str(response.read().decode())
        except OSError:
            return None

    def ready(self) -> bool:
        return self._get("/readyz") == "ok"

    def metric(self, name: str) -> float:
        """An unlabelled sample's value; a page that does not answer or lacks it fails the test (never
        reads as 0, which would let a broken replica pass for an idle follower)."""
        text = self._get("/metrics")
        if text is None:
            raise AssertionError(f"the operator's /metrics on port {self.port} does not answer")
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
        if not values:
            raise AssertionError(f"{name} is not on the operator's /metrics page")
        return values[0]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a node loss would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None
