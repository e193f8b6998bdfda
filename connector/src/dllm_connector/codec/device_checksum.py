"""A 64-bit checksum of bytes computed with torch ops where the bytes are (CPU or GPU), the same value
on every device: the KV check of payloads that never visit the host (issue 20).

It catches corruption (torn, lost, swapped or flipped bytes); it authenticates nothing (the side
channel's key does that). The maths, all in wrapping 64-bit integers, which torch's int64 ops are on
CPU and CUDA alike (a test checks every step against Python integers):

- the bytes are read as little-endian 64-bit words w_i, the last one zero-padded;
- each word is mixed with a key of its position in its row of ROW_WORDS words, k_(i mod ROW_WORDS)
  (splitmix64 of the position), the NH way: x = w ^ k, and p = lo(x) * hi(x), where lo and hi are
  the signed 32-bit halves (their product never overflows);
- per row, the products and the words themselves are summed apart (wrapping sums are associative:
  any reduction order, any device, the same value). The words' sum is what a change of one word
  always moves: a product alone misses some (where hi(x) is +-1, a flip in lo(x) can cancel a flip
  of the word's own bits if both go into one sum, as an earlier definition did); the products' sum
  is what sees words moved within a row;
- each row's two sums go through murmur3's fmix64 apart, with its row number, so that swapping whole
  rows changes the value;
- the rows' mixes are summed and mixed once more with the byte count (zero padding and trailing
  zero bytes cannot collide).

On a device this is four elementwise ops and two reductions per piece, and one `.item()` at the end:
no other host sync. Pieces may be any size: `RunningTensorChecksum` carries a partial word over.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from dllm_connector.codec.views import unviewed

_log = logging.getLogger(__name__)

ROW_WORDS = 1 << 16  # 512 KiB rows: the key table stays in cache; a value costs one mix per row
# Rows per kernel call. On a CPU, 2 MiB at a time keeps the temporaries in cache (far faster than
# 64 MiB at once: docs/kv-connector.md); on a device, 256 MiB bound them while launches stay few.
_CPU_ROWS_PER_CALL = 4
GATHER_BYTES = 64 << 20  # add_all: small pieces are concatenated into runs of about this size
_DEVICE_ROWS_PER_CALL = 512
_MASK64 = (1 << 64) - 1
_LENGTH_SEED = 0xD6E8FEB86659FD93
_WORDS_SEED = 0x8CB92BA72F3D8DD7  # the row numbers' offset in the words' sums' mix
_GOLDEN = 0x9E3779B97F4A7C15  # the key table's seed and the row numbers' factor in the products' mix
_SPLITMIX_1 = 0xBF58476D1CE4E5B9
_SPLITMIX_2 = 0x94D049BB133111EB
_FMIX_1 = 0xFF51AFD7ED558CCD
_FMIX_2 = 0xC4CEB9FE1A85EC53


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _xorshift_multiply(
    x: torch.Tensor, shifts: tuple[int, int, int], factors: tuple[int, int]
) -> torch.Tensor:
    """x ^= x >> s0; x *= f0; x ^= x >> s1; x *= f1; x ^= x >> s2: the shape of both mixers below."""
    x = x ^ _shr(x, shifts[0])
    x = x * _signed(factors[0])
    x = x ^ _shr(x, shifts[1])
    x = x * _signed(factors[1])
    return x ^ _shr(x, shifts[2])


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    return _xorshift_multiply(x, (33, 33, 33), (_FMIX_1, _FMIX_2))


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    return _xorshift_multiply(x, (30, 27, 31), (_SPLITMIX_1, _SPLITMIX_2))


def fmix64(value: int) -> int:
    """murmur3's 64-bit finalizer on a Python int (the host side of the last step)."""
    value &= _MASK64
    value ^= value >> 33
    value = (value * _FMIX_1) & _MASK64
    value ^= value >> 33
    value = (value * _FMIX_2) & _MASK64
    return value ^ (value >> 33)


_keys_by_device: dict[torch.device, torch.Tensor] = {}
_keys_lock = threading.Lock()


def _keys(device: torch.device) -> torch.Tensor:
    """The position keys, computed on the device itself (integer ops: the same bits everywhere), once,
    and complete before any thread reads them: each connector thread works on its own stream."""
    keys = _keys_by_device.get(device)
    if keys is None:
        with _keys_lock:
            keys = _keys_by_device.get(device)
            if keys is None:
                positions = torch.arange(ROW_WORDS, dtype=torch.int64, device=device) + _signed(_GOLDEN)
                keys = _splitmix64(positions)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                _keys_by_device[device] = keys
    return keys


def terms_sum(words: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Over the last axis, wrapping: [sum of lo(w ^ k) * hi(w ^ k), sum of w] (a new last axis of 2;
    words int64, keys broadcast)."""
    halves = (words ^ keys).view(torch.int32).view(*words.shape[:-1], -1, 2)  # little-endian: [lo, hi]
    products = halves[..., 0].to(torch.int64)
    products.mul_(halves[..., 1])  # |lo * hi| < 2^62: no overflow
    return torch.stack([products.sum(-1), words.sum(-1)], dim=-1)


TermsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_compiled: dict[str, TermsFn] = {}  # by device type
_choice = "auto"
_choice_lock = threading.Lock()


def use_kernel(name: str) -> None:
    """How `terms_sum` runs: "eager" (torch ops), "compiled" (torch.compile; Triton on a GPU: one
    fused pass over the words), or "auto" (the default: compiled on devices other than the CPU,
    where eager's four passes would cost more than the codec; eager on the CPU)."""
    global _choice
    if name not in ("auto", "eager", "compiled"):
        raise ValueError(f"checksum kernel {name!r} is none of auto, eager, compiled")
    _choice = name


def kernel(device: torch.device) -> TermsFn:
    """The `terms_sum` in use for tensors on `device`: compiled where chosen and it works (checked
    against eager on a probe once; a failure warns and falls back to eager)."""
    wanted = _choice == "compiled" or (_choice == "auto" and device.type != "cpu")
    if not wanted:
        return terms_sum
    with _choice_lock:
        if device.type not in _compiled:
            _compiled[device.type] = _checked_compiled(device)
        return _compiled[device.type]


def _checked_compiled(device: torch.device) -> TermsFn:
    try:
        compiled: TermsFn = torch.compile(terms_sum, dynamic=True)

        # The pipe hands runs of larger buffers: passed as no views (and so probed), they meet the
        # kernel compiled here, not another one per base (gpu-review item 9).
        def unviewed_compiled(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
            return compiled(unviewed(words), unviewed(key))

        probe = torch.arange(-(3 * ROW_WORDS), 3 * ROW_WORDS, dtype=torch.int64, device=device)
        probe = probe * _signed(_GOLDEN)  # wrapping: every bit pattern kind
        keys = _keys(device)
        for words, key in (
            (probe[:5], keys[7:12]),
            (probe.view(-1, ROW_WORDS)[:1], keys),
            (probe.view(-1, ROW_WORDS), keys),
        ):
            if not torch.equal(unviewed_compiled(words, key), terms_sum(words, key)):
                _log.warning("the compiled KV checksum differs from torch ops on %s; using torch ops", device)
                return terms_sum
        return unviewed_compiled
    except Exception as error:  # noqa: BLE001 - any compiler failure means eager ops
        _log.warning("torch.compile is unavailable for the KV checksum on %s: %s", device, error)
        return terms_sum


_in_place: dict[str, bool] = {}  # by device type
_in_place_lock = threading.Lock()  # apart from _choice_lock, which the probe's `add` takes


def blocks_in_place(device: torch.device) -> bool:
    """Whether `RunningTensorChecksum.add_blocks` serves on `device`: on a GPU (and on the CPU in
    Triton's interpreter, for tests) where Triton imports and the kernel gave the gather's value on
    a probe at first use (else a warning, and callers gather)."""
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpreted:
        return False
    with _in_place_lock:
        if device.type not in _in_place:
            _in_place[device.type] = _in_place_checked(device)
        return _in_place[device.type]


def _in_place_checked(device: torch.device) -> bool:
    """The kernel against the gather on blocks that start 50 words before a row ends (so they run
    into the next row), with runs of 40 words and of 1100: both of its compiled variants."""
    try:
        generator = torch.Generator().manual_seed(7)
        prefix = torch.zeros((ROW_WORDS - 50) * 8, dtype=torch.uint8, device=device)
        for shape in ((5, 2, 3, 40), (4, 1, 2, 1100)):
            cache = torch.randint(-(2**62), 2**62, shape, generator=generator, dtype=torch.int64).to(device)
            ids = torch.tensor([3, 0, 2], dtype=torch.int64, device=device)
            in_place, gathered = RunningTensorChecksum(), RunningTensorChecksum()
            for running in (in_place, gathered):
                running.add(prefix)
            in_place.add_blocks(cache, ids)
            gathered.add(cache.index_select(0, ids).view(-1).view(torch.uint8))
            if in_place.value != gathered.value:
                _log.warning(
                    "the KV checksum kernel reading blocks in place differs from the gather on %s", device
                )
                return False
        return True
    except Exception as error:  # noqa: BLE001 - no Triton, or it fails here: the gather serves
        _log.warning("the KV checksum cannot read blocks in place on %s: %s", device, error)
    return False


def _as_words(data: torch.Tensor) -> torch.Tensor:
    """A uint8 run whose length is a multiple of 8 as int64 words, copied once if misaligned."""
    if data.storage_offset() % 8:
        data = data.clone()
    return data.view(torch.int64)


def _check(data: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(
            f"checksummed data must be a contiguous 1-D uint8 tensor, not {data.dtype} {list(data.shape)}"
        )


class RunningTensorChecksum:
    """`tensor_checksum` fed piece by piece, in order: equal to `tensor_checksum` of the concatenation
    of every piece, for any split (a partial word at a piece's end is carried to the next one).

    State stays on the pieces' device (all pieces must be on one device); only `value` syncs.
    """

    def __init__(self) -> None:
        self._nbytes = 0
        self._device: torch.device | None = None
        self._rows: torch.Tensor | None = None  # per row: the wrapping sums [products, words]
        self._carry: torch.Tensor | None = None  # the bytes of a word not yet whole (< 8)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def add(self, data: torch.Tensor) -> None:
        _check(data)
        if data.numel() == 0:
            return
        if self._device is None:
            self._device = data.device
        elif data.device != self._device:
            raise ValueError(f"checksum pieces on {data.device} and {self._device}: one device only")
        carried = 0 if self._carry is None else self._carry.numel()
        if carried:
            assert self._carry is not None
            take = min(8 - carried, data.numel())
            self._carry = torch.cat([self._carry, data[:take]])
            self._nbytes += take
            data = data[take:]
            if self._carry.numel() < 8:
                return
            self._add_words(_as_words(self._carry), (self._nbytes - 8) // 8)
            self._carry = None
        whole = data.numel() // 8 * 8
        if whole:
            self._add_words(_as_words(data[:whole]), self._nbytes // 8)
            self._nbytes += whole
        if whole < data.numel():
            self._carry = data[whole:].clone()
            self._nbytes += data.numel() - whole

    def add_all(self, pieces: Iterable[torch.Tensor], gather_bytes: int = GATHER_BYTES) -> None:
        """`add` each piece in order, small ones gathered first into runs of about `gather_bytes`
        (one concatenation each): a piece costs a dozen kernel launches, its bytes a copy, so many
        small pieces (a cache's 32 KiB block spans) are hashed at the device's speed, not the
        launches'. The value is the same: it is defined over the concatenation."""
        pending: list[torch.Tensor] = []
        size = 0
        for piece in pieces:
            _check(piece)
            if piece.numel() >= gather_bytes:
                self._add_gathered(pending)
                pending, size = [], 0
                self.add(piece)
                continue
            pending.append(piece)
            size += piece.numel()
            if size >= gather_bytes:
                self._add_gathered(pending)
                pending, size = [], 0
        self._add_gathered(pending)

    def add_blocks(self, words: torch.Tensor, ids: torch.Tensor) -> None:
        """`add` of the bytes of `words[ids]`, the blocks in order, read where they lie by
        block_checksum's kernel (no gathered copy; only where `blocks_in_place` says it serves).
        `words`: a layer's blocks as layout.block_words gives them; `ids`: checked, on their device."""
        if self._carry is not None:
            raise ValueError("blocks are added at whole words: the bytes before them end mid-word")
        if self._device is None:
            self._device = words.device
        elif words.device != self._device:
            raise ValueError(f"checksum pieces on {words.device} and {self._device}: one device only")
        from dllm_connector.codec import block_checksum

        first, count = self._nbytes // 8, ids.numel() * words[0].numel()
        self._reserve((first + count + ROW_WORDS - 1) // ROW_WORDS)  # the rows the words reach
        assert self._rows is not None
        block_checksum.add_block_terms(self._rows, words, ids, first, _keys(words.device))
        self._nbytes += count * 8

    def _add_gathered(self, pieces: list[torch.Tensor]) -> None:
        if len(pieces) > 1:
            devices = {piece.device for piece in pieces}
            if len(devices) > 1:
                raise ValueError(f"checksum pieces on {sorted(map(str, devices))}: one device only")
            self.add(torch.cat(pieces))
        elif pieces:
            self.add(pieces[0])

    def _add_words(self, words: torch.Tensor, first: int) -> None:
        """Add the terms of words at word positions [first, first + len), row by row."""
        keys, terms = _keys(words.device), kernel(words.device)
        row, offset = divmod(first, ROW_WORDS)
        self._reserve(row + (offset + words.numel() + ROW_WORDS - 1) // ROW_WORDS)
        assert self._rows is not None
        done = 0
        if offset:  # the rest of a row begun by an earlier piece
            done = min(ROW_WORDS - offset, words.numel())
            self._rows[row] += terms(words[:done], keys[offset : offset + done])
            row += 1
        whole = (words.numel() - done) // ROW_WORDS
        step = _CPU_ROWS_PER_CALL if words.device.type == "cpu" else _DEVICE_ROWS_PER_CALL
        for start in range(0, whole, step):
            count = min(step, whole - start)
            rows = words[done : done + count * ROW_WORDS].view(count, ROW_WORDS)
            self._rows[row : row + count] += terms(rows, keys)
            done += count * ROW_WORDS
            row += count
        if done < words.numel():
            rest = words.numel() - done
            self._rows[row] += terms(words[done:], keys[:rest])

    def _reserve(self, rows: int) -> None:
        have = 0 if self._rows is None else self._rows.shape[0]
        if rows <= have:
            return
        grown = torch.zeros(max(rows, 2 * have, 16), 2, dtype=torch.int64, device=self._device)
        if self._rows is not None:
            grown[:have] = self._rows
        self._rows = grown

    def total(self) -> torch.Tensor | None:
        """The device-side part of `value` (a 0-d int64 tensor, None for no bytes): the mixed rows'
        sum, the carried partial word included. `finish` turns it into the value."""
        if self._nbytes == 0:
            return None
        assert self._device is not None
        rows = (self._nbytes + ROW_WORDS * 8 - 1) // (ROW_WORDS * 8)
        sums = torch.zeros(rows, 2, dtype=torch.int64, device=self._device)
        if self._rows is not None:
            have = min(rows, self._rows.shape[0])
            sums[:have] += self._rows[:have]
        if self._carry is not None:
            padded = torch.zeros(8, dtype=torch.uint8, device=self._device)
            padded[: self._carry.numel()] = self._carry
            position = self._nbytes // 8
            key = _keys(self._device)[position % ROW_WORDS]
            sums[position // ROW_WORDS] += terms_sum(padded.view(torch.int64), key.reshape(1))
        numbers = torch.arange(1, rows + 1, dtype=torch.int64, device=self._device)
        products = _fmix64(sums[:, 0] + numbers * _signed(_GOLDEN))
        words = _fmix64(sums[:, 1] + numbers * _signed(_WORDS_SEED))
        return (products + words).sum()

    def finish(self, total: int | None) -> int:
        """The value from `total()`'s number (read with `.item()`, maybe with others at once)."""
        if total is None:
            total = 0
        return fmix64(total + fmix64(self._nbytes + _LENGTH_SEED))

    @property
    def value(self) -> int:
        total = self.total()
        return self.finish(None if total is None else int(total.item()))


def values(running: Sequence[RunningTensorChecksum]) -> list[int]:
    """The values of several running checksums on one device, read with one host sync."""
    totals = [one.total() for one in running]
    present = [total for total in totals if total is not None]
    read = iter(torch.stack(present).tolist() if present else [])
    return [
        one.finish(None if total is None else next(read)) for one, total in zip(running, totals, strict=True)
    ]


def tensor_checksum(data: torch.Tensor) -> int:
    """The checksum of a contiguous 1-D uint8 tensor on any device: the same value on every device."""
    running = RunningTensorChecksum()
    running.add(data)
    return running.value
