"""The printed table of one run: GB/s per row, against the raw socket, and the bytes on the wire."""

from __future__ import annotations

from kv.rows import Row


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
