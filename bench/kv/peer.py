"""The driver's side of a worker process: starts it (in a network namespace, where asked) and calls
its commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[1] / "kv_transfer.py"  # run again as a worker: --serve


@dataclass(frozen=True)
class Settings:
    """What every worker of a run shares."""

    batch_tokens: int
    checksum: str
    threads: int
    consecutive_ids: bool = False  # decode's blocks in prefill's order: spans merge into runs
    in_flight_rows: bool = False  # Mooncake's pipe rows again, with RDMA's writes in flight


class Peer:
    def __init__(
        self, role: str, host: str, blocks: int, buffer_mb: int, netns: str | None, settings: Settings
    ) -> None:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        command = [*prefix, sys.executable, str(SCRIPT), "--serve", role, "--host", host]
        command += ["--blocks", str(blocks), "--buffer-mb", str(buffer_mb)]
        command += ["--batch-tokens", str(settings.batch_tokens), "--checksum", settings.checksum]
        command += ["--threads", str(settings.threads)]
        env = os.environ | {
            "MC_TCP_BIND_ADDRESS": host,
            "DLLM_KV_CODEC_KERNELS": os.environ.get("DLLM_KV_CODEC_KERNELS", "native"),
        }
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def wait_ready(self) -> None:
        assert self._reply() == {"ready": True}

    def _reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("benchmark worker exited")
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                if "error" in reply:
                    raise RuntimeError(reply["error"])
                return reply

    def call(self, cmd: str, **kwargs: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": cmd} | kwargs) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=30)
