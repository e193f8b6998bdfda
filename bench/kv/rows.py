"""The table's rows: each path timed on the same KV between the two workers, in interleaved rounds
(every row once a round), the median of the rounds after a discarded warm-up of each."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv.codec_speed import CodecFigures
from kv.peer import Peer, Settings
from kv.shape import BLOCK, HEAD_DIM, KV_HEADS, LAYERS

CODECS = ("none", "fp8", "int8")
MAX_STAGING = 1 << 30  # each engine's staging buffer (bufferSizeGB); the pipe waits when it is full
IN_FLIGHT = 4  # --in-flight-rows: Mooncake's writes on the wire at once over RDMA


@dataclass
class Row:
    name: str
    seconds: float
    raw_bytes: int
    wire_bytes: int

    @property
    def gbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e9


# One run of a row's path, tagged (a fresh transfer id each): its seconds and the bytes on the wire.
Run = Callable[[str], tuple[float, int]]


def interleaved(runs: dict[str, Run], repeats: int) -> dict[str, tuple[float, int]]:
    """Each row's median seconds and wire bytes: every row once to warm connections and kernels
    (discarded), then `repeats` rounds that each run every row once, the order rotated by one a round,
    so that a change in the machine's load falls on all rows alike instead of on one row's block."""
    names = list(runs)
    for name in names:
        runs[name]("warm")
    times: dict[str, list[float]] = {name: [] for name in names}
    wire: dict[str, int] = {}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, wire[name] = runs[name](str(round_index))
            times[name].append(seconds)
    return {name: (statistics.median(times[name]), wire[name]) for name in names}


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
    """The table's rows, measured in interleaved rounds, and with `codec_tokens` the codec per core
    measured in the prefill worker."""
    blocks = -(-tokens // BLOCK)
    kv_bytes = blocks * LAYERS * KV_HEADS * BLOCK * 2 * HEAD_DIM * 2
    buffer_mb = min(kv_bytes, MAX_STAGING) // (1 << 20) + 16
    prefill = Peer("prefill", hosts[0], blocks, buffer_mb, namespaces[0], settings)
    decode = Peer("decode", hosts[1], blocks, buffer_mb, namespaces[1], settings)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        ports = decode.call("ports")
        src = list(range(blocks))
        dst = list(src) if settings.consecutive_ids else list(reversed(src))
        runs: dict[str, Run] = {"raw socket": _raw_run(prefill, decode, hosts[1], ports["raw"], kv_bytes)}
        for transport in transports:
            for codec in CODECS:
                runs[f"{transport} {codec}"] = _pipe_run(
                    prefill, decode, transport, codec, (src, dst), hosts[1], ports[transport]
                )
                if transport == "mooncake" and settings.in_flight_rows:
                    runs[f"{transport} {codec}, {IN_FLIGHT} writes at once"] = _pipe_run(
                        prefill, decode, transport, codec, (src, dst), hosts[1], ports[transport], IN_FLIGHT
                    )
        if "mooncake" in transports:
            runs |= _mooncake_alone_runs(prefill, decode, src, dst, kv_bytes)
        if namespaces == (None, None):  # over a rate-limited link they would only repeat the raw row
            runs |= _socket_spans_runs(prefill, decode, hosts[1], ports["raw"], (src, dst), kv_bytes)
        measured_rows = interleaved(runs, repeats)
        rows = [Row(name, seconds, kv_bytes, wire) for name, (seconds, wire) in measured_rows.items()]
        if not codec_tokens:
            return rows, []
        measured = prefill.call(
            "codec", tokens=codec_tokens, repeats=repeats + 1, kernels=list(codec_kernels)
        )
        return rows, [tuple(row) for row in measured["codecs"]]
    finally:
        prefill.close()
        decode.close()


def _raw_run(prefill: Peer, decode: Peer, host: str, port: int, nbytes: int) -> Run:
    def run(_: str) -> tuple[float, int]:
        decode.call("raw_recv", nbytes=nbytes)
        return prefill.call("raw_send", host=host, port=port, nbytes=nbytes)["seconds"], nbytes

    return run


def _pipe_run(
    prefill: Peer,
    decode: Peer,
    transport: str,
    codec: str,
    blocks: tuple[list[int], list[int]],
    host: str,
    port: int,
    writes_in_flight: int | None = None,
) -> Run:
    """One request's KV through our pipe: decode expects it, prefill sends it (with at most
    `writes_in_flight` writes on the wire at once, where given; else the connector's own)."""

    def run(tag: str) -> tuple[float, int]:
        transfer_id = f"{transport}-{codec}-{writes_in_flight}-{tag}"
        decode.call("expect", transport=transport, transfer_id=transfer_id, blocks=blocks[1])
        sent = prefill.call(
            "send",
            transport=transport,
            codec=codec,
            transfer_id=transfer_id,
            blocks=blocks[0],
            host=host,
            port=port,
            writes_in_flight=writes_in_flight,
        )
        outcome = decode.call("wait", transport=transport, transfer_id=transfer_id)["outcome"]
        if outcome != "":
            raise RuntimeError(f"{transport} {codec}: {outcome}")
        return sent["seconds"], sent["wire"]

    return run


def _mooncake_alone_runs(
    prefill: Peer, decode: Peer, src: list[int], dst: list[int], nbytes: int
) -> dict[str, Run]:
    """The transfer engine by itself on the same bytes: as the KV's block spans, and as one write."""
    regions = decode.call("regions", blocks=dst)

    def alone(contiguous: bool, target: list[Any]) -> Run:
        def run(_: str) -> tuple[float, int]:
            written = prefill.call(
                "write_alone", blocks=src, dst=target, session=regions["session"], contiguous=contiguous
            )
            return written["seconds"], nbytes

        return run

    return {
        "mooncake spans": alone(False, regions["spans"]),
        "mooncake 1 write": alone(True, [regions["buffer"]]),
    }


def _socket_spans_runs(
    prefill: Peer, decode: Peer, host: str, port: int, blocks: tuple[list[int], list[int]], nbytes: int
) -> dict[str, Run]:
    """The KV's spans over a plain socket, without and with the checksum on both sides."""

    def spans(checksum: bool) -> Run:
        def run(_: str) -> tuple[float, int]:
            decode.call("spans_recv", blocks=blocks[1], checksum=checksum)
            sent = prefill.call("spans_send", host=host, port=port, blocks=blocks[0], checksum=checksum)
            if checksum and not sent["matched"]:
                raise RuntimeError("socket spans: the checksums of the two sides differ")
            return sent["seconds"], nbytes

        return run

    return {"socket spans": spans(False), "socket spans+xxh3": spans(True)}
