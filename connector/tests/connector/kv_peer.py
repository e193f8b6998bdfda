"""A prefill worker in its own process for the two-process KV tests, and the shared test KV.

Run as a script: `python kv_peer.py mooncake|gloo` reads one JSON spec per stdin line, sends its
jobs and answers with one JSON line: {"transfer_id", "error"} per job, then the sender's stats.
Two test doubles live here, named as such: CorruptingSender flips one payload byte after its
checksum was taken; DyingSender exits the process after decode accepted, before writing.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from dllm_connector.kv_layout import Geometry, PagedKV
from dllm_connector.kvconfig import Compression
from dllm_connector.pipe import KVSender, PipeConfig, SendJob
from dllm_connector.transport.base import Source, Span, Transport
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.torchdist import TorchDistTransport

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


def make_transport(kind: str) -> Transport:
    if kind == "mooncake":
        return MooncakeTransport(HOST)
    return TorchDistTransport(HOST, backend="gloo", connect_timeout=10)


class CorruptingSender(KVSender):
    """Test double: flips one byte of the outgoing KV after the checksum was computed."""

    def _before_write(self, index: int, src: Sequence[Source]) -> None:
        if index == 0:
            target = src[len(src) // 2]
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


def run_spec(transport: Transport, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one spec's jobs with a fresh sender; the report lines for them."""
    geometry = Geometry(**spec.get("geometry", vars(GEOMETRY)))
    kv = PagedKV(make_caches(spec.get("seed", 7), geometry), NUM_BLOCKS, geometry)
    if spec.get("nan"):
        NaNKV.poison(kv)
    config = PipeConfig(
        compression=Compression(spec.get("compression", "none")),
        buffer_bytes=64 << 20,
        transfer_timeout_s=spec.get("timeout_s", 10.0),
        hold_s=spec.get("hold_s", 10.0),
        async_transfer=False,
        threshold_tokens=spec.get("threshold_tokens", 256),  # 16-block batches: the pipeline runs
    )
    sender_class = {"corrupt": CorruptingSender, "die": DyingSender}.get(spec.get("double", ""), KVSender)
    sender = sender_class(transport, kv, config)
    lines: list[dict[str, Any]] = []
    for job in spec["jobs"]:
        sender.submit(
            SendJob(job["transfer_id"], tuple(job["block_ids"]), HOST, spec["port"], job.get("hash", ""))
        )
        lines.extend({"transfer_id": tid, "error": error} for tid, error in sender.finished().items())
    sender.close()
    lines.append({"stats": sender.stats.snapshot(), "staging_in_use": sender.staging.in_use})
    return lines


def main(kind: str) -> None:
    """Serve specs, one JSON line each on stdin, answering each with one JSON list line."""
    transport = make_transport(kind)
    print(json.dumps({"ready": kind}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run_spec(transport, json.loads(line))), flush=True)
    # Exit without tearing down native engines (their destructors may block on peers).
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
