"""`--link RATE`: two network namespaces of our own joined by a veth pair, rate-limited with tc."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

NS_PREFILL, NS_DECODE = "dllm-kvb-p", "dllm-kvb-d"
VETH_PREFILL, VETH_DECODE = "dkvb-p", "dkvb-d"
ADDR_PREFILL, ADDR_DECODE = "10.213.0.1", "10.213.0.2"


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
