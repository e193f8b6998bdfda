"""The KV-compatibility fingerprint (render/fingerprint.py): the same on both roles' pods, moved by every
change that makes a new prefill's KV unreadable to an old decode, and by nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from dllm_cases import ROOT, load_cr, merged
from rendered import of_kind

from dllm_operator.api import parse
from dllm_operator.config import OperatorConfig
from dllm_operator.render import labels, render_all
from dllm_operator.render.fingerprint import kv_fingerprint, kv_flags

SAMPLE = load_cr(ROOT / "crds/samples/cpu-tiny.yaml")


def fingerprint(patch: dict[str, Any]) -> str:
    return kv_fingerprint(parse(merged(SAMPLE, {"spec": patch})), OperatorConfig())


def test_both_roles_pods_carry_it_as_labels_and_in_their_env() -> None:
    want = fingerprint({})
    for sts in of_kind(render_all(parse(SAMPLE)), "StatefulSet"):
        template = sts["spec"]["template"]
        assert template["metadata"]["labels"][labels.KV_FINGERPRINT] == want
        assert template["metadata"]["labels"][labels.DS_REVISION] == want
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env["DLLM_KV_FINGERPRINT"] == want
        assert sts["spec"]["selector"]["matchLabels"].keys().isdisjoint({labels.KV_FINGERPRINT})


@pytest.mark.parametrize(
    "patch",
    [
        {"decode": {"maxNumSeqs": 5}},
        {"prefill": {"maxNumBatchedTokens": 256, "replicas": 2}},
        {"decode": {"resources": {"limits": {"memory": "5Gi"}}}},
        {"decode": {"extraArgs": ["--enforce-eager", "--no-enable-prefix-caching", "--disable-log-stats"]}},
        {"kvTransfer": {"timeoutMs": 30000, "bufferSizeGB": 0.5}},
        {"router": {"replicas": 2}},
    ],
    ids=[
        "decode-max-num-seqs",
        "prefill-batch-and-replicas",
        "resources",
        "other-flags",
        "timeouts",
        "router",
    ],
)
def test_what_leaves_the_kv_alone_leaves_the_fingerprint_alone(patch: dict[str, Any]) -> None:
    assert fingerprint(patch) == fingerprint({})


@pytest.mark.parametrize(
    "patch",
    [
        {"image": "localhost/dllm/vllm-cpu:next"},
        {"decode": {"image": "localhost/dllm/vllm-cpu:next"}},
        {"model": {"blockSize": 64}},
        {"model": {"dtype": "bfloat16"}},
        {"model": {"kvCacheDtype": "fp8"}},
        {"model": {"revision": "v2"}},
        {"kvTransfer": {"compression": "fp8"}},
        {"kvTransfer": {"protocol": "rdma"}, "rdma": {"enabled": True}},
        {"decode": {"tensorParallelSize": 2}},
        {"decode": {"extraArgs": ["--enforce-eager", "--block-size", "64"]}},
        {"prefill": {"extraArgs": ["--enforce-eager", "--kv-cache-dtype=fp8"]}},
    ],
    ids=[
        "image",
        "decode-image",
        "block-size",
        "dtype",
        "kv-cache-dtype",
        "revision",
        "compression",
        "protocol",
        "decode-tp",
        "block-size-in-extra-args",
        "kv-dtype-in-extra-args",
    ],
)
def test_what_changes_the_kv_changes_the_fingerprint(patch: dict[str, Any]) -> None:
    assert fingerprint(patch) != fingerprint({})


def test_the_last_of_a_repeated_flag_is_the_one_vllm_reads() -> None:
    args = ["--block-size", "32", "--tensor-parallel-size=2", "--enforce-eager", "--block-size", "64"]
    assert kv_flags(args) == {"--block-size": "64", "--tensor-parallel-size": "2"}
