"""The engine's own tuning variables, apart from the env contract: which data path KV takes and which
codec kernels run (docs/kv-connector.md). The operator sets DLLM_KV_DATA_PATH; the rest are for
images and operators of the engine.

One frozen model filled from the variables (strings, pydantic's lax mode), as the operator's and the
router's configurations are; a bad value is a TuningInvalid naming the variable, at engine start.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from dllm_connector.transport.placement import PathSetting, parse_setting
from dllm_contract.problems import first_problem


class TuningInvalid(ValueError):
    """A tuning variable with a bad value; the message names the variable."""


class CodecKernels(StrEnum):
    """native: the C kernels (built for this CPU, or the image's ready-made library); compiled:
    torch.compile's; plain: torch ops. Where one is unavailable, the next in that order serves."""

    NATIVE = "native"
    COMPILED = "compiled"
    PLAIN = "plain"


def _kernels(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip().lower()
    if text not in set(CodecKernels):
        raise ValueError(f"{raw!r} is none of " + ", ".join(CodecKernels))
    return CodecKernels(text)


class EngineTuning(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # The operator's override of the path transport.placement would choose.
    data_path: Annotated[PathSetting, BeforeValidator(parse_setting)] = PathSetting.AUTO
    codec_kernels: Annotated[CodecKernels, BeforeValidator(_kernels)] = CodecKernels.NATIVE
    # A kvcodec library built ahead of time (what images ship); used where it matches the source
    # and this CPU can run it, else the kernels are built here.
    codec_library: Path | None = None
    # Where libraries built here are kept (default: $XDG_CACHE_HOME/dllm-connector).
    codec_cache: Path | None = None


# field -> the variable that sets it.
ENV_NAMES: Mapping[str, str] = {
    "data_path": "DLLM_KV_DATA_PATH",
    "codec_kernels": "DLLM_KV_CODEC_KERNELS",
    "codec_library": "DLLM_KV_CODEC_LIBRARY",
    "codec_cache": "DLLM_KV_CODEC_CACHE",
}


def from_env(env: Mapping[str, str]) -> EngineTuning:
    """The tuning these variables ask for (unset or blank: the default); TuningInvalid naming the
    first bad one."""
    values = {field: env[name] for field, name in ENV_NAMES.items() if env.get(name, "").strip()}
    try:
        return EngineTuning.model_validate(values)
    except ValidationError as error:
        field, message = first_problem(error)
        raise TuningInvalid(f"{ENV_NAMES.get(field, field)}: {message}") from None
