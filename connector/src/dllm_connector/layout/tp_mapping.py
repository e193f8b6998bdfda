"""Model KV heads across tensor-parallel ranks: which heads each prefill rank sends each decode rank.

Pure integer maths (no torch): the errors, the geometry a handshake compares, a worker's TP rank, and
`plan_tp_mapping`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class LayoutError(ValueError):
    """The caches cannot be transferred block-wise, or two workers' caches do not match."""


class TPMappingError(LayoutError):
    """The model's KV heads cannot be mapped between the prefill and decode TP sizes."""


HeadRange = tuple[int, int]  # [start, stop) of KV heads


@dataclass(frozen=True)
class Geometry:
    """The model facts a handshake compares; the caches must agree with them."""

    block_size: int
    num_kv_heads: int  # this TP rank's KV heads (vLLM's get_num_kv_heads)
    head_dim: int
    kv_cache_dtype: str = "auto"
    model: str = ""
    total_kv_heads: int = 0  # the model's KV heads over all TP ranks; 0: num_kv_heads (TP 1)

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads


@dataclass(frozen=True)
class TPRank:
    """A worker's place in its engine's tensor-parallel group."""

    rank: int = 0
    size: int = 1


# ---- TP ranks and KV heads (pure) ------------------------------------------------------------------


def head_split_problem(num_kv_heads: int, tp_size: int) -> str | None:
    """Why vLLM cannot split `num_kv_heads` over `tp_size` ranks, or None when it can."""
    if num_kv_heads < 1 or tp_size < 1:
        return f"{num_kv_heads} KV heads over TP {tp_size} (both must be at least 1)"
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        return f"{num_kv_heads} KV heads do not split evenly over TP {tp_size}"
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        return f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads (no whole replicas)"
    return None


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> HeadRange:
    """The model KV heads TP rank `rank` holds, split as vLLM does.

    With at least as many heads as ranks, each rank holds H/t consecutive heads; with fewer, heads
    are replicated and rank r holds head r*H//t (t/H ranks share it).
    """
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * num_kv_heads // tp_size
    return head, head + 1


def _holders(num_kv_heads: int, tp_size: int, head: int) -> range:
    """The ranks that hold `head`."""
    if num_kv_heads >= tp_size:
        rank = head // (num_kv_heads // tp_size)
        return range(rank, rank + 1)
    share = tp_size // num_kv_heads
    return range(head * share, (head + 1) * share)


@dataclass(frozen=True)
class TPMapping:
    """Which model KV heads each prefill rank sends to each decode rank."""

    num_kv_heads: int
    prefill_tp: int
    decode_tp: int
    pairs: Mapping[tuple[int, int], HeadRange]  # (prefill rank, decode rank) -> model heads

    def sends_from(self, prefill_rank: int) -> dict[int, HeadRange]:
        """Decode rank -> the heads this prefill rank sends it."""
        return {dst: heads for (src, dst), heads in self.pairs.items() if src == prefill_rank}

    def senders_to(self, decode_rank: int) -> dict[int, HeadRange]:
        """Prefill rank -> the heads it sends this decode rank (together: all the rank holds)."""
        return {src: heads for (src, dst), heads in self.pairs.items() if dst == decode_rank}


def plan_tp_mapping(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> TPMapping:
    """Map every head each decode rank holds to exactly one prefill rank that holds it.

    Where prefill replicates a head, the decode ranks that need it take turns among its holders,
    so no head is sent twice to one decode rank and the senders share the work.
    """
    for tp_size in (prefill_tp, decode_tp):
        problem = head_split_problem(num_kv_heads, tp_size)
        if problem is not None:
            raise TPMappingError(
                f"cannot map {num_kv_heads} KV heads from prefill TP {prefill_tp} to decode TP "
                f"{decode_tp}: {problem}"
            )
    heads_of: dict[tuple[int, int], list[int]] = {}
    for decode_rank in range(decode_tp):
        for head in range(*rank_heads(num_kv_heads, decode_tp, decode_rank)):
            holders = _holders(num_kv_heads, prefill_tp, head)
            sender = holders[decode_rank % len(holders)]
            heads_of.setdefault((sender, decode_rank), []).append(head)
    pairs: dict[tuple[int, int], HeadRange] = {}
    for pair, heads in sorted(heads_of.items()):
        if heads != list(range(heads[0], heads[-1] + 1)):  # by construction; never an AssertionError
            raise TPMappingError(f"the KV heads TP rank pair {pair} would exchange are not consecutive")
        pairs[pair] = (heads[0], heads[-1] + 1)
    return TPMapping(num_kv_heads, prefill_tp, decode_tp, pairs)


# ---- one worker's caches ----------------------------------------------------------------------------
