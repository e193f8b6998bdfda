"""One process to another through the Mooncake transfer engine, nh64 compared on both sides."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpu.timing import gbps, seconds

MOONCAKE_TIMEOUT_S = 60.0
SCRIPT = Path(__file__).resolve().parents[1] / "gpu_check.py"  # run again as the receiver


def _engine(host: str) -> Any:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake initialize failed")
    return engine


def mooncake_receiver(device_name: str, nbytes: int) -> None:
    """The other process: registers a buffer on the device, names it, and hashes it when told."""
    import torch

    from dllm_connector.codec import device_checksum

    engine = _engine("127.0.0.1")
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device_name)
    location = "cpu:0" if buffer.device.type == "cpu" else f"cuda:{buffer.device.index or 0}"
    if engine.register_memory(buffer.data_ptr(), nbytes, location) != 0:
        raise RuntimeError("Mooncake could not register the receiver's buffer")
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    print(json.dumps({"session": session, "addr": buffer.data_ptr()}), flush=True)
    sys.stdin.readline()  # the sender's writes are done
    print(json.dumps({"checksum": device_checksum.tensor_checksum(buffer)}), flush=True)


def mooncake_row(device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    try:
        import mooncake.engine as engine_module
    except ImportError as error:
        return {"skipped": f"mooncake.engine does not import: {error}"}
    if device.type == "cuda" and not getattr(engine_module, "SUPPORT_CUDA", False):
        return {
            "skipped": "mooncake.engine is a build without CUDA (SUPPORT_CUDA false): "
            "device memory cannot be registered"
        }
    command = [sys.executable, str(SCRIPT), "--mooncake-receiver", str(device), "--bytes", str(nbytes)]
    receiver = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        return _send_to(receiver, device, nbytes, repeats)
    except Exception as error:  # noqa: BLE001 - reported in the row; the rest of the check stands
        return {"skipped": f"failed: {type(error).__name__}: {error}"}
    finally:
        receiver.kill()
        receiver.wait(timeout=30)


def _line(receiver: subprocess.Popen[str], timeout_s: float = MOONCAKE_TIMEOUT_S) -> dict[str, Any]:
    """The receiver's next JSON line, or {} if none comes within the timeout."""
    assert receiver.stdout is not None
    ready, _, _ = select.select([receiver.stdout], [], [], timeout_s)
    line = receiver.stdout.readline() if ready else ""
    return dict(json.loads(line)) if line.strip() else {}


def _send_to(receiver: subprocess.Popen[str], device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    import torch

    from dllm_connector.codec import device_checksum

    assert receiver.stdin is not None
    peer = _line(receiver)
    if "session" not in peer:
        return {"skipped": "the receiving process did not start (see stderr)"}
    engine = _engine("127.0.0.1")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    location = "cpu:0" if device.type == "cpu" else f"cuda:{device.index or 0}"
    if engine.register_memory(data.data_ptr(), nbytes, location) != 0:
        return {"skipped": "Mooncake could not register the sender's buffer"}

    def write() -> None:
        if engine.transfer_sync_write(peer["session"], data.data_ptr(), peer["addr"], nbytes) != 0:
            raise RuntimeError("Mooncake transfer_sync_write failed")

    elapsed = seconds(write, device, repeats)
    receiver.stdin.write("done\n")
    receiver.stdin.flush()
    theirs = _line(receiver).get("checksum")
    return {
        "memory": "device" if device.type == "cuda" else "host",
        "protocol": "tcp",
        "bytes": nbytes,
        "gbps": gbps(nbytes, elapsed),
        "checksum_equal": theirs == device_checksum.tensor_checksum(data),
    }
