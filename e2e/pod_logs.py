"""Every log line of a set of pods, kept for as long as a test needs it, including pods a rollout or a
crash has already replaced (the cluster forgets a deleted pod's log, and a fault test's failure is
usually in the pod that is gone).

`PodLogs` follows each matching pod with `kubectl logs -f --timestamps` from the moment its container
has started, one file per pod instance (name and uid), and watches for new pods until it is closed.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from e2e.fixtures import Cluster

# What a failure message wants from a pod's log: errors (Mooncake's glog "E1206 ..." too), the
# connector's refusals and failed transfers, tracebacks, answers other than 200 and 503 (a refusal up
# front), and vLLM's shutdown; less what every engine logs at start.
NOTEWORTHY = re.compile(
    r"\bERROR\b|\bWARNING\b|Traceback|not loaded|KV (send|receive) \S+ failed|Z E\d{4} |\[shutdown\]"
    r"|\" (?!200|503)\d{3} "
)
NOISE = re.compile(
    r"Unknown vLLM environment variable|ulimit|DeprecationWarning|force killing"
    r"|Local segment descriptor not found"  # Mooncake's every start
)
# Pods of a roll live for minutes; each look is a kubectl process on a machine the engines share.
_LIST_PERIOD_S = 2.0


@dataclass
class _Follower:
    pod: str
    path: Path
    process: subprocess.Popen[bytes]
    sink: IO[bytes]


@dataclass
class PodLogs:
    """Follows the logs of every pod of `namespace` that `selector` matches, into `directory`."""

    cluster: Cluster
    namespace: str
    selector: str
    directory: Path
    _followers: dict[str, _Follower] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="pod-logs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for follower in self._followers.values():
            follower.process.terminate()
            follower.process.wait(timeout=30)
            follower.sink.close()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._follow_new_pods()
            self._stop.wait(_LIST_PERIOD_S)  # the period of a background lister, not a test's wait

    def _follow_new_pods(self) -> None:
        listed = self.cluster.run(
            "get", "pods", "-n", self.namespace, "-l", self.selector, "-o", "json", check=False, timeout=30
        )
        if listed.returncode != 0:
            return
        for pod in json.loads(listed.stdout).get("items", []):
            uid = str(pod["metadata"]["uid"])
            statuses = pod.get("status", {}).get("containerStatuses", [])
            started = any({"running", "terminated"} & set(s.get("state", {})) for s in statuses)
            if uid in self._followers or not started:
                continue
            name = str(pod["metadata"]["name"])
            path = self.directory / f"{name}-{uid[:8]}.log"
            sink = path.open("ab")
            command = [self.cluster.kubectl_path, "logs", "-f", "--timestamps", "-n", self.namespace, name]
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=self.cluster.env())
            self._followers[uid] = _Follower(name, path, process, sink)

    def files(self) -> list[Path]:
        return sorted(f.path for f in self._followers.values())

    def noteworthy(self, limit: int = 60, also: tuple[str, ...] = ()) -> str:
        """Each pod instance's noteworthy lines (and any line naming one of `also`, say request ids),
        the last `limit` of each, headed by the pod's file: what a failure message should show."""
        parts = []
        for path in self.files():
            lines = path.read_text(errors="replace").splitlines()
            kept = [
                line
                for line in lines
                if (NOTEWORTHY.search(line) and not NOISE.search(line)) or any(word in line for word in also)
            ]
            parts.append(f"--- {path.name}: {len(lines)} lines, {len(kept)} noteworthy ---")
            parts += kept[-limit:]
        return "\n".join(parts)


@contextmanager
def kept_logs(cluster: Cluster, namespace: str, selector: str, directory: Path) -> Iterator[PodLogs]:
    logs = PodLogs(cluster, namespace, selector, directory)
    logs.start()
    try:
        yield logs
    finally:
        logs.close()
