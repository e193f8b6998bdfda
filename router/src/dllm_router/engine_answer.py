"""An engine's non-streamed answer, kept as the bytes it came in (NEW-1).

Answers read whole are charged to the memory budget by their bytes, so reading one must not cost many
times its bytes: parsed into Python objects, vLLM's logprobs take ~4-6x their JSON. An answer is
decoded into its top-level fields as `msgspec.Raw` (views into the engine's bytes, not copies), and a
field is decoded only where the router reads it: kv_transfer_params, a choice's finish_reason or index,
usage, the few fields of an answer turned into stream events. An answer given back cleaned or merged
is encoded from those raw pieces: each byte is copied once, into the client's answer.

Raw pieces keep the engine's own spelling inside them (its whitespace and escapes); only what the
router rewrites (the top-level object, a merged answer's choices list, a choice's index, a summed
usage) is msgspec's compact JSON.
"""

from __future__ import annotations

from typing import Any

import msgspec

KV = "kv_transfer_params"
Fields = dict[str, msgspec.Raw]
_fields = msgspec.json.Decoder(Fields)
_raw_list = msgspec.json.Decoder(list[msgspec.Raw])
_any = msgspec.json.Decoder()


class ChoiceHead(msgspec.Struct):
    """What the router reads of a choice; its other fields (logprobs, ...) are skipped, not built.
    Defaults are what a missing field reads as."""

    index: Any = 0
    finish_reason: Any = None
    text: Any = ""
    message: Any = None


_choice_head = msgspec.json.Decoder(ChoiceHead)


def choice_head(raw: msgspec.Raw) -> ChoiceHead | None:
    """A choice's head; None when the choice is not an object."""
    try:
        return _choice_head.decode(raw)
    except msgspec.ValidationError:
        return None


class EngineAnswer:
    """One JSON object answer by its top-level fields, each still raw JSON."""

    __slots__ = ("fields",)

    def __init__(self, fields: Fields) -> None:
        self.fields = fields

    @classmethod
    def parse(cls, data: bytes) -> EngineAnswer:
        """msgspec.ValidationError when `data` is JSON but not an object, else msgspec.DecodeError when
        it is not JSON (both ValueErrors). Raw pieces keep `data` alive, not a copy of it."""
        return cls(_fields.decode(data))

    def value(self, key: str, default: Any = None) -> Any:
        """A field decoded whole, `default` when absent: for small fields only (not choices)."""
        raw = self.fields.get(key)
        return default if raw is None else _any.decode(raw)

    def choices(self) -> list[msgspec.Raw]:
        """Each choice's raw JSON; none when `choices` is absent or not a list."""
        raw = self.fields.get("choices")
        if raw is None:
            return []
        try:
            return _raw_list.decode(raw)
        except msgspec.ValidationError:
            return []

    def choice_heads(self) -> list[ChoiceHead]:
        """The choices that are objects, only the fields the router reads."""
        return [head for head in map(choice_head, self.choices()) if head is not None]

    def public(self) -> bytes:
        """The answer as the client sees it: the KV-transfer bookkeeping removed."""
        return msgspec.json.encode({k: v for k, v in self.fields.items() if k != KV})


def renumbered_choices(answer: EngineAnswer, offset: int) -> list[Any]:
    """The answer's choices with `index` offset by `offset` (i * n for prompt i, as vLLM numbers a
    multi-prompt answer's), each an object of raw fields and the new index in the index's place (at the
    end when it had none); a choice that is not an object is kept as it is."""
    out: list[Any] = []
    for raw in answer.choices():
        try:
            choice: dict[str, Any] = _fields.decode(raw)
        except msgspec.ValidationError:
            out.append(raw)
            continue
        index = choice.get("index")
        choice["index"] = offset + int(0 if index is None else _any.decode(index))
        out.append(choice)
    return out
