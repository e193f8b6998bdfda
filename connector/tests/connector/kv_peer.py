"""A prefill worker in its own process for the two-process KV tests, and the shared test KV.

Run as a script: `python kv_peer.py mooncake|gloo` reads one JSON spec per stdin line, sends its
jobs and answers with one JSON line: {"transfer_id", "error"} per job, then the sender's stats.
A spec with "tp" runs several prefill TP ranks at once, each with its own transport, its own
share of a full model's KV heads and its own lines (tagged with "rank"). `Prefill` drives the
process from a test. Two test doubles live here, named as such: CorruptingSender flips one
payload byte after its checksum was taken; DyingSender exits the process after decode accepted,
before writing.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dllm_connector.layout import Geometry, PagedKV, TPRank, rank_heads
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.base import Source, Span, Transport
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import PathSetting
from dllm_connector.transport.torchdist import TorchDistTransport
from dllm_contract.kvconfig import Compression

HOST = "127.0.0.1"
LAYERS = 4
NUM_BLOCKS = 512
GEOMETRY = Geometry(block_size=16, num_kv_heads=2, head_dim=64, model="tiny-test")


def cpu_layer_shape(geometry: Geometry = GEOMETRY) -> tuple[int, ...]:
    """vLLM's CPU backend: [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    return (NUM_BLOCKS, geometry.num_kv_heads, geometry.block_size, 2 * geometry.head_dim)


def make_caches(seed: int | None, geometry: Geometry = GEOMETRY) -> dict[str, torch.Tensor]:
    """Per-layer paged KV: deterministic random values for a seed, zeros for None."""
    caches = {}
    for layer in range(LAYERS):
        if seed is None:
            caches[f"model.layers.{layer}.self_attn"] = torch.zeros(
                cpu_layer_shape(geometry), dtype=torch.bfloat16
            )
        else:
            generator = torch.Generator().manual_seed(seed * 1000 + layer)
            values = torch.randn(cpu_layer_shape(geometry), generator=generator) * (layer + 1)
            caches[f"model.layers.{layer}.self_attn"] = values.to(torch.bfloat16)
    return caches


# The TP tests: a full model of 8 KV heads, split over the ranks as vLLM splits it.
TP_GEOMETRY = Geometry(block_size=16, num_kv_heads=8, head_dim=32, model="tiny-tp-test", total_kv_heads=8)
TP_LAYERS = 3
TP_BLOCKS = 96
LAYOUTS = ("cpu", "nhd")  # vLLM CPU [blocks, H, T, 2D]; GPU flash NHD [2, blocks, T, H, D]
_HEAD_AXIS = {"cpu": 1, "nhd": 3}
# "mla": DeepSeek's latent, [blocks, T, 576]: one "head", the same on every TP rank
MLA_GEOMETRY = Geometry(block_size=16, num_kv_heads=1, head_dim=576, model="tiny-mla-test", total_kv_heads=1)


def layout_geometry(layout: str, geometry: Geometry = TP_GEOMETRY) -> Geometry:
    return MLA_GEOMETRY if layout == "mla" else geometry


def model_layer_shape(layout: str, heads: int, geometry: Geometry = TP_GEOMETRY) -> tuple[int, ...]:
    if layout == "mla":
        return (TP_BLOCKS, geometry.block_size, geometry.head_dim)
    if layout == "cpu":
        return (TP_BLOCKS, heads, geometry.block_size, 2 * geometry.head_dim)
    return (2, TP_BLOCKS, geometry.block_size, heads, geometry.head_dim)


def full_model_kv(seed: int, layout: str, geometry: Geometry = TP_GEOMETRY) -> list[torch.Tensor]:
    """Every layer's KV over all the model's heads: deterministic random values for a seed."""
    shape = model_layer_shape(layout, geometry.model_kv_heads, geometry)
    layers = []
    for layer in range(TP_LAYERS):
        generator = torch.Generator().manual_seed(seed * 1000 + layer)
        layers.append((torch.randn(shape, generator=generator) * (layer + 1)).to(torch.bfloat16))
    return layers


def heads_of(tensor: torch.Tensor, layout: str, heads: tuple[int, int]) -> torch.Tensor:
    """The part of a full-model layer that holds model heads [start, stop) (MLA's latent: all of it)."""
    if layout == "mla":
        return tensor
    return tensor.narrow(_HEAD_AXIS[layout], heads[0], heads[1] - heads[0])


def rank_kv(seed: int | None, layout: str, tp: TPRank, geometry: Geometry = TP_GEOMETRY) -> PagedKV:
    """TP rank `tp`'s paged KV: its heads of the full model for a seed, zeros for None."""
    geometry = layout_geometry(layout, geometry)
    heads = rank_heads(geometry.model_kv_heads, tp.size, tp.rank)
    count = heads[1] - heads[0]
    if seed is None:
        layers = [torch.zeros(model_layer_shape(layout, count, geometry), dtype=torch.bfloat16)] * TP_LAYERS
        layers = [layer.clone() for layer in layers]
    else:
        layers = [
            heads_of(layer, layout, heads).contiguous() for layer in full_model_kv(seed, layout, geometry)
        ]
    caches = {f"model.layers.{index}.self_attn": layer for index, layer in enumerate(layers)}
    return PagedKV(caches, TP_BLOCKS, replace(geometry, num_kv_heads=count), tp=tp)


def make_transport(kind: str) -> Transport:
    if kind == "mooncake":
        return MooncakeTransport(HOST)
    return TorchDistTransport(HOST, backend="gloo", connect_timeout=10)


class CorruptingSender(KVSender):
    """Test double: flips a byte of the outgoing KV (of each piece of the first batch) after it was
    hashed and before it is written: the first span, which holds codes or blocks, never scales."""

    def _before_write(self, index: int, src: Sequence[Source]) -> None:
        if index == 0:
            target = src[0]
            if isinstance(target, Span):
                ctypes.c_ubyte.from_address(target.addr + 7).value ^= 0x40
            else:
                target[7] ^= 0x40


class DyingSender(KVSender):
    """Test double: exits the process right after decode accepted, before writing anything."""

    def _before_write(self, index: int, src: Sequence[Source]) -> None:
        os._exit(3)


class NaNKV:
    """Test double input: the prefill KV holds a NaN, which fp8/int8 cannot encode."""

    @staticmethod
    def poison(kv: PagedKV) -> None:
        kv.caches[0].view(-1)[:: 1 << 14] = float("nan")


def pipe_config(data_path: PathSetting = PathSetting.AUTO, **changes: Any) -> PipeConfig:
    """The pipe's config with these extra config fields changed, in the contract's units and bounds
    (`gb` gives a size in bytes as buffer_size_gb); every other value is the contract's default."""
    return PipeConfig(data_path=data_path).with_extra(**changes)


def receiver_config(
    buffer_bytes: int = 64 << 20, data_path: PathSetting = PathSetting.AUTO, **changes: Any
) -> PipeConfig:
    """A decode side for these tests: `buffer_bytes` of staging, time limits far above what a transfer
    here takes (10 s per transfer, 30 s of waiting for prefill, 10 s of hold); `changes` over those."""
    base: dict[str, Any] = {
        "buffer_size_gb": gb(buffer_bytes),
        "transfer_timeout_ms": 10_000,
        "prefill_wait_ms": 30_000,
        "hold_seconds": 10,
    }
    return pipe_config(data_path, **(base | changes))


def _config(spec: dict[str, Any]) -> PipeConfig:
    return pipe_config(
        compression=Compression(spec.get("compression", "none")),
        buffer_size_gb=gb(64 << 20),
        transfer_timeout_ms=spec.get("transfer_timeout_ms", 10_000),
        hold_seconds=spec.get("hold_seconds", 10),
        async_transfer=False,
        transfer_threshold_tokens=spec.get("threshold_tokens", 256),  # 16-block batches: the pipeline runs
        data_path=PathSetting(spec.get("data_path", "auto")),
    )


def _send_all(
    sender: KVSender, spec: dict[str, Any], decode_tp: int | None, tag: dict[str, Any]
) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for job in spec["jobs"]:
        blocks, digest = tuple(job["block_ids"]), job.get("hash", "")
        sender.submit(SendJob(job["transfer_id"], blocks, HOST, spec["port"], digest, None, decode_tp))
        lines.extend(tag | {"transfer_id": tid, "error": error} for tid, error in sender.finished().items())
    sender.close()
    lines.append(
        tag
        | {
            "stats": sender.stats.snapshot(),
            "staging_in_use": sender.staging.in_use,
            "data_path": sender.placement.path.value,
        }
    )
    return lines


def _sender_class(double: str) -> type[KVSender]:
    return {"corrupt": CorruptingSender, "die": DyingSender}.get(double, KVSender)


def run_spec(transport: Transport, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one spec's jobs with a fresh sender; the report lines for them."""
    geometry = Geometry(**spec.get("geometry", vars(GEOMETRY)))
    device = torch.device(spec.get("device", "cpu"))  # "cuda": the GPU tests' caches
    caches = {name: cache.to(device) for name, cache in make_caches(spec.get("seed", 7), geometry).items()}
    kv = PagedKV(caches, NUM_BLOCKS, geometry)
    if spec.get("nan"):
        NaNKV.poison(kv)
    sender = _sender_class(spec.get("double", ""))(transport, kv, _config(spec))
    sender.piece_bytes = spec.get("piece_bytes", sender.piece_bytes)
    sender.zero_copy_piece_bytes = spec.get("piece_bytes", sender.zero_copy_piece_bytes)
    return _send_all(sender, spec, None, {})


def run_tp_spec(transports: dict[int, Transport], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Prefill TP ranks `tp.ranks` of `tp.size` send the jobs at once, each with its own transport.

    tp: {"size", "ranks" (those that send; the others never do), "decode_tp", "layout",
    "doubles" (rank -> test double), "min_zero_copy_run" (bytes; the sender's default if absent)}.
    """
    tp = spec["tp"]
    lines: list[dict[str, Any]] = []

    def run(rank: int) -> None:
        kv = rank_kv(spec.get("seed", 7), tp.get("layout", "cpu"), TPRank(rank, tp["size"]))
        double = tp.get("doubles", {}).get(str(rank), "")
        sender = _sender_class(double)(transports[rank], kv, _config(spec))
        sender.min_zero_copy_run = tp.get("min_zero_copy_run", sender.min_zero_copy_run)
        lines.extend(_send_all(sender, spec, tp["decode_tp"], {"rank": rank}))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in tp["ranks"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(lines, key=lambda line: (line["rank"], "stats" in line))


def main(kind: str) -> None:
    """Serve specs, one JSON line each on stdin, answering each with one JSON list line."""
    transports = {0: make_transport(kind)}
    print(json.dumps({"ready": kind}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        if "tp" in spec:
            for rank in spec["tp"]["ranks"]:
                if rank not in transports:
                    transports[rank] = make_transport(kind)
            print(json.dumps(run_tp_spec(transports, spec)), flush=True)
        else:
            print(json.dumps(run_spec(transports[0], spec)), flush=True)
    # Exit without tearing down native engines (their destructors may block on peers).
    os._exit(0)


class Prefill:
    """Drives the prefill process (this file as a script): specs in on stdin, reports out."""

    def __init__(self, kind: str) -> None:
        # Its stderr (Mooncake's log and any traceback) goes to a file, read back when it fails to answer.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (open for the process's whole life)
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._replies: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert json.loads(self._reply(60)) == {"ready": kind}

    def _reply(self, timeout: float) -> str:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            self._stderr.seek(0)
            tail = self._stderr.read().decode(errors="replace")[-3000:]
            state = "running" if self.process.poll() is None else f"exited {self.process.returncode}"
            raise AssertionError(
                f"the prefill peer ({state}) gave no reply in {timeout}s; stderr:\n{tail}"
            ) from None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(("{", "[")):
                self._replies.put(line)

    def send(self, port: int, jobs: list[dict[str, Any]], **spec: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"port": port, "jobs": jobs} | spec) + "\n")
        self.process.stdin.flush()

    def report(self, timeout: float = 60) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = json.loads(self._reply(timeout))
        return lines

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=30)
        self._stderr.close()


def assert_a_corrupted_payload_fails_on_both_sides(
    receiver: KVReceiver, prefill: Prefill, dst: Sequence[int], src: Sequence[int], **spec: Any
) -> None:
    """Prefill's corrupting double sends `src` to decode's `dst`: decode refuses it by its checksum and
    counts it, prefill hears why, and neither side keeps staging."""
    receiver.expect("t-bad", list(dst))
    prefill.send(receiver.port, [{"transfer_id": "t-bad", "block_ids": list(src)}], double="corrupt", **spec)
    outcome = receiver.wait_for("t-bad", timeout=60)
    assert outcome is not None
    assert "checksum" in outcome
    report = prefill.report()
    assert "checksum" in report[0]["error"]
    assert report[-1]["staging_in_use"] == 0
    assert receiver.stats.checksum_failures == 1


def consecutive_free_ports(count: int) -> int:
    """A base port with `count` free ports from it on (decode rank r listens on base + r)."""
    from e2e.ports import free_consecutive_ports  # here: this file also runs as the peer's script

    assert HOST == "127.0.0.1"
    return free_consecutive_ports(count)


if __name__ == "__main__":
    main(sys.argv[1])
