"""KV transfer benchmark: a raw TCP socket against the dllm KV pipe with codecs none, fp8 and int8.

Two processes (prefill sender, decode receiver) move a paged KV of realistic shape (32 layers,
block 16, 8 KV heads, head_dim 128, bf16, vLLM's CPU layout) block by block. Every row is measured
in the same run, side by side:

    raw socket      Python sendall/recv_into of the same number of bytes: the link's limit
    <transport> <codec>   end to end: offer, gather + encode, write, decode + scatter, ack
    mooncake spans  the transfer engine alone writing the KV's block spans to decode's (no pipe)
    mooncake 1 write  the same bytes as one write from one buffer: the engine's own best (for a
                    KV larger than decode's 1 GiB staging, writes of that size)
    socket spans    the KV's block spans over one Python socket (sendmsg gathers them, recv_into
                    scatters them into decode's blocks): a transport that costs what a socket costs
    socket spans+xxh3  the same, hashing every span on both sides as the pipe's zero-copy checksum
                    does (127.0.0.1 only, as is the row above)

GB/s counts uncompressed KV delivered per second (1 GB = 1e9 bytes). The codec's own GB/s per
core is measured with torch on one thread. `--link` runs the table again over a veth pair between
two network namespaces of our own, rate-limited with tc (needs root; 127.0.0.1 stays untouched).
Transfers are pipelined in batches of --batch-tokens (transferThresholdTokens, default 1024 as in
the connector). `--checksum off` is an experiment, not a mode of the connector: it replaces the
XXH3 checksum of zero-copy transfers by 0 on both sides, to show what the checksum costs (`crc32`:
by zlib's CRC-32, the connector's checksum before XXH3). `--threads` sets the torch threads of each
engine process (default 1; the codec runs on them). Decode's block ids are prefill's reversed, so
that no two spans merge (the worst case); `--consecutive-ids` gives both the same ids, so that each
layer's spans merge into one run (the best case: a fresh engine allocates blocks in order).

    python bench/kv_transfer.py --quick            # 2k tokens, under 50 s
    python bench/kv_transfer.py --tokens 2048 32768 --link 2gbit
    python bench/kv_transfer.py --tokens 2048 --transports mooncake --link 1gbit --batch-tokens 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 32, 16, 8, 128
CODECS = ("none", "fp8", "int8")
NS_PREFILL, NS_DECODE = "dllm-kvb-p", "dllm-kvb-d"
VETH_PREFILL, VETH_DECODE = "dkvb-p", "dkvb-d"
ADDR_PREFILL, ADDR_DECODE = "10.213.0.1", "10.213.0.2"


# ---- worker processes (one prefill, one decode) ---------------------------------------------------


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


class _RunningCrc32:
    """zlib's CRC-32 in the place of the pipe's running XXH3 (the connector's checksum before it)."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, addr: int, nbytes: int) -> None:
        import ctypes
        import zlib

        self.value = zlib.crc32((ctypes.c_ubyte * nbytes).from_address(addr), self.value)


class _NoChecksum:
    """No checksum at all: what the zero-copy checksum costs on both sides."""

    value = 0

    def add(self, addr: int, nbytes: int) -> None:
        pass


def _use_zero_copy_checksum(kind: type[_RunningCrc32 | _NoChecksum]) -> None:
    """The experiment: `kind` in the place of XXH3 for zero-copy transfers, on both sides."""
    from dllm_connector.pipe import receiver, sender

    def spans_checksum(spans: Any) -> int:
        running = kind()
        for addr, nbytes in spans:
            running.add(addr, nbytes)
        return int(running.value)

    sender.RunningChecksum = kind  # type: ignore[attr-defined,assignment]
    receiver.spans_checksum = spans_checksum  # type: ignore[attr-defined]


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

        from dllm_connector.kv_layout import Geometry, PagedKV
        from dllm_connector.pipe.common import PipeConfig
        from dllm_connector.pipe.receiver import KVReceiver
        from dllm_connector.pipe.sender import KVSender
        from dllm_connector.transport.mooncake import MooncakeTransport
        from dllm_connector.transport.torchdist import TorchDistTransport

        torch.set_num_threads(threads)
        if checksum != "xxh3":
            kinds: dict[str, type[_RunningCrc32 | _NoChecksum]] = {"off": _NoChecksum, "crc32": _RunningCrc32}
            _use_zero_copy_checksum(kinds[checksum])
        self.host = host
        geometry = Geometry(block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, model="bench")
        self.kv = PagedKV(_caches(num_blocks, 1 if role == "prefill" else None), num_blocks, geometry)
        self.transports = {"mooncake": MooncakeTransport(host), "gloo": TorchDistTransport(host)}
        self.config = PipeConfig(
            buffer_bytes=buffer_bytes,
            transfer_timeout_s=60,
            prefill_wait_s=120,
            hold_s=60,
            threshold_tokens=batch_tokens,
        )
        self.receivers: dict[str, Any] = {}
        self.senders: dict[tuple[str, str], Any] = {}
        if role == "decode":
            for name, transport in self.transports.items():
                self.receivers[name] = KVReceiver(transport, self.kv, self.config, host, 0)
        self._sender_class, self._config_class = KVSender, PipeConfig
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
        size = min(nbytes, _RAW_BUFFER)
        if self._raw_buffer is None or self._raw_buffer.numel() != size:
            # Allocated and touched once, like registered KV memory: page faults are not the link's.
            self._raw_buffer = torch.zeros(size, dtype=torch.uint8)
        buffer = self._raw_buffer.numpy().data.cast("B")
        with _accepted(self._raw) as conn:
            # 4 MiB receives; a KV larger than the buffer goes through it in turn (256 MiB = 64 x 4 MiB)
            for start in range(0, nbytes, _RAW_RECV):
                offset = start % size
                _recv_into_all(conn, buffer[offset : offset + min(_RAW_RECV, nbytes - start)])
            conn.sendall(b"k")

    def cmd_raw_send(self, host: str, port: int, nbytes: int) -> dict[str, Any]:
        import torch

        payload = torch.ones(min(nbytes, _RAW_BUFFER), dtype=torch.uint8).numpy().data.cast("B")
        started = time.perf_counter()
        with _connected(host, port) as conn:
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
        from dllm_connector.checksum import RunningChecksum

        assert self._raw is not None
        running = RunningChecksum()
        with _accepted(self._raw) as conn:
            for addr, nbytes in spans:
                _recv_into_all(conn, _memory(addr, nbytes))
                if checksum:
                    running.add(addr, nbytes)
            conn.sendall(running.value.to_bytes(8, "little"))

    def cmd_spans_send(self, host: str, port: int, blocks: list[int], checksum: bool) -> dict[str, Any]:
        """The KV's spans as one socket stream, in sendmsg calls of _IOV spans each."""
        from dllm_connector.checksum import RunningChecksum

        spans = self.kv.spans(blocks)
        running = RunningChecksum()
        started = time.perf_counter()
        with _connected(host, port) as conn:
            for start in range(0, len(spans), _IOV):
                group = spans[start : start + _IOV]
                if checksum:
                    for addr, nbytes in group:
                        running.add(addr, nbytes)
                _send_all(conn, [_memory(addr, nbytes) for addr, nbytes in group])
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

        from dllm_connector.kv_layout import coalesce
        from dllm_connector.transport.base import Span

        transport = self.transports["mooncake"]
        self.kv.register_with(transport.register)
        if contiguous:
            nbytes, (target_addr, target_nbytes) = self.kv.batch_nbytes(len(blocks)), dst[0]
            if self._contiguous is None:
                self._contiguous = torch.ones(min(nbytes, target_nbytes), dtype=torch.uint8)
                transport.register(self._contiguous)
            size = self._contiguous.numel()
            lengths = [min(size, nbytes - start) for start in range(0, nbytes, size)]
            src = [(self._contiguous.data_ptr(), length) for length in lengths]
            targets = [(target_addr, length) for length in lengths]
        else:
            src, targets = coalesce(self.kv.spans(blocks), [(addr, nbytes) for addr, nbytes in dst])
        started = time.perf_counter()
        transport.send({"session": session}, [Span(*s) for s in src], [Span(*d) for d in targets], 0, 60)
        return {"seconds": time.perf_counter() - started, "writes": len(src)}

    def cmd_send(
        self, transport: str, codec: str, transfer_id: str, blocks: list[int], host: str, port: int
    ) -> dict[str, Any]:
        from dllm_connector.pipe.sender import SendJob
        from dllm_contract.kvconfig import Compression

        key = (transport, codec)
        if key not in self.senders:
            config = self._config_class(**(vars(self.config) | {"compression": Compression(codec)}))
            self.senders[key] = self._sender_class(self.transports[transport], self.kv, config)
        sender = self.senders[key]
        wire_before = sender.stats.bytes_on_wire
        started = time.perf_counter()
        sender.send(SendJob(transfer_id, tuple(blocks), host, port))
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "wire": sender.stats.bytes_on_wire - wire_before}


_IOV = 256  # buffers per sendmsg call (IOV_MAX is 1024)
_RAW_BUFFER = 256 << 20  # the raw socket's buffers; a larger KV is sent through them in turn
_RAW_RECV = 4 << 20  # bytes per receive call of the raw row
_MAX_STAGING = 1 << 30  # each engine's staging buffer (bufferSizeGB); the pipe waits when it is full
_SOCKET_BUFFER = 4 << 20  # socket buffers of the raw and span rows: 64 KiB receives keep up with them


def _memory(addr: int, nbytes: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")


def _accepted(listener: socket.socket) -> socket.socket:
    conn, _ = listener.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    return conn


def _connected(host: str, port: int) -> socket.socket:
    conn = socket.create_connection((host, port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    return conn


def _recv_into_all(conn: socket.socket, view: memoryview) -> None:
    received = 0
    while received < len(view):
        count = conn.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("the sender closed the connection early")
        received += count


def _send_all(conn: socket.socket, buffers: list[memoryview]) -> None:
    """sendmsg until every buffer is out (a call may send part of them)."""
    while buffers:
        sent = conn.sendmsg(buffers)
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]


def serve(args: argparse.Namespace) -> None:
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


# ---- the driver ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What every worker of a run shares."""

    batch_tokens: int
    checksum: str
    threads: int
    consecutive_ids: bool = False  # decode's blocks in prefill's order: spans merge into runs


class Peer:
    def __init__(
        self, role: str, host: str, blocks: int, buffer_mb: int, netns: str | None, settings: Settings
    ) -> None:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        command = [*prefix, sys.executable, __file__, "--serve", role, "--host", host]
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


CodecFigures = list[tuple[str, str, float, float]]  # (kernel set, codec, encode GB/s, decode GB/s)


@dataclass
class Row:
    name: str
    seconds: float
    raw_bytes: int
    wire_bytes: int

    @property
    def gbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e9


def measure_link(
    tokens: int,
    repeats: int,
    transports: list[str],
    hosts: tuple[str, str],
    namespaces: tuple[str | None, str | None],
    settings: Settings,
    codec_tokens: int = 0,
    codec_kernels: tuple[str, ...] = (),
) -> tuple[list[Row], CodecFigures]:
    """The table's rows, and with `codec_tokens` the codec per core measured in the prefill worker."""
    blocks = -(-tokens // BLOCK)
    kv_bytes = blocks * LAYERS * KV_HEADS * BLOCK * 2 * HEAD_DIM * 2
    buffer_mb = min(kv_bytes, _MAX_STAGING) // (1 << 20) + 16
    prefill = Peer("prefill", hosts[0], blocks, buffer_mb, namespaces[0], settings)
    decode = Peer("decode", hosts[1], blocks, buffer_mb, namespaces[1], settings)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        ports = decode.call("ports")
        rows = [_raw_row(prefill, decode, hosts[1], ports["raw"], kv_bytes, repeats)]
        src = list(range(blocks))
        dst = list(src) if settings.consecutive_ids else list(reversed(src))
        for transport in transports:
            for codec in CODECS:
                times, wire = [], 0
                for attempt in range(repeats + 1):  # the first run warms connections and kernels
                    transfer_id = f"{transport}-{codec}-{attempt}"
                    decode.call("expect", transport=transport, transfer_id=transfer_id, blocks=dst)
                    sent = prefill.call(
                        "send",
                        transport=transport,
                        codec=codec,
                        transfer_id=transfer_id,
                        blocks=src,
                        host=hosts[1],
                        port=ports[transport],
                    )
                    outcome = decode.call("wait", transport=transport, transfer_id=transfer_id)["outcome"]
                    if outcome != "":
                        raise RuntimeError(f"{transport} {codec}: {outcome}")
                    if attempt:
                        times.append(sent["seconds"])
                    wire = sent["wire"]
                rows.append(Row(f"{transport} {codec}", statistics.median(times), kv_bytes, wire))
        if "mooncake" in transports:
            rows += _mooncake_alone_rows(prefill, decode, src, dst, kv_bytes, repeats)
        if namespaces == (None, None):  # over a rate-limited link they would only repeat the raw row
            rows += _socket_spans_rows(prefill, decode, hosts[1], ports["raw"], (src, dst), kv_bytes, repeats)
        if not codec_tokens:
            return rows, []
        measured = prefill.call(
            "codec", tokens=codec_tokens, repeats=repeats + 1, kernels=list(codec_kernels)
        )
        return rows, [tuple(row) for row in measured["codecs"]]
    finally:
        prefill.close()
        decode.close()


def _raw_row(prefill: Peer, decode: Peer, host: str, port: int, nbytes: int, repeats: int) -> Row:
    times = []
    for _ in range(repeats + 1):
        decode.call("raw_recv", nbytes=nbytes)
        times.append(prefill.call("raw_send", host=host, port=port, nbytes=nbytes)["seconds"])
    return Row("raw socket", statistics.median(times[1:]), nbytes, nbytes)


def _mooncake_alone_rows(
    prefill: Peer, decode: Peer, src: list[int], dst: list[int], nbytes: int, repeats: int
) -> list[Row]:
    """The transfer engine by itself on the same bytes: as the KV's block spans, and as one write."""
    regions = decode.call("regions", blocks=dst)
    rows = []
    for name, contiguous, target in (
        ("mooncake spans", False, regions["spans"]),
        ("mooncake 1 write", True, [regions["buffer"]]),
    ):
        times = [
            prefill.call(
                "write_alone", blocks=src, dst=target, session=regions["session"], contiguous=contiguous
            )["seconds"]
            for _ in range(repeats + 1)
        ]
        rows.append(Row(name, statistics.median(times[1:]), nbytes, nbytes))
    return rows


def _socket_spans_rows(
    prefill: Peer,
    decode: Peer,
    host: str,
    port: int,
    blocks: tuple[list[int], list[int]],
    nbytes: int,
    repeats: int,
) -> list[Row]:
    """The KV's spans over a plain socket, without and with the checksum on both sides."""
    rows = []
    for name, checksum in (("socket spans", False), ("socket spans+xxh3", True)):
        times = []
        for _ in range(repeats + 1):
            decode.call("spans_recv", blocks=blocks[1], checksum=checksum)
            sent = prefill.call("spans_send", host=host, port=port, blocks=blocks[0], checksum=checksum)
            if checksum and not sent["matched"]:
                raise RuntimeError("socket spans: the checksums of the two sides differ")
            times.append(sent["seconds"])
        rows.append(Row(name, statistics.median(times[1:]), nbytes, nbytes))
    return rows


def codec_per_core(tokens: int, repeats: int, kernels: str) -> CodecFigures:
    """(kernels, codec, encode GB/s, decode GB/s) on one thread, for `tokens` of the KV; nothing where
    that kernel set is unavailable here. The worker's own kernels are in use again afterwards.

    As in the pipe, encode writes into a staging buffer and decode into a KV batch that were
    allocated (and touched) before, so page faults of fresh buffers are not counted.
    """
    import torch

    from dllm_connector import codec
    from dllm_contract.kvconfig import Compression

    torch.set_num_threads(1)
    own = codec.kernels().name
    if codec.use_kernels(kernels) != kernels:
        codec.use_kernels(own)
        return []
    blocks = -(-tokens // BLOCK)
    batch = torch.randn(LAYERS * blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    staging = torch.zeros(batch.numel() * batch.element_size(), dtype=torch.uint8)
    target = torch.zeros_like(batch)
    groups = 2 * KV_HEADS
    results = []
    for name in ("fp8", "int8"):
        compression = Compression(name)
        header, payload = codec.encode(batch, compression, groups, out=staging)
        codec.decode(header, payload, target)
        encode = _best_of(repeats, lambda c=compression: codec.encode(batch, c, groups, out=staging))
        decode = _best_of(repeats, lambda h=header, p=payload: codec.decode(h, p, target))
        nbytes = batch.numel() * batch.element_size()
        results.append((kernels, name, nbytes / encode / 1e9, nbytes / decode / 1e9))
    codec.use_kernels(own)
    return results


def _best_of(count: int, run: Any) -> float:
    best = float("inf")
    for _ in range(count):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


@contextlib.contextmanager
def emulated_link(rate: str) -> Iterator[None]:
    """Two namespaces of our own joined by a veth pair, each end limited to `rate` by tc."""
    steps = [
        ["ip", "netns", "add", NS_PREFILL],
        ["ip", "netns", "add", NS_DECODE],
        [
            "ip",
            "link",
            "add",
            VETH_PREFILL,
            "netns",
            NS_PREFILL,
            "type",
            "veth",
            "peer",
            VETH_DECODE,
            "netns",
            NS_DECODE,
        ],
    ]
    for ns, dev, addr in ((NS_PREFILL, VETH_PREFILL, ADDR_PREFILL), (NS_DECODE, VETH_DECODE, ADDR_DECODE)):
        run = ["ip", "netns", "exec", ns]
        steps += [
            [*run, "ip", "addr", "add", f"{addr}/24", "dev", dev],
            [*run, "ip", "link", "set", dev, "up"],
            [*run, "ip", "link", "set", "lo", "up"],
            [
                *run,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "2mb",
                "latency",
                "50ms",
            ],
        ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield
    finally:
        for ns in (NS_PREFILL, NS_DECODE):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def print_table(title: str, rows: list[Row]) -> None:
    raw = rows[0]
    print(f"\n{title}")
    print(f"  {'path':<18} {'GB/s':>7} {'x raw':>7} {'wire MB':>9} {'wire/raw':>9}")
    for row in rows:
        print(
            f"  {row.name:<18} {row.gbps:7.2f} {row.gbps / raw.gbps:7.2f} "
            f"{row.wire_bytes / 1e6:9.1f} {row.wire_bytes / row.raw_bytes:9.2f}"
        )
    by_name = {row.name: row for row in rows}
    for transport in sorted({row.name.split()[0] for row in rows[1:]}):
        none, fp8 = by_name.get(f"{transport} none"), by_name.get(f"{transport} fp8")
        if none and fp8:
            print(f"  {transport}: fp8 delivers {fp8.gbps / none.gbps:.2f}x the KV per second of none")


def gpu_codec() -> None:
    import torch

    if not torch.cuda.is_available():
        return
    from dllm_connector import codec
    from dllm_contract.kvconfig import Compression

    batch = torch.randn(LAYERS * 128, KV_HEADS, BLOCK, 2 * HEAD_DIM, device="cuda").to(torch.bfloat16)
    rows = batch.reshape(-1, BLOCK * 2 * HEAD_DIM)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device="cuda")

    scales = torch.empty(rows.shape[0], device="cuda")

    def quantize(name: str) -> None:
        functions = codec.kernels().by_codec[Compression(name)]
        functions.encode_into(rows, codes if name == "fp8" else codes.view(torch.int8), scales)
        torch.cuda.synchronize()

    for name in ("fp8", "int8"):
        quantize(name)
        seconds = _best_of(5, lambda n=name: quantize(n))
        print(f"  GPU {name} quantize: {batch.numel() * 2 / seconds / 1e9:.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2k tokens, 1 timed run per row")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["mooncake", "gloo"], choices=["mooncake", "gloo"])
    parser.add_argument("--link", metavar="RATE", help="also over a tc-limited veth link, e.g. 2gbit")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="transferThresholdTokens")
    parser.add_argument(
        "--checksum",
        choices=["xxh3", "crc32", "off"],
        default="xxh3",
        help="zero-copy checksum (experiment)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    parser.add_argument(
        "--consecutive-ids",
        action="store_true",
        help="decode's block ids in prefill's order (a fresh engine's allocation), so that block spans "
        "merge; default: reversed, so that none merge",
    )
    parser.add_argument("--serve", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--buffer-mb", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.quick:
        args.tokens, args.repeats = [2048], 1  # plus the discarded warm-up run of every row
    started = time.perf_counter()
    settings = Settings(args.batch_tokens, args.checksum, args.threads, args.consecutive_ids)
    shape = f"{LAYERS} layers, block {BLOCK}, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16"
    codec_tokens = 1024 if args.quick else 2048
    # torch.compile's kernels side by side with the C ones (compiling them costs --quick 10-20 s)
    own = os.environ.get("DLLM_KV_CODEC_KERNELS", "native")
    codec_kernels = tuple(dict.fromkeys([own] if args.quick else [own, "compiled"]))
    codecs: CodecFigures = []
    for tokens in args.tokens:
        local = ("127.0.0.1", "127.0.0.1")
        wanted = 0 if codecs else codec_tokens
        rows, measured = measure_link(
            tokens, args.repeats, args.transports, local, (None, None), settings, wanted, codec_kernels
        )
        codecs = codecs or measured
        title = f"127.0.0.1, {tokens} tokens ({shape}; {rows[0].raw_bytes / 1e6:.0f} MB of KV)"
        ids = "consecutive" if args.consecutive_ids else "scattered"
        run = f"batches of {args.batch_tokens} tokens, checksum {args.checksum}, {args.threads} thread(s)"
        run += f", {ids} block ids"
        print_table(f"{title}, {run}", rows)
        if args.link:
            with emulated_link(args.link):
                rows, _ = measure_link(
                    tokens,
                    args.repeats,
                    args.transports,
                    (ADDR_PREFILL, ADDR_DECODE),
                    (NS_PREFILL, NS_DECODE),
                    settings,
                )
            print_table(f"veth + tc {args.link}, {tokens} tokens", rows)
    print(f"\ncodec on one core (torch threads = 1), {codec_tokens} tokens:")
    for kernels, name, encode, decode in codecs:
        print(f"  {name:<5} encode {encode:5.2f} GB/s   decode {decode:5.2f} GB/s   ({kernels} kernels)")
    gpu_codec()
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
