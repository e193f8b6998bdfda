"""A worker process (one prefill, one decode): the engine side of every row, serving the driver's
JSON commands on stdin."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from kv.checksum_experiment import NoChecksum, RunningCrc32, use_zero_copy_checksum
from kv.codec_speed import codec_per_core
from kv.shape import BLOCK, HEAD_DIM, KV_HEADS, LAYERS
from kv.sockets import IOV, RAW_BUFFER, RAW_RECV, accepted, connected, memory, recv_into_all, send_all


def _caches(num_blocks: int, seed: int | None) -> dict[str, Any]:
    import torch

    shape = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    generator = torch.Generator().manual_seed(seed or 0)
    caches = {}
    for layer in range(LAYERS):
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        if seed is None:
            tensor.zero_()
        else:
            tensor.copy_(torch.randn(shape, generator=generator))
        caches[f"layers.{layer}"] = tensor
    return caches


class Worker:
    """Serves JSON commands on stdin, one JSON reply line each on stdout."""

    def __init__(
        self,
        role: str,
        host: str,
        num_blocks: int,
        buffer_bytes: int,
        batch_tokens: int,
        checksum: str,
        threads: int,
    ) -> None:
        import torch

        from dllm_connector.layout import Geometry, PagedKV
        from dllm_connector.pipe.common import PipeConfig, gb
        from dllm_connector.pipe.receiver import KVReceiver
        from dllm_connector.pipe.sender import KVSender
        from dllm_connector.transport.mooncake import MooncakeTransport
        from dllm_connector.transport.torchdist import TorchDistTransport

        torch.set_num_threads(threads)
        if checksum != "xxh3":
            kinds: dict[str, type[RunningCrc32 | NoChecksum]] = {"off": NoChecksum, "crc32": RunningCrc32}
            use_zero_copy_checksum(kinds[checksum])
        self.host = host
        geometry = Geometry(block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, model="bench")
        self.kv = PagedKV(_caches(num_blocks, 1 if role == "prefill" else None), num_blocks, geometry)
        self.transports = {"mooncake": MooncakeTransport(host), "gloo": TorchDistTransport(host)}
        self.config = PipeConfig().with_extra(
            buffer_size_gb=gb(buffer_bytes),
            transfer_timeout_ms=60_000,
            prefill_wait_ms=120_000,
            hold_seconds=60,
            transfer_threshold_tokens=batch_tokens,
        )
        self.receivers: dict[str, Any] = {}
        self.senders: dict[tuple[str, str], Any] = {}
        if role == "decode":
            for name, transport in self.transports.items():
                self.receivers[name] = KVReceiver(transport, self.kv, self.config, host, 0)
        self._sender_class = KVSender
        self._raw: socket.socket | None = None
        self._contiguous: Any = None
        self._raw_buffer: Any = None

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        return dict(getattr(self, f"cmd_{command.pop('cmd')}")(**command))

    def cmd_ports(self) -> dict[str, Any]:
        self._raw = socket.create_server((self.host, 0))
        return {"raw": self._raw.getsockname()[1]} | {name: r.port for name, r in self.receivers.items()}

    def cmd_expect(self, transport: str, transfer_id: str, blocks: list[int]) -> dict[str, Any]:
        self.receivers[transport].expect(transfer_id, blocks)
        return {}

    def cmd_wait(self, transport: str, transfer_id: str) -> dict[str, Any]:
        return {"outcome": self.receivers[transport].wait_for(transfer_id, 120)}

    def cmd_raw_recv(self, nbytes: int) -> dict[str, Any]:
        assert self._raw is not None
        threading.Thread(target=self._raw_recv, args=(nbytes,), daemon=True).start()
        return {}

    def _raw_recv(self, nbytes: int) -> None:
        import torch

        assert self._raw is not None
        size = min(nbytes, RAW_BUFFER)
        if self._raw_buffer is None or self._raw_buffer.numel() != size:
            # Allocated and touched once, like registered KV memory: page faults are not the link's.
            self._raw_buffer = torch.zeros(size, dtype=torch.uint8)
        buffer = self._raw_buffer.numpy().data.cast("B")
        with accepted(self._raw) as conn:
            # 4 MiB receives; a KV larger than the buffer goes through it in turn (256 MiB = 64 x 4 MiB)
            for start in range(0, nbytes, RAW_RECV):
                offset = start % size
                recv_into_all(conn, buffer[offset : offset + min(RAW_RECV, nbytes - start)])
            conn.sendall(b"k")

    def cmd_raw_send(self, host: str, port: int, nbytes: int) -> dict[str, Any]:
        import torch

        payload = torch.ones(min(nbytes, RAW_BUFFER), dtype=torch.uint8).numpy().data.cast("B")
        started = time.perf_counter()
        with connected(host, port) as conn:
            for start in range(0, nbytes, len(payload)):
                conn.sendall(payload[: min(len(payload), nbytes - start)])
            conn.recv(1)
        return {"seconds": time.perf_counter() - started}

    def cmd_spans_recv(self, blocks: list[int], checksum: bool) -> dict[str, Any]:
        assert self._raw is not None
        spans = self.kv.spans(blocks)
        threading.Thread(target=self._spans_recv, args=(spans, checksum), daemon=True).start()
        return {}

    def _spans_recv(self, spans: list[tuple[int, int]], checksum: bool) -> None:
        from dllm_connector.codec.checksum import RunningChecksum

        assert self._raw is not None
        running = RunningChecksum()
        with accepted(self._raw) as conn:
            for addr, nbytes in spans:
                recv_into_all(conn, memory(addr, nbytes))
                if checksum:
                    running.add(addr, nbytes)
            conn.sendall(running.value.to_bytes(8, "little"))

    def cmd_spans_send(self, host: str, port: int, blocks: list[int], checksum: bool) -> dict[str, Any]:
        """The KV's spans as one socket stream, in sendmsg calls of IOV spans each."""
        from dllm_connector.codec.checksum import RunningChecksum

        spans = self.kv.spans(blocks)
        running = RunningChecksum()
        started = time.perf_counter()
        with connected(host, port) as conn:
            for start in range(0, len(spans), IOV):
                group = spans[start : start + IOV]
                if checksum:
                    for addr, nbytes in group:
                        running.add(addr, nbytes)
                send_all(conn, [memory(addr, nbytes) for addr, nbytes in group])
            matched = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little") == running.value
        return {"seconds": time.perf_counter() - started, "matched": matched}

    def cmd_codec(self, tokens: int, repeats: int, kernels: list[str]) -> dict[str, Any]:
        """The codec per core, for each kernel set (the worker's own, in use for its transfers, first)."""
        return {"codecs": [row for name in kernels for row in codec_per_core(tokens, repeats, name)]}

    def cmd_regions(self, blocks: list[int]) -> dict[str, Any]:
        """Decode's side of the Mooncake-alone rows: its KV spans, a contiguous buffer, its session."""
        receiver = self.receivers["mooncake"]
        buffer = receiver.staging.tensor
        return {
            "spans": self.kv.spans(blocks),
            "buffer": [buffer.data_ptr(), buffer.numel()],
            "session": receiver.transport.session_id,
        }

    def cmd_write_alone(
        self, blocks: list[int], dst: list[list[int]], session: str, contiguous: bool
    ) -> dict[str, Any]:
        """Mooncake by itself, no pipe: the KV's spans to decode's (merged as the pipe merges them),
        or the same bytes as one write from one buffer (writes of decode's staging size, where the
        KV is larger)."""
        import torch

        from dllm_connector.layout.span_table import merged
        from dllm_connector.transport.base import Span, SpanList

        transport = self.transports["mooncake"]
        self.kv.register_with(transport.register)
        if contiguous:
            nbytes, (target_addr, target_nbytes) = self.kv.batch_nbytes(len(blocks)), dst[0]
            if self._contiguous is None:
                self._contiguous = torch.ones(min(nbytes, target_nbytes), dtype=torch.uint8)
                transport.register(self._contiguous)
            size = self._contiguous.numel()
            lengths = [min(size, nbytes - start) for start in range(0, nbytes, size)]
            src: list[Span] | SpanList = [Span(self._contiguous.data_ptr(), length) for length in lengths]
            targets: list[Span] | SpanList = [Span(target_addr, length) for length in lengths]
        else:
            ours = self.kv.span_table(blocks)
            runs = merged(
                ours.addrs.reshape(-1),
                torch.tensor([addr for addr, _ in dst]),
                ours.lengths.repeat(ours.addrs.shape[0]),
            )
            sizes = runs[2].tolist()
            src, targets = SpanList(runs[0].tolist(), sizes), SpanList(runs[1].tolist(), sizes)
        started = time.perf_counter()
        transport.send({"session": session}, src, targets, 0, 60)
        return {"seconds": time.perf_counter() - started, "writes": len(src)}

    def cmd_send(
        self,
        transport: str,
        codec: str,
        transfer_id: str,
        blocks: list[int],
        host: str,
        port: int,
        writes_in_flight: int | None = None,
    ) -> dict[str, Any]:
        from dllm_connector.pipe.sender import SendJob
        from dllm_contract.kvconfig import Compression

        key = (transport, codec)
        if key not in self.senders:
            config = self.config.with_extra(compression=Compression(codec))
            self.senders[key] = self._sender_class(self.transports[transport], self.kv, config)
        sender = self.senders[key]
        wire_before = sender.stats.bytes_on_wire
        used = self.transports[transport]
        own = used.writes_in_flight  # read as each transfer's writer starts
        used.writes_in_flight = writes_in_flight or own
        try:
            started = time.perf_counter()
            sender.send(SendJob(transfer_id, tuple(blocks), host, port))
            seconds = time.perf_counter() - started
        finally:
            used.writes_in_flight = own
        return {"seconds": seconds, "wire": sender.stats.bytes_on_wire - wire_before}


def serve(args: argparse.Namespace) -> None:
    from dllm_connector import codec, tuning

    # The kernels the driver names (DLLM_KV_CODEC_KERNELS), taken as an engine takes them.
    codec.configure(codec.KernelRequest.of(tuning.from_env(os.environ)))
    worker = Worker(
        args.serve,
        args.host,
        args.blocks,
        args.buffer_mb << 20,
        args.batch_tokens,
        args.checksum,
        args.threads,
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            reply = worker.handle(json.loads(line))
        except Exception as error:  # noqa: BLE001 - reported to the driver
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)
    os._exit(0)  # native engines' destructors may wait on peers
