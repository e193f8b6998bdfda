"""Encoding KV blocks into a payload and decoding it back, whole or in parts, streaming."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from dllm_connector.codec.header import (
    CODE_DTYPE,
    SCALE_DTYPE,
    ChecksumError,
    CodecError,
    KVHeader,
    NonFiniteKVError,
    PayloadChecksum,
    as_bytes,
    check_geometry,
    checksum,
    dtype_name,
    effective_codec,
)
from dllm_connector.codec.kernel_sets import DECODE_CHUNK_ELEMENTS, kernels
from dllm_contract.kvconfig import Compression


def _target(out: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < nbytes:
        raise CodecError(f"output buffer must be a contiguous uint8 vector of at least {nbytes} bytes")
    return out[:nbytes]


def encode(
    blocks: torch.Tensor, requested: Compression, groups: int, out: torch.Tensor | None = None
) -> tuple[KVHeader, torch.Tensor]:
    """Encode a contiguous [N, ...] block batch; returns the header and the payload (a view of out)."""
    return encode_parts([blocks], tuple(blocks.shape), blocks.dtype, requested, groups, out)


def encode_parts(
    parts: Iterable[torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requested: Compression,
    groups: int,
    out: torch.Tensor | None = None,
    on_part: Callable[[list[tuple[int, int]]], None] | None = None,
) -> tuple[KVHeader, torch.Tensor]:
    """Encode a batch of `shape` handed over in consecutive parts along its first axis.

    A part may be overwritten once the next is taken (e.g. one layer at a time in a reused buffer),
    so each is encoded, and hashed, while still in cache, with no batch-sized copy in between.
    `on_part(ranges)` is told the payload byte ranges each part filled (its data, and its scales),
    final (hashed, never written again), so they can go on the wire while the next part encodes.
    """
    name = dtype_name(dtype)
    check_geometry(name, shape, groups)
    codec = effective_codec(requested, dtype)
    draft = KVHeader(codec, name, shape, groups, 0)
    payload = _target(out, draft.payload_nbytes)
    writer = _PartWriter(draft, payload)
    for part in parts:
        filled = writer.write(part)
        if on_part is not None:
            on_part(filled)
    return KVHeader(codec, name, shape, groups, writer.finish()), payload


class _PayloadViews:
    """A payload seen as its parts: raw bytes per first-axis entry (none), or code rows and scales."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        self._header, self._payload = header, payload
        if header.codec is not Compression.NONE:
            codes = payload[: header.data_nbytes].view(CODE_DTYPE[header.codec])
            self._codes = codes.view(header.num_scales, -1)
            self._scales = payload[header.data_nbytes :].view(SCALE_DTYPE)


class _PartWriter(_PayloadViews):
    """Encodes consecutive parts of a batch into their places in one payload."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        super().__init__(header, payload)
        self._done = 0  # first-axis entries written so far
        self._checksum = PayloadChecksum(header, payload)

    def write(self, part: torch.Tensor) -> list[tuple[int, int]]:
        """Encode the next part into its place; returns the payload byte ranges it filled."""
        header = self._header
        if (
            part.dim() != len(header.shape)
            or part.shape[1:] != header.shape[1:]
            or part.dtype != header.torch_dtype
        ):
            raise CodecError(f"part {list(part.shape)} {part.dtype} does not fit batch {list(header.shape)}")
        count = part.shape[0]
        if not part.is_contiguous():
            raise CodecError("KV blocks must be contiguous; gather them first")
        if self._done + count > header.shape[0]:
            raise CodecError(f"parts hold more than the batch's {header.shape[0]} entries")
        filled = header.ranges(self._done, count)
        if header.codec is Compression.NONE:
            start, stop = filled[0]
            target, source = self._payload[start:stop], as_bytes(part)
            if source.data_ptr() != target.data_ptr():  # a part gathered in place needs no copy
                target.copy_(source)
        else:
            first, last = self._done * header.groups, (self._done + count) * header.groups
            rows = part.reshape(count * header.groups, -1)
            _quantize_rows(rows, header.codec, self._codes[first:last], self._scales[first:last])
        self._checksum.add(filled)
        self._done += count
        return filled

    def finish(self) -> int:
        """Check that every entry came and every scale is finite; returns the payload's checksum."""
        header = self._header
        if self._done != header.shape[0]:
            raise CodecError(f"parts held {self._done} of the batch's {header.shape[0]} entries")
        if header.codec is not Compression.NONE and not bool(torch.isfinite(self._scales).all()):
            bad = int((~torch.isfinite(self._scales)).sum())
            raise NonFiniteKVError(
                f"{bad} of {self._scales.numel()} scale groups hold NaN or inf; use codec none"
            )
        return self._checksum.value


def _row_chunks(rows: int, row_len: int, chunk_elements: int) -> range:
    """Chunk starts: whole rows, about chunk_elements per kernel call."""
    return range(0, rows, max(1, chunk_elements // row_len))


def _quantize_rows(rows: torch.Tensor, codec: Compression, codes: torch.Tensor, scales: torch.Tensor) -> None:
    chosen = kernels()
    functions = chosen.by_codec[codec]
    chunks = _row_chunks(rows.shape[0], rows.shape[1], chosen.chunk_elements)
    for start in chunks:
        stop = start + chunks.step
        functions.encode_into(rows[start:stop], codes[start:stop], scales[start:stop])


def verify(header: KVHeader, payload: torch.Tensor) -> torch.Tensor:
    """The payload trimmed to its size, after its length and checksum matched the header."""
    payload = _trimmed(header, payload)
    _check_checksum(checksum(header, payload), header.checksum)
    return payload


def _trimmed(header: KVHeader, payload: torch.Tensor) -> torch.Tensor:
    if payload.numel() < header.payload_nbytes:
        raise CodecError(f"payload has {payload.numel()} bytes, header says {header.payload_nbytes}")
    return payload[: header.payload_nbytes]


def _check_checksum(actual: int, expected: int) -> None:
    if actual != expected:
        raise ChecksumError(f"KV payload checksum {actual:#018x} != header {expected:#018x}")


def _part_entries(header: KVHeader, parts: int) -> int:
    """First-axis entries per part, where the batch splits into `parts` equal parts."""
    if parts <= 0 or header.shape[0] % parts:
        raise CodecError(f"a batch of {header.shape[0]} entries does not split into {parts} parts")
    return header.shape[0] // parts


def decode(header: KVHeader, payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify and decode a payload into a [N, ...] tensor of the source dtype (written into out if given)."""
    dtype = header.torch_dtype
    if out is None:
        out = torch.empty(header.shape, dtype=dtype)
    elif tuple(out.shape) != header.shape or out.dtype != dtype or not out.is_contiguous():
        raise CodecError(f"decode target must be contiguous {dtype} of shape {list(header.shape)}")
    _PartReader(header, verify(header, payload)).read_into(0, out)
    return out


def decode_parts(header: KVHeader, payload: torch.Tensor, parts: int) -> Iterator[torch.Tensor]:
    """Verify a payload, then decode it in `parts` equal consecutive parts along the first axis.

    Every part is written into the same buffer, valid until the next one is taken: a consumer that
    places each part right away (e.g. one layer into its KV blocks) finds it still in cache.
    """
    count = _part_entries(header, parts)
    reader = _PartReader(header, verify(header, payload))
    part = torch.empty((count, *header.shape[1:]), dtype=header.torch_dtype)
    for index in range(parts):
        reader.read_into(index * count, part)
        yield part


class StreamingDecode:
    """Decodes a payload part by part as its parts arrive, and verifies it once all have.

    For a payload written in pieces: part k can be decoded once its data and scales are in,
    before the rest of the payload is, so decode overlaps the wire. Each part's data and scales
    are hashed just before it is decoded (then read from cache), each region in order, as
    `checksum` hashes them. Decoded parts are not verified until `verify`: a consumer that places
    them must treat the places as failed if it raises.
    """

    def __init__(self, header: KVHeader, payload: torch.Tensor, parts: int) -> None:
        self._header, self._parts = header, parts
        self._count = _part_entries(header, parts)
        payload = _trimmed(header, payload)
        self._reader = _PartReader(header, payload)
        self._part = torch.empty((self._count, *header.shape[1:]), dtype=header.torch_dtype)
        self._checksum = PayloadChecksum(header, payload)
        self.decoded = 0  # parts decoded so far

    def parts_until(self, stop: int) -> Iterator[torch.Tensor]:
        """Decode parts up to `stop` (exclusive), each into one reused buffer, in order."""
        if not self.decoded <= stop <= self._parts:
            raise CodecError(f"parts {self.decoded}..{stop} are not the next of {self._parts}")
        while self.decoded < stop:
            first = self.decoded * self._count
            self._checksum.add(self._header.ranges(first, self._count))
            self._reader.read_into(first, self._part)
            self.decoded += 1
            yield self._part

    def verify(self, expected: int) -> None:
        """After every part: the payload's checksum must be `expected` (the sender's)."""
        if self.decoded != self._parts:
            raise CodecError(f"verified after {self.decoded} of {self._parts} parts")
        _check_checksum(self._checksum.value, expected)


class _PartReader(_PayloadViews):
    """Decodes any run of a verified payload's first-axis entries into a tensor."""

    def read_into(self, first: int, out: torch.Tensor) -> None:
        header, count = self._header, out.shape[0]
        if header.codec is Compression.NONE:
            start, stop = header.ranges(first, count)[0]
            as_bytes(out).copy_(self._payload[start:stop])
            return
        rows = slice(first * header.groups, (first + count) * header.groups)
        target = out.view(count * header.groups, -1)
        decode_into = kernels().by_codec[header.codec].decode_into
        limit = float(torch.finfo(header.torch_dtype).max)
        codes, scales = self._codes[rows], self._scales[rows]
        # L3: scales come from the peer; a NaN, inf or non-positive one would be decoded into the cache
        if not bool(((scales > 0) & torch.isfinite(scales)).all()):
            raise CodecError("received KV scales are not all finite and positive")
        chunks = _row_chunks(target.shape[0], target.shape[1], DECODE_CHUNK_ELEMENTS[header.codec])
        for start in chunks:
            stop = start + chunks.step
            decode_into(codes[start:stop], scales[start:stop], limit, target[start:stop])
