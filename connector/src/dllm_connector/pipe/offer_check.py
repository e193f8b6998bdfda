"""Whether a prefill offer fits decode: the caches alike, then the part it claims of what decode expects."""

from __future__ import annotations

from dllm_connector.layout import HeadRange, PagedKV, signature_mismatches
from dllm_connector.pipe.common import RefusedWithDetail, TransferFailed
from dllm_connector.pipe.expectations import Expectation, Part
from dllm_connector.pipe.messages import Offer, bounded


def check_caches(kv: PagedKV, offer: Offer) -> None:
    """The sender's cache signature matches decode's `kv`; RefusedWithDetail naming what differs."""
    mismatches = signature_mismatches(kv.signature(), offer.signature)
    if mismatches:
        # L2: decode's outcome and log have both sides (bounded); the peer learns only which
        # fields differ, never decode's values
        keys = sorted({line.split(":", 1)[0] for line in mismatches})
        raise RefusedWithDetail(
            "KV cache mismatch between prefill and decode: " + bounded("; ".join(mismatches)),
            "KV cache mismatch between prefill and decode in: " + bounded(", ".join(keys)),
        )


def check_claim(kv: PagedKV, engine_id: str | None, offer: Offer, expectation: Expectation) -> Part:
    """The offer fits what decode expects (engine, prompt, blocks, TP rank and heads): its part."""
    wanted_engine = offer.engine_id
    if wanted_engine and engine_id and wanted_engine != engine_id:
        raise TransferFailed(
            f"prefill was sent to decode engine {bounded(wanted_engine)!r}, this is {engine_id!r}"
        )
    if offer.prompt_hash != expectation.prompt_hash:  # L3: never skipped
        raise TransferFailed("prompt token ids differ between prefill and decode (tokenization mismatch)")
    count = len(expectation.block_ids)
    if expectation.skip + count > offer.num_blocks:
        raise TransferFailed(
            f"decode wants {count} blocks after {expectation.skip}, prefill has {offer.num_blocks}"
        )
    rank, heads = _check_tp(kv, offer, expectation)
    if expectation.failure or rank in expectation.claimed:
        raise TransferFailed(f"transfer {expectation.transfer_id} is not awaited any more")
    return Part(expectation, rank, kv.part_heads(heads))


def _check_tp(kv: PagedKV, offer: Offer, expectation: Expectation) -> tuple[int, HeadRange | None]:
    """The offering prefill rank and the model heads it sends, as decode's TP mapping wants them."""
    own, tp = kv.tp, offer.tp
    rank, size = tp.rank, tp.size
    decode_rank = rank if tp.decode_rank is None else tp.decode_rank
    heads = tp.heads
    if size != expectation.prefill_tp:
        raise TransferFailed(
            f"prefill TP size {size} offered, decode (TP {own.size}) expects prefill TP "
            f"{expectation.prefill_tp} for this request"
        )
    if decode_rank != own.rank:
        raise TransferFailed(
            f"prefill TP rank {rank} addressed decode TP rank {decode_rank}, this is rank {own.rank}"
        )
    if rank not in expectation.senders or expectation.senders[rank] != heads:
        wanted = expectation.senders.get(rank, "no heads")
        raise TransferFailed(
            f"prefill TP rank {rank} of {size} offered KV heads {heads}, decode TP rank {own.rank} "
            f"of {own.size} wants {wanted} from it"
        )
    return rank, heads
