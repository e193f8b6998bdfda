"""nh64's GB/s on the device: over the KV as one run, and over its block spans."""

from __future__ import annotations

import time
from typing import Any

from gpu.kv import BLOCK, HEAD_DIM, KV_HEADS
from gpu.timing import gbps, seconds

SPAN_BYTES = BLOCK * KV_HEADS * HEAD_DIM * 2  # one block's K or V in vLLM's GPU layout: 32 KiB
SPAN_SAMPLE = 512


def checksum_rows(kv: Any, device: Any, name: str, repeats: int) -> list[dict[str, Any]]:
    """nh64 over the KV as one run, and over its 32 KiB block spans in scattered order (a zero-copy
    transfer's checksum): through add_all, and one add per span (on the first SPAN_SAMPLE spans)."""
    from dllm_connector.codec import device_checksum

    data = kv.view(-1).view(__import__("torch").uint8)
    spans = list(data.view(-1, SPAN_BYTES).unbind(0))[::-1]
    sample = spans[:SPAN_SAMPLE]
    device_checksum.use_kernel(name)
    started = time.perf_counter()
    value = device_checksum.tensor_checksum(data)
    first_call_s = round(time.perf_counter() - started, 2)

    def by_spans(pieces: list[Any], each: bool) -> int:
        running = device_checksum.RunningTensorChecksum()
        if each:
            for piece in pieces:
                running.add(piece)
        else:
            running.add_all(pieces)
        return running.value

    row = {
        "kernel": name,
        "first_call_s": first_call_s,
        "gbps": gbps(data.numel(), seconds(lambda: device_checksum.tensor_checksum(data), device, repeats)),
        "spans_add_all_gbps": gbps(data.numel(), seconds(lambda: by_spans(spans, False), device, repeats)),
        "spans_each_gbps": gbps(
            len(sample) * SPAN_BYTES, seconds(lambda: by_spans(sample, True), device, repeats)
        ),
        "value": f"{value:#018x}",
    }
    row |= blocks_fields(data, device, repeats)
    device_checksum.use_kernel("auto")
    return [row]


def blocks_fields(data: Any, device: Any, repeats: int) -> dict[str, Any]:
    """A zero-copy checksum of the KV's blocks in scattered order: gathered (a bounded buffer at a
    time, then hashed) and read in place by the kernel taking block ids, where it serves (gpu-review
    item 14), with whether the two values agree."""
    import torch

    from dllm_connector.codec import device_checksum

    words = data.view(torch.int64).view(-1, 1, 1, SPAN_BYTES // 8)
    ids = torch.arange(words.shape[0] - 1, -1, -1, device=device)
    step = max(1, device_checksum.GATHER_BYTES // SPAN_BYTES)

    def gathered() -> int:
        running = device_checksum.RunningTensorChecksum()
        for start in range(0, ids.numel(), step):
            running.add(words.index_select(0, ids[start : start + step]).view(-1).view(torch.uint8))
        return running.value

    def in_place() -> int:
        running = device_checksum.RunningTensorChecksum()
        running.add_blocks(words, ids)
        return running.value

    fields: dict[str, Any] = {"blocks_gathered_gbps": gbps(data.numel(), seconds(gathered, device, repeats))}
    if not device_checksum.blocks_in_place(device):
        return fields | {"blocks_in_place": "skipped: the kernel does not serve on this device"}
    return fields | {
        "blocks_in_place_gbps": gbps(data.numel(), seconds(in_place, device, repeats)),
        "blocks_in_place_equal": in_place() == gathered(),
    }
