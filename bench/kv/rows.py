"""The table's rows: each path timed on the same KV between the two workers, the median of the
timed runs after a discarded warm-up."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kv.codec_speed import CodecFigures
from kv.peer import Peer, Settings
from kv.shape import BLOCK, HEAD_DIM, KV_HEADS, LAYERS

CODECS = ("none", "fp8", "int8")
MAX_STAGING = 1 << 30  # each engine's staging buffer (bufferSizeGB); the pipe waits when it is full


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
    buffer_mb = min(kv_bytes, MAX_STAGING) // (1 << 20) + 16
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
