"""`--checksum crc32|off`: another checksum, or none, in the place of XXH3 for zero-copy transfers."""

from __future__ import annotations


class RunningCrc32:
    """zlib's CRC-32 in the place of the pipe's running XXH3 (the connector's checksum before it)."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, addr: int, nbytes: int) -> None:
        import ctypes
        import zlib

        self.value = zlib.crc32((ctypes.c_ubyte * nbytes).from_address(addr), self.value)


class NoChecksum:
    """No checksum at all: what the zero-copy checksum costs on both sides."""

    value = 0

    def add(self, addr: int, nbytes: int) -> None:
        pass


def use_zero_copy_checksum(kind: type[RunningCrc32 | NoChecksum]) -> None:
    """The experiment: `kind` in the place of XXH3 for host-path zero-copy chunks, on both sides (the
    sender's and the receiver's chunk checksums are both span_checksum.HostChunkChecksum)."""
    from dllm_connector.pipe import span_checksum

    span_checksum.RunningChecksum = kind  # type: ignore[attr-defined, assignment]
