"""The engine's tuning variables: defaults when unset, a person's spelling accepted, and a bad value
refused at start naming its variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_connector.transport.placement import PathSetting
from dllm_connector.tuning import CodecKernels, EngineTuning, TuningInvalid, from_env


def test_unset_or_blank_variables_are_the_defaults() -> None:
    defaults = EngineTuning()
    assert from_env({}) == defaults
    assert from_env({"DLLM_KV_DATA_PATH": " ", "DLLM_KV_CODEC_KERNELS": ""}) == defaults
    assert defaults.data_path is PathSetting.AUTO
    assert defaults.codec_kernels is CodecKernels.NATIVE
    assert defaults.codec_library is None


def test_each_variable_sets_its_field() -> None:
    tuning = from_env(
        {
            "DLLM_KV_DATA_PATH": " Pinned-Host ",
            "DLLM_KV_CODEC_KERNELS": "Plain",
            "DLLM_KV_CODEC_LIBRARY": "/opt/dllm/kvcodec.so",
            "DLLM_KV_CODEC_CACHE": "/var/cache/kvcodec",
            "UNRELATED": "x",
        }
    )
    assert tuning.data_path is PathSetting.PINNED_HOST
    assert tuning.codec_kernels is CodecKernels.PLAIN
    assert tuning.codec_library == Path("/opt/dllm/kvcodec.so")
    assert tuning.codec_cache == Path("/var/cache/kvcodec")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("DLLM_KV_DATA_PATH", "gpu", "DLLM_KV_DATA_PATH: KV data path 'gpu': expected one of auto, device"),
        ("DLLM_KV_CODEC_KERNELS", "fast", "DLLM_KV_CODEC_KERNELS: 'fast' is none of native, compiled, plain"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(variable: str, value: str, message: str) -> None:
    with pytest.raises(TuningInvalid, match=f"^{message}"):
        from_env({variable: value})
