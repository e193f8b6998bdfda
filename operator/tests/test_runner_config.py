"""`dllm-operator run` takes every operator setting from its environment, and refuses a bad one."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from dllm_operator.config import ConfigInvalid, OperatorConfig
from dllm_operator.runner import operator_config


def test_the_admission_mirror_settings_reach_the_running_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLLM_ALLOW_PRIVILEGED_ENGINES", "false")
    monkeypatch.setenv("DLLM_ALLOWED_IMAGE_PREFIXES", "registry.example/, localhost/")
    args = argparse.Namespace(all_namespaces=False, namespace=["serving"], log_level="debug")
    config = operator_config(args)
    assert config.allow_privileged_engines is False
    assert config.allowed_image_prefixes == ("registry.example/", "localhost/")
    assert (config.namespaces, config.log_level) == (("serving",), "DEBUG")


def test_a_bad_setting_stops_the_operator_with_exit_2_naming_it() -> None:
    env = {**os.environ, "DLLM_ALLOW_PRIVILEGED_ENGINES": "maybe"}
    result = subprocess.run(
        [sys.executable, "-m", "dllm_operator", "run", "--namespace", "x"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "DLLM_ALLOW_PRIVILEGED_ENGINES" in result.stderr


@pytest.mark.parametrize(
    ("flag", "env"), [(["--log-level", "LOUD"], {}), ([], {"DLLM_LOG_LEVEL": "verbose"})]
)
def test_a_bad_log_level_stops_the_operator_with_exit_2_naming_flag_and_variable(
    flag: list[str], env: dict[str, str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dllm_operator", "run", "--namespace", "x", *flag],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("dllm-operator: --log-level (or DLLM_LOG_LEVEL): ")
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in result.stderr


def test_the_command_line_wins_over_a_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLLM_LOG_LEVEL", "verbose")
    monkeypatch.setenv("DLLM_WATCH_NAMESPACES", "a, b")
    args = argparse.Namespace(all_namespaces=True, namespace=[], log_level="warning")
    config = operator_config(args)
    assert (config.namespaces, config.log_level) == ((), "WARNING")
    args = argparse.Namespace(all_namespaces=False, namespace=[], log_level="")
    with pytest.raises(ConfigInvalid, match=r"^--log-level \(or DLLM_LOG_LEVEL\): 'verbose' is not one of"):
        operator_config(args)


def test_every_setting_has_its_variable_and_a_blank_switch_is_its_default() -> None:
    env = {
        "DLLM_ENGINE_IMAGE": "e:1",
        "DLLM_ROUTER_IMAGE": "r:1",
        "DLLM_CLUSTER_DOMAIN": "example.internal",
        "DLLM_WATCH_NAMESPACES": " a,, b ",
        "DLLM_LOG_LEVEL": "error",
        "DLLM_ALLOW_PRIVILEGED_ENGINES": " FALSE ",
        "DLLM_ALLOWED_IMAGE_PREFIXES": "",
        "DLLM_RESYNC_SECONDS": "30",
        "POD_NAME": "dllm-operator-7d9-x2",
        "POD_NAMESPACE": "dllm-system",
    }
    config = OperatorConfig.from_env(env)
    assert (config.engine_image, config.router_image, config.cluster_domain) == (
        "e:1",
        "r:1",
        env["DLLM_CLUSTER_DOMAIN"],
    )
    assert (config.namespaces, config.log_level) == (("a", "b"), "ERROR")
    assert (config.allow_privileged_engines, config.allowed_image_prefixes) == (False, ())
    assert config.resync_seconds == 30
    assert (config.pod_name, config.pod_namespace) == ("dllm-operator-7d9-x2", "dllm-system")
    assert OperatorConfig.from_env({"DLLM_ALLOW_PRIVILEGED_ENGINES": " "}).allow_privileged_engines is True
    assert OperatorConfig.from_env({}) == OperatorConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.log_level = "DEBUG"  # type: ignore[misc]


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "inf", "nan"])
def test_a_resync_period_that_is_not_a_positive_number_is_refused_naming_its_variable(raw: str) -> None:
    with pytest.raises(ConfigInvalid, match=r"^DLLM_RESYNC_SECONDS: "):
        OperatorConfig.from_env({"DLLM_RESYNC_SECONDS": raw})
