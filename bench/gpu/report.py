"""The short table on stderr, from the JSON report."""

from __future__ import annotations

from typing import Any

from gpu.pipe_layouts import pipe_table

GOAL_GBPS = 500.0


def table(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']}  torch {report['torch']}  triton {report['triton']}"]
    for size in report["sizes"]:
        lines.append(f"-- {size['tokens']} tokens, {size['kv_bytes'] / 1e9:.3f} GB of KV")
        lines.append(
            "   kernels   codec  GB/s: encode layers / whole, decode layers / whole; syncs enc / dec"
        )
        for row in size["codec"]:
            encode = f"{row['encode_layers_gbps']:9.2f} / {row['encode_whole_gbps']:<9.2f}"
            decode = f"{row['decode_layers_gbps']:9.2f} / {row['decode_whole_gbps']:<9.2f}"
            syncs = f"{row['encode_syncs']} / {row['decode_syncs']}"
            lines.append(f"   {row['kernels']:9s} {row['codec']:5s}  {encode} {decode} {syncs}")
        for row in size["checksum"]:
            spans = f"spans: add_all {row['spans_add_all_gbps']:.2f}, each {row['spans_each_gbps']:.2f}"
            lines.append(f"   checksum {row['kernel']:8s} {row['gbps']:.2f} GB/s; {spans}")
            in_place = row.get("blocks_in_place") or (
                f"{row['blocks_in_place_gbps']:.2f}, equal: {row['blocks_in_place_equal']}"
            )
            lines.append(f"   blocks: gathered {row['blocks_gathered_gbps']:.2f} GB/s, in place {in_place}")
        for row in size["equality"]:
            same = row["payload_equal"] and row["decoded_equal"] and row["checksum_equal"]
            lines.append(f"   equal to {row['reference']}: {row['kernels']} {row['codec']}: {same}")
        lines.append(f"   copies: {size['copies']}")
    lines.append(f"mooncake: {report['mooncake']}")
    lines.append("pipe, prefill and decode on this device:")
    lines += pipe_table(report["pipe"])
    lines.append(f"all equal: {report['all_equal']}  (goal {GOAL_GBPS} GB/s encode and decode on an H200)")
    return "\n".join(lines)
