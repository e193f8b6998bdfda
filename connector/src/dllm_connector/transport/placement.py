"""Which data path a KV transfer takes: where its staging lives and which side of PCIe the codec runs.

Pure: the caller passes what it knows (the KV cache's device type, the codec, what the transport can
do, the operator's override) and gets the path with the reason in words, which the worker logs at
start and exports in its metrics (docs/kv-connector.md, "Data path on GPU").

- `device`: staging in device memory registered once with the transport; the codec and the
  checksum run on the device; codec none over a one-sided transport writes block spans device to
  device (zero-copy, as vLLM's Mooncake connector does). Needs a transport that registers device
  memory (Mooncake's CUDA build, NCCL).
- `pinned-host`: the fallback where the transport cannot: encode on the device, then copy each
  piece into page-locked host staging while the previous piece is on the wire (and the reverse at
  decode).
- `host`: a KV cache in host memory, today's path (host staging, host kernels, XXH3).

A CPU cache may be forced onto `device` or `pinned-host` (the override): the same code then runs
with CPU tensors, which is how this machine tests it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dllm_contract.kvconfig import Compression


class DataPath(enum.StrEnum):
    DEVICE = "device"
    PINNED_HOST = "pinned-host"
    HOST = "host"


class PathSetting(enum.StrEnum):
    """The operator's choice: `auto` lets the decision below pick."""

    AUTO = "auto"
    DEVICE = "device"
    PINNED_HOST = "pinned-host"
    HOST = "host"


class DataPathError(ValueError):
    """An override the KV cache and transport cannot honour; the message says why."""


@dataclass(frozen=True)
class TransportTraits:
    """What the decision needs to know of a transport."""

    kind: str  # e.g. "mooncake (tcp)", "torch.distributed (nccl)"
    one_sided: bool
    registers_device_memory: bool  # Mooncake CUDA build (GPUDirect on RDMA), NCCL; not gloo
    why_not_device: str = ""  # in words, where it cannot
    moves_host_memory: bool = True  # NCCL moves device tensors only


@dataclass(frozen=True)
class Placement:
    path: DataPath
    reason: str
    # The cache's own memory is registered with the transport (device caches on the device path,
    # host caches on the host path), so a peer may write into its blocks.
    cache_registered: bool
    zero_copy: bool  # codec none written block to block, no staging (where head runs allow)

    def describe(self) -> str:
        mode = "zero-copy for codec none" if self.zero_copy else "staged"
        return f"{self.path.value} ({mode}): {self.reason}"


def parse_setting(raw: str | None) -> PathSetting:
    """An override as written in the environment (None or empty: auto); DataPathError if unknown."""
    text = (raw or "auto").strip().lower()
    try:
        return PathSetting(text)
    except ValueError:
        choices = ", ".join(setting.value for setting in PathSetting)
        raise DataPathError(f"KV data path {raw!r}: expected one of {choices}") from None


def choose_path(
    kv_device: str, codec: Compression, transport: TransportTraits, setting: PathSetting = PathSetting.AUTO
) -> Placement:
    """The path for a KV cache on `kv_device` ("cpu", "cuda", ...) moved with `codec` over `transport`."""
    placement = _choose(kv_device, codec, transport, setting)
    if placement.path is not DataPath.DEVICE and not transport.moves_host_memory:
        raise DataPathError(
            f"KV data path {placement.path.value} stages in host memory, which {transport.kind} cannot "
            "move; its engines need the device path (or gloo for host staging)"
        )
    return placement


def _choose(
    kv_device: str, codec: Compression, transport: TransportTraits, setting: PathSetting
) -> Placement:
    on_host = kv_device == "cpu"
    if setting is PathSetting.HOST:
        if on_host:
            return _placed(DataPath.HOST, "the KV cache is in host memory (override host)", codec, transport)
        return _placed(
            DataPath.HOST,
            f"override host: the {kv_device} KV is gathered on the device and copied through pageable "
            "host staging, encoded and checksummed on host cores",
            codec,
            transport,
            cache_in_host=False,
        )
    if setting is PathSetting.PINNED_HOST:
        where = "synchronous copies, the KV cache is in host memory" if on_host else "override"
        return _placed(DataPath.PINNED_HOST, f"pinned-host staging ({where})", codec, transport)
    if setting is PathSetting.DEVICE:
        if on_host:
            return _placed(
                DataPath.DEVICE,
                "override device on a host KV cache: the device code path with CPU tensors",
                codec,
                transport,
            )
        if not transport.registers_device_memory:
            raise DataPathError(
                f"KV data path device: {transport.kind} cannot register {kv_device} memory "
                f"({transport.why_not_device or 'no device support'}); use auto or pinned-host"
            )
        return _placed(
            DataPath.DEVICE, f"override device; {transport.kind} registers device memory", codec, transport
        )
    if on_host:
        return _placed(DataPath.HOST, "the KV cache is in host memory", codec, transport)
    if transport.registers_device_memory:
        return _placed(
            DataPath.DEVICE, f"{transport.kind} registers {kv_device} memory: no host copy", codec, transport
        )
    return _placed(
        DataPath.PINNED_HOST,
        f"{transport.kind} cannot register {kv_device} memory "
        f"({transport.why_not_device or 'no device support'}): pinned host staging, copies overlapped "
        "with the wire",
        codec,
        transport,
    )


def _placed(
    path: DataPath,
    reason: str,
    codec: Compression,
    transport: TransportTraits,
    *,
    cache_in_host: bool = True,
) -> Placement:
    # Zero-copy writes straight from (and into) the cache's own memory: only where the transport
    # takes that memory (host caches on the host path, any cache on the device path) and the codec
    # changes nothing. The pinned-host path never registers the cache: its transport cannot.
    registered = path is DataPath.DEVICE or (path is DataPath.HOST and cache_in_host)
    zero_copy = registered and codec is Compression.NONE and transport.one_sided
    return Placement(path, reason, registered, zero_copy)
