"""The control plane's components as detached processes: a pid file and a log each under the state
folder, so one component can be stopped, killed (as a crash would) or restarted alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from e2e.cluster.layout import COMPONENTS, ClusterError, Layout, wait_for


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # the process may end between the signal and this read
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[-1]
    except OSError:
        return False
    return not state.startswith("Z")


def read_pid(layout: Layout, component: str) -> int | None:
    try:
        return int(layout.pidfile(component).read_text())
    except (FileNotFoundError, ValueError):
        return None


def running_components(layout: Layout) -> list[str]:
    return [c for c in COMPONENTS if (pid := read_pid(layout, c)) is not None and pid_alive(pid)]


def spawn(layout: Layout, component: str, argv: list[str]) -> None:
    """Start a component detached (own session, so it survives the caller), logging to its file."""
    layout.cmdfile(component).write_text(json.dumps(argv))
    with layout.log(component).open("ab") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=layout.state,
        )
    layout.pidfile(component).write_text(str(process.pid))


def stop_component(layout: Layout, component: str, timeout: float = 20) -> None:
    pid = read_pid(layout, component)
    if pid is None or not pid_alive(pid):
        layout.pidfile(component).unlink(missing_ok=True)
        return
    os.killpg(pid, signal.SIGTERM)
    try:
        wait_for(lambda: not pid_alive(pid), timeout, f"{component} to stop")
    except ClusterError:
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, f"{component} to die")
    layout.pidfile(component).unlink(missing_ok=True)


def kill_component(layout: Layout, component: str) -> None:
    """SIGKILL, as a crash would."""
    pid = read_pid(layout, component)
    if pid is not None and pid_alive(pid):
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, f"{component} to die")
