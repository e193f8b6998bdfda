"""Encoding KV blocks into a payload and decoding it back, whole or in parts, streaming."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch

from dllm_connector.codec.header import (
    CODE_DTYPE,
    SCALE_DTYPE,
    ChecksumAlgo,
    ChecksumError,
    CodecError,
    KVHeader,
    NonFiniteKVError,
    PayloadChecksum,
    as_bytes,
    check_geometry,
    checksum,
    default_checksum_algo,
    dtype_name,
    effective_codec,
)
from dllm_connector.codec.kernel_sets import DECODE_CHUNK_ELEMENTS, device_kernels
from dllm_contract.kvconfig import Compression

# Elements per kernel call on a device (not the CPU): each call has a fixed cost in launches, so calls
# take whole parts (a layer of a long prompt is 64M elements); this only bounds the temporaries of
# plain torch ops (float32, 256 MiB each) where the compiled kernels do not serve.
DEVICE_CHUNK_ELEMENTS = 1 << 26


def device_path(header: KVHeader, payload: torch.Tensor) -> bool:
    """Whether a payload goes the device's way: large kernel calls, no host sync before its end
    (deferred scale checks). That of every payload off the host, and of nh64 ones on the host too, so
    that this path runs, and is tested, on a CPU as well."""
    return payload.device.type != "cpu" or header.checksum_algo is ChecksumAlgo.NH64


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
    *,
    checksum_algo: ChecksumAlgo | None = None,
) -> tuple[KVHeader, torch.Tensor]:
    """Encode a batch of `shape` handed over in consecutive parts along its first axis.

    A part may be overwritten once the next is taken (e.g. one layer at a time in a reused buffer),
    so each is encoded, and hashed, while still in cache, with no batch-sized copy in between.
    `on_part(ranges)` is told the payload byte ranges each part filled (its data, and its scales),
    final (never written again), so they can go on the wire while the next part encodes. On a
    device they are final once the kernels queued so far ran: a caller that hands them to anything
    not ordered on the current stream (a NIC, another stream) waits for that first (an event).

    Everything runs where `out` is: on a device, torch kernels and the nh64 checksum, with one host
    sync at the end (the checksum and the scales' check); on the host, the C kernels and XXH3-64.
    `checksum_algo` overrides the checksum's algorithm (nh64 on the host runs the device path's).
    """
    name = dtype_name(dtype)
    check_geometry(name, shape, groups)
    codec = effective_codec(requested, dtype)
    payload = _target(out, KVHeader(codec, name, shape, groups, 0).payload_nbytes)
    algo = default_checksum_algo(payload) if checksum_algo is None else checksum_algo
    draft = KVHeader(codec, name, shape, groups, 0, algo)
    writer = _PartWriter(draft, payload)
    for part in parts:
        filled = writer.write(part)
        if on_part is not None:
            on_part(filled)
    return replace(draft, checksum=writer.finish()), payload


class _PayloadViews:
    """A payload seen as its parts: raw bytes per first-axis entry (none), or code rows and scales."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        self._header, self._payload = header, payload
        self._on_device = device_path(header, payload)
        if header.codec is not Compression.NONE:
            codes = payload[: header.data_nbytes].view(CODE_DTYPE[header.codec])
            self._codes = codes.view(header.num_scales, -1)
            self._scales = payload[header.data_nbytes :].view(SCALE_DTYPE)

    @property
    def on_device(self) -> bool:
        return self._on_device


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
            codes, scales = self._codes[first:last], self._scales[first:last]
            _quantize_rows(rows, header.codec, codes, scales, on_device=self._on_device)
        if not self._on_device:  # on a device the whole regions are hashed at `finish`: fewer launches
            self._checksum.add(filled)
        self._done += count
        return filled

    def finish(self) -> int:
        """Check that every entry came and every scale is finite; returns the payload's checksum."""
        header = self._header
        if self._done != header.shape[0]:
            raise CodecError(f"parts held {self._done} of the batch's {header.shape[0]} entries")
        if self._on_device:
            self._checksum.add(header.ranges(0, header.shape[0]))
        value = self._checksum.value  # first: on a device, this sync also ends the encode
        if header.codec is not Compression.NONE and not bool(torch.isfinite(self._scales).all()):
            bad = int((~torch.isfinite(self._scales)).sum())
            raise NonFiniteKVError(
                f"{bad} of {self._scales.numel()} scale groups hold NaN or inf; use codec none"
            )
        return value


def _row_chunks(rows: int, row_len: int, chunk_elements: int) -> range:
    """Chunk starts: whole rows, about chunk_elements per kernel call."""
    return range(0, rows, max(1, chunk_elements // row_len))


def _quantize_rows(
    rows: torch.Tensor, codec: Compression, codes: torch.Tensor, scales: torch.Tensor, *, on_device: bool
) -> None:
    chosen = device_kernels(codes.device, rows.dtype)
    functions = chosen.by_codec[codec]
    chunk = DEVICE_CHUNK_ELEMENTS if on_device else chosen.chunk_elements
    chunks = _row_chunks(rows.shape[0], rows.shape[1], chunk)
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
        out = torch.empty(header.shape, dtype=dtype, device=payload.device)
    elif tuple(out.shape) != header.shape or out.dtype != dtype or not out.is_contiguous():
        raise CodecError(f"decode target must be contiguous {dtype} of shape {list(header.shape)}")
    reader = _PartReader(header, verify(header, payload))
    reader.check_all_scales()
    reader.read_into(0, out)
    return out


def decode_parts(header: KVHeader, payload: torch.Tensor, parts: int) -> Iterator[torch.Tensor]:
    """Verify a payload, then decode it in `parts` equal consecutive parts along the first axis.

    Every part is written into the same buffer, valid until the next one is taken: a consumer that
    places each part right away (e.g. one layer into its KV blocks) finds it still in cache.
    """
    count = _part_entries(header, parts)
    reader = _PartReader(header, verify(header, payload))
    reader.check_all_scales()
    part = torch.empty((count, *header.shape[1:]), dtype=header.torch_dtype, device=payload.device)
    for index in range(parts):
        reader.read_into(index * count, part)
        yield part


class StreamingDecode:
    """Decodes a payload part by part as its parts arrive, and verifies it once all have.

    For a payload written in pieces: part k can be decoded once its data and scales are in,
    before the rest of the payload is, so decode overlaps the wire. Each part's data and scales
    are hashed just before it is decoded (then read from cache), each region in order, as
    `checksum` hashes them, with the algorithm `header` names (the decode side's expectation; see
    `verify`). Decoded parts are not verified until `verify`: a consumer that places them must treat
    the places as failed if it raises. On a device nothing syncs with the host before `verify`: the
    received scales' check (L3) is made there too, and bad scales decode as zeros meanwhile.
    """

    def __init__(self, header: KVHeader, payload: torch.Tensor, parts: int) -> None:
        self._header, self._parts = header, parts
        self._count = _part_entries(header, parts)
        payload = self._payload = _trimmed(header, payload)
        self._reader = _PartReader(header, payload)
        self._part = torch.empty(
            (self._count, *header.shape[1:]), dtype=header.torch_dtype, device=payload.device
        )
        self._checksum = PayloadChecksum(header, payload)
        self.decoded = 0  # parts decoded so far

    def parts_until(self, stop: int) -> Iterator[torch.Tensor]:
        """Decode parts up to `stop` (exclusive), each into one reused buffer, in order."""
        if not self.decoded <= stop <= self._parts:
            raise CodecError(f"parts {self.decoded}..{stop} are not the next of {self._parts}")
        while self.decoded < stop:
            first = self.decoded * self._count
            if not self._reader.on_device:
                self._checksum.add(self._header.ranges(first, self._count))
            self._reader.read_into(first, self._part)
            self.decoded += 1
            yield self._part

    def verify(self, expected: int, algo: ChecksumAlgo | None = None) -> None:
        """After every part: the payload's checksum by `algo` (the sender's header's; by default the
        one this stream hashed with) must be `expected`. Where the sender's algorithm is not the one
        hashed while decoding, the payload, still whole in staging, is hashed again by it."""
        if self.decoded != self._parts:
            raise CodecError(f"verified after {self.decoded} of {self._parts} parts")
        self._reader.raise_for_deferred_scales()
        algo = self._header.checksum_algo if algo is None else algo
        if algo is self._header.checksum_algo and not self._reader.on_device:
            actual = self._checksum.value
        else:  # on a device the whole payload is hashed here, in a few launches
            actual = checksum(replace(self._header, checksum_algo=algo), self._payload)
        _check_checksum(actual, expected)


class _PartReader(_PayloadViews):
    """Decodes any run of a verified payload's first-axis entries into a tensor.

    L3: scales come from the peer; a NaN, inf or non-positive one, or an int8 one above what any value
    of the cache's dtype gives (127 x it would decode past the dtype's range: inf in an fp16 cache), is
    never decoded into the cache.
    On the host a part's scales are checked before it is decoded; on the device path
    (`device_path`), where that check would stop the stream for a host sync per part, bad scales
    decode as zeros and are reported once, at `raise_for_deferred_scales` (`StreamingDecode.verify`),
    or up front by `check_all_scales` where the whole payload is in.
    """

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        super().__init__(header, payload)
        self._bad_scales: torch.Tensor | None = None  # device-side: whether any part's were bad
        self._all_checked = False

    def check_all_scales(self) -> None:
        if self._header.codec is not Compression.NONE:
            _require_valid_scales(self._scales, self._header)
        self._all_checked = True

    def raise_for_deferred_scales(self) -> None:
        if self._bad_scales is not None and bool(self._bad_scales):
            raise CodecError(_BAD_SCALES)

    def read_into(self, first: int, out: torch.Tensor) -> None:
        header, count = self._header, out.shape[0]
        if header.codec is Compression.NONE:
            start, stop = header.ranges(first, count)[0]
            as_bytes(out).copy_(self._payload[start:stop])
            return
        rows = slice(first * header.groups, (first + count) * header.groups)
        target = out.view(count * header.groups, -1)
        decode_into = device_kernels(out.device, out.dtype).by_codec[header.codec].decode_into
        limit = float(torch.finfo(header.torch_dtype).max)
        codes, scales = self._codes[rows], self._scales[rows]
        if self._all_checked:
            pass
        elif not self._on_device:
            _require_valid_scales(scales, header)
        else:
            valid = _valid_scales(scales, header)
            bad = ~valid.all()
            self._bad_scales = bad if self._bad_scales is None else self._bad_scales | bad
            scales = torch.where(valid, scales, 0.0)
        chunk = DEVICE_CHUNK_ELEMENTS if self._on_device else DECODE_CHUNK_ELEMENTS[header.codec]
        chunks = _row_chunks(target.shape[0], target.shape[1], chunk)
        for start in chunks:
            stop = start + chunks.step
            decode_into(codes[start:stop], scales[start:stop], limit, target[start:stop])


_BAD_SCALES = "received KV scales are not all finite, positive and within the KV dtype's range"


def _valid_scales(scales: torch.Tensor, header: KVHeader) -> torch.Tensor:
    valid = (scales > 0) & torch.isfinite(scales)
    if header.codec is Compression.INT8:  # encode's largest: the dtype's largest value / 127
        valid &= scales <= torch.finfo(header.torch_dtype).max / 127.0  # a Python float: no copy, no sync
    return valid


def _require_valid_scales(scales: torch.Tensor, header: KVHeader) -> None:
    if not bool(_valid_scales(scales, header).all()):
        raise CodecError(_BAD_SCALES)
