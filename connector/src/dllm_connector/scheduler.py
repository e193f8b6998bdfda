"""Scheduler-side bookkeeping of the dllm KV connector: pure, no vLLM, torch or I/O.

Decides which requests load or send KV and which blocks, from the `dllm` kv_transfer_params
(protocol.py) and the settings, and hands the worker a metadata object per step. Requests are keyed
by the router's transfer id; vLLM's request ids only map results back to vLLM.

kv_transfer_params come from whoever can reach the engine's HTTP port (C1): nothing here raises
on them. Params that do not validate, that ask for the other role (a prefill-only engine given
DecodeParams, a decode-only engine given PrefillParams), or that name another TP size for the other
role than the deployment's (C1 (c): a forged `decode_tp_size` of 256 would fan one send out to 256
threads and ports of the decode pod) mean "no transfer", logged once per request in one bounded line.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from dllm_contract.kvconfig import ConnectorExtraConfig
from dllm_contract.pd_params import DecodeParams, PrefillParams, is_dllm_params

_log = logging.getLogger(__name__)
_LOGGED_REQUESTS = 1000  # request ids whose ignored params were logged (the latest)


class ConnectorConfigError(ValueError):
    """kv_connector_extra_config is invalid; raised at engine start."""


def parse_extra_config(raw: Mapping[str, Any] | None) -> ConnectorExtraConfig:
    """Strict: unknown keys and bad values stop the engine with the offending key named."""
    try:
        return ConnectorExtraConfig.model_validate(dict(raw or {}))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in issue['loc']) or '<root>'}: {issue['msg']}"
            for issue in error.errors()
        )
        raise ConnectorConfigError(
            f"invalid kv_connector_extra_config for the dllm connector: {problems}"
        ) from None


def prompt_hash(token_ids: Sequence[int]) -> str:
    """Both engines hash the prompt's token ids: a tokenization mismatch is refused, not loaded."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class LoadSpec:
    """Decode: receive transfer `transfer_id` into `block_ids` (the prompt's blocks from `skip` on)."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    skip: int
    prompt_hash: str
    prefill_tp_size: int | None = None  # which prefill ranks send parts of it; None: decode's own


@dataclass(frozen=True)
class SendSpec:
    """Prefill: push the prompt's blocks to the decode engine at host:port (rank r at port + r)."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    prompt_hash: str
    engine_id: str | None = None
    decode_tp_size: int | None = None  # which decode ranks get which KV heads; None: prefill's own


@dataclass
class StepPlan:
    """What the worker starts this step (the payload of the connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def has_kv_worth_sending(prompt_len: int) -> bool:
    """False for a one-token prompt: decode recomputes a prompt's last token anyway.

    vLLM's scheduler rewinds a request whose whole prompt was loaded by one token, so that token
    is computed again to sample the next. With one token that rewind lands on 0 computed tokens,
    which vLLM treats as a fresh request; nothing loaded would be used. Both sides apply this rule:
    decode does not wait and prefill does not send.
    """
    return prompt_len > 1


class IgnoredParams(ValueError):
    """A request's kv_transfer_params ask for a transfer this engine will not do; the message says why."""


def _dllm(params: object, flag: str) -> Mapping[str, Any] | None:
    """The params when they are dllm params asking for `flag` (anything else: None)."""
    if not isinstance(params, Mapping) or not is_dllm_params(dict(params)) or not params.get(flag):
        return None
    return params


_P = TypeVar("_P", DecodeParams, PrefillParams)


def _validated(model: type[_P], params: Mapping[str, Any]) -> _P:
    try:
        return model.model_validate(params)
    except ValidationError as error:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid"}
        where = ".".join(str(part) for part in first["loc"]) or "<params>"
        raise IgnoredParams(f"invalid {model.__name__}: {where[:60]}: {str(first['msg'])[:100]}") from None


def decode_params(params: object) -> DecodeParams | None:
    """The request's DecodeParams; None when it asks for no load; IgnoredParams when invalid."""
    asked = _dllm(params, "do_remote_prefill")
    return None if asked is None else _validated(DecodeParams, asked)


def prefill_params(params: object) -> PrefillParams | None:
    """The request's PrefillParams; None when it asks for no send; IgnoredParams when invalid."""
    asked = _dllm(params, "do_remote_decode")
    return None if asked is None else _validated(PrefillParams, asked)


# The field in which each side's params name the other side's TP size.
_PEER_TP_FIELD: Mapping[type[DecodeParams | PrefillParams], str] = {
    DecodeParams: "prefill_tp_size",
    PrefillParams: "decode_tp_size",
}


def _peer_tp_size(params: DecodeParams | PrefillParams) -> int:
    return int(getattr(params, _PEER_TP_FIELD[type(params)]))


def _named_peer_tp_size(params: DecodeParams | PrefillParams) -> int | None:
    """The other side's TP size where the request names it; None where it does not."""
    return _peer_tp_size(params) if _PEER_TP_FIELD[type(params)] in params.model_fields_set else None


class SchedulerState:
    """One engine's scheduler-side connector state."""

    def __init__(
        self,
        config: ConnectorExtraConfig,
        *,
        block_size: int,
        kv_port: int,
        sends: bool = True,
        receives: bool = True,
        tp_size: int = 1,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.kv_port = kv_port
        # The only TP size a request may name for the other role: the deployment's (C1 (c)).
        self.peer_tp_size = config.peer_tp_size or tp_size
        self.sends, self.receives = sends, receives  # the engine's kv_role
        self._logged: dict[str | None, None] = {}
        self._plan = StepPlan()
        self._loading: dict[str, str] = {}  # vLLM request id -> transfer id, until loaded
        self._load_ended: set[str] = set()  # loaded or failed, until request_finished
        self._sending: set[str] = set()

    # decode ------------------------------------------------------------------------------------

    def matched_tokens(
        self,
        params: Mapping[str, Any] | None,
        prompt_len: int,
        num_computed: int,
        request_id: str | None = None,
    ) -> tuple[int, bool]:
        """Side-effect free: how many prompt tokens decode will load; decode always loads asynchronously.

        A request's transfer is loaded at most once: vLLM asks again when it resets a request to 0
        computed tokens (preemption, a failed load under the recompute policy), and prefill sends
        each transfer once, so such a request computes its prompt locally instead of waiting.
        """
        if self._decode(request_id, params) is None or not has_kv_worth_sending(prompt_len):
            return 0, False
        if request_id is not None and request_id in self._load_ended:
            return 0, False
        count = prompt_len - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(
        self,
        request_id: str,
        params: Mapping[str, Any] | None,
        prompt_hash: str,
        prompt_len: int,
        block_ids: Sequence[int],
        num_external_tokens: int,
    ) -> None:
        decode = self._decode(request_id, params)
        if decode is None or num_external_tokens <= 0 or request_id in self._loading:
            return
        if request_id in self._load_ended or not has_kv_worth_sending(prompt_len):
            return
        skip = (prompt_len - num_external_tokens) // self.block_size
        wanted = tuple(block_ids[skip : blocks_for(prompt_len, self.block_size)])
        self._loading[request_id] = decode.transfer_id
        prefill_tp = _named_peer_tp_size(decode) or self.config.peer_tp_size
        spec = LoadSpec(request_id, decode.transfer_id, wanted, skip, prompt_hash, prefill_tp)
        self._plan.loads.append(spec)

    def loaded(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            if self._loading.pop(request_id, None) is not None:
                self._load_ended.add(request_id)
            self._sending.discard(request_id)

    # prefill / both ----------------------------------------------------------------------------

    def finished(
        self,
        request_id: str,
        params: Mapping[str, Any] | None,
        prompt_hash: str,
        prompt_len: int,
        block_ids: Sequence[int],
        length_capped: bool,
    ) -> bool:
        """request_finished: True when the blocks stay allocated until the send ends."""
        self._load_ended.discard(request_id)
        if request_id in self._loading:  # decode aborted before its KV arrived
            self._plan.cancels.append(self._loading.pop(request_id))
            return False
        prefill = self._prefill(request_id, params)
        if prefill is None or not length_capped or not block_ids or not has_kv_worth_sending(prompt_len):
            return False
        host = prefill.decode_host or self.config.decode_host
        port = prefill.decode_kv_port or self.config.decode_port
        if not host or port is None:
            return False
        wanted = tuple(block_ids[: blocks_for(prompt_len, self.block_size)])
        spec = SendSpec(
            request_id,
            prefill.transfer_id,
            wanted,
            host,
            port,
            prompt_hash,
            prefill.decode_engine_id,
            _named_peer_tp_size(prefill) or self.config.peer_tp_size,
        )
        self._plan.sends.append(spec)
        self._sending.add(request_id)
        return True

    # params from the network -------------------------------------------------------------------

    def _decode(self, request_id: str | None, params: object) -> DecodeParams | None:
        return self._usable(request_id, decode_params, params, serves=self.receives, verb="receive")

    def _prefill(self, request_id: str | None, params: object) -> PrefillParams | None:
        return self._usable(request_id, prefill_params, params, serves=self.sends, verb="send")

    def _usable(
        self,
        request_id: str | None,
        parse: Callable[[object], _P | None],
        params: object,
        *,
        serves: bool,
        verb: str,
    ) -> _P | None:
        """The params `parse` finds when this engine can act on them; None (logged once) when it cannot."""
        try:
            asked = parse(params)
            if asked is not None and not serves:
                raise IgnoredParams(f"{type(asked).__name__} sent to an engine that does not {verb} KV")
            named = None if asked is None else _named_peer_tp_size(asked)
            if asked is not None and named is not None and named != self.peer_tp_size:
                raise IgnoredParams(
                    f"{_PEER_TP_FIELD[type(asked)]} {named} is not this deployment's ({self.peer_tp_size})"
                )
        except IgnoredParams as error:
            self._ignored(request_id, error)
            return None
        return asked

    def _ignored(self, request_id: str | None, error: IgnoredParams) -> None:
        """One bounded line per request, however often vLLM asks about it."""
        if request_id in self._logged:
            return
        self._logged[request_id] = None
        while len(self._logged) > _LOGGED_REQUESTS:
            del self._logged[next(iter(self._logged))]
        shown = "?" if request_id is None else request_id[:100]
        _log.warning("kv_transfer_params of request %s ignored (no KV transfer): %s", shown, error)

    @property
    def sends_in_flight(self) -> int:
        """Requests whose blocks are held for a send not reported ended yet (the drain waits on it)."""
        return len(self._sending)

    @property
    def has_pending_sends(self) -> bool:
        """Sends not yet reported finished: the engine keeps stepping so their completions arrive."""
        return bool(self._sending)

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan
