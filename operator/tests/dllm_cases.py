"""DisaggregatedLLM inputs shared by the model tests and the real API server tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "disaggregatedllms.disagg.dev.yaml"
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))


def load_cr(path: Path) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DisaggregatedLLM")


def minimal(name: str = "minimal") -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedLLM",
        "metadata": {"name": name},
        "spec": {"model": {"name": "m"}},
    }


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def spec(**fields: Any) -> dict[str, Any]:
    return {"spec": fields}


# (id, patch over minimal(), the field path both the API server and the model must name)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("missing-model", {"spec": {"image": "x"}, "_drop_model": True}, "spec.model"),
    ("missing-model-name", spec(model={"name": None}), "spec.model.name"),
    ("empty-model-name", spec(model={"name": ""}), "spec.model.name"),
    ("port-too-high", spec(kvTransfer={"port": 70000}), "spec.kvTransfer.port"),
    ("port-zero", spec(kvTransfer={"port": 0}), "spec.kvTransfer.port"),
    ("port-not-a-number", spec(kvTransfer={"port": "fifty"}), "spec.kvTransfer.port"),
    ("port-as-string-number", spec(kvTransfer={"port": "50051"}), "spec.kvTransfer.port"),
    ("negative-replicas", spec(prefill={"replicas": -1}), "spec.prefill.replicas"),
    ("tp-not-power-of-two", spec(decode={"tensorParallelSize": 3}), "spec.decode.tensorParallelSize"),
    ("unknown-connector", spec(kvTransfer={"connector": "rdma-magic"}), "spec.kvTransfer.connector"),
    ("unknown-compression", spec(kvTransfer={"compression": "zstd"}), "spec.kvTransfer.compression"),
    ("zero-buffer", spec(kvTransfer={"bufferSizeGB": 0}), "spec.kvTransfer.bufferSizeGB"),
    ("negative-role-buffer", spec(decode={"bufferSizeGB": -1}), "spec.decode.bufferSizeGB"),
    ("zero-timeout", spec(kvTransfer={"timeoutMs": 0}), "spec.kvTransfer.timeoutMs"),
    ("zero-max-num-seqs", spec(prefill={"maxNumSeqs": 0}), "spec.prefill.maxNumSeqs"),
    ("zero-batched-tokens", spec(decode={"maxNumBatchedTokens": 0}), "spec.decode.maxNumBatchedTokens"),
    ("async-not-boolean", spec(kvTransfer={"async": "yes"}), "spec.kvTransfer.async"),
    ("custom-connector-without-class", spec(kvTransfer={"connector": "custom"}), "spec.kvTransfer.custom"),
    (
        "custom-block-with-mooncake",
        spec(kvTransfer={"custom": {"connectorClass": "X"}}),
        "spec.kvTransfer.custom",
    ),
    (
        "two-model-sources",
        spec(model={"name": "m", "source": {"pvc": {"claimName": "a"}, "huggingFace": {}}}),
        "spec.model.source",
    ),
    ("host-devices-without-rdma", spec(rdma={"mode": "hostDevices"}), "spec.rdma.mode"),
    ("rdma-protocol-without-rdma", spec(kvTransfer={"protocol": "rdma"}), "spec.kvTransfer.protocol"),
    (
        "no-chunked-prefill-short-batch",
        spec(model={"name": "m", "maxModelLen": 4096}, decode={"maxNumBatchedTokens": 1024}),
        "spec.decode.maxNumBatchedTokens",
    ),
    ("role-port-zero", spec(prefill={"port": 0}), "spec.prefill.port"),
    ("router-port-too-high", spec(router={"port": 70000}), "spec.router.port"),
    ("negative-router-replicas", spec(router={"replicas": -1}), "spec.router.replicas"),
    ("zero-prefill-wait", spec(kvTransfer={"prefillWaitMs": 0}), "spec.kvTransfer.prefillWaitMs"),
    ("zero-hold", spec(kvTransfer={"holdSeconds": 0}), "spec.kvTransfer.holdSeconds"),
    (
        "negative-threshold",
        spec(kvTransfer={"transferThresholdTokens": -1}),
        "spec.kvTransfer.transferThresholdTokens",
    ),
    ("unknown-kv-cache-dtype", spec(model={"name": "m", "kvCacheDtype": "int4"}), "spec.model.kvCacheDtype"),
    (
        "prefill-no-chunked-prefill-short-batch",
        spec(
            model={"name": "m", "maxModelLen": 4096},
            prefill={"enableChunkedPrefill": False, "maxNumBatchedTokens": 1024},
        ),
        "spec.prefill.maxNumBatchedTokens",
    ),
    ("too-many-extra-args", spec(decode={"extraArgs": ["--x"] * 65}), "spec.decode.extraArgs"),
    (
        "env-name-too-long",
        spec(decode={"env": [{"name": "X" * 257, "value": "v"}]}),
        "spec.decode.env[0].name",
    ),
    ("name-too-long", {"metadata": {"name": "a" * 45}}, "metadata.name"),
    ("name-not-dns-1035", {"metadata": {"name": "1llama"}}, "metadata.name"),
    ("unknown-role-field", spec(prefill={"replicaz": 2}), "spec.prefill.replicaz"),
    (
        "seed-field-name-kv-buffer-size",
        spec(kvTransfer={"kv_buffer_size": 2.0}),
        "spec.kvTransfer.kv_buffer_size",
    ),
    (
        "env-reuses-contract-name",
        spec(decode={"env": [{"name": "VLLM_KV_ROLE", "value": "prefill"}]}),
        "spec.decode.env",
    ),
    (
        "prefill-env-reuses-contract-name",
        spec(prefill={"env": [{"name": "VLLM_KV_CONNECTOR", "value": "custom"}]}),
        "spec.prefill.env",
    ),
    (
        "env-reuses-auth-name",
        spec(prefill={"env": [{"name": "VLLM_API_KEY", "value": "guessable"}]}),
        "spec.prefill.env",
    ),
    # NEW-4: where the hub token goes is the administrator's (huggingFaceEndpoint), never a resource's
    (
        "env-sets-hub-endpoint",
        spec(prefill={"env": [{"name": "HF_ENDPOINT", "value": "https://hub.attacker.example"}]}),
        "spec.prefill.env",
    ),
    (
        "env-sets-hub-variable",
        spec(decode={"env": [{"name": "HF_HUB_ENDPOINT", "value": "https://hub.attacker.example"}]}),
        "spec.decode.env",
    ),
    (
        "env-sets-ca-bundle",
        spec(decode={"env": [{"name": "SSL_CERT_FILE", "value": "/models/attacker-ca.pem"}]}),
        "spec.decode.env",
    ),
    (
        "autoscaling-two-targets",
        spec(
            autoscaling={
                "mode": "advisory",
                "prefill": {
                    "maxReplicas": 2,
                    "target": {"queuedPromptTokensPerReplica": 4096, "timeToFirstTokenSeconds": 1.0},
                },
            }
        ),
        "spec.autoscaling.prefill.target",
    ),
    (
        "autoscaling-min-over-max",
        spec(autoscaling={"decode": {"minReplicas": 3, "maxReplicas": 2, "target": {"kvCacheUsage": 0.7}}}),
        "spec.autoscaling.decode",
    ),
    (
        "active-autoscaling-with-hand-set-prefill-replicas",
        spec(
            prefill={"replicas": 2},
            autoscaling={
                "mode": "active",
                "prefill": {"maxReplicas": 4, "target": {"queuedPromptTokensPerReplica": 4096}},
            },
        ),
        "spec.prefill.replicas",
    ),
    (
        "active-autoscaling-with-hand-set-decode-replicas",  # what `kubectl scale dllm` sets
        spec(
            decode={"replicas": 3},
            autoscaling={"mode": "active", "decode": {"maxReplicas": 4, "target": {"kvCacheUsage": 0.7}}},
        ),
        "spec.decode.replicas",
    ),
    ("host-network-without-rdma", spec(rdma={"hostNetwork": True}), "spec.rdma.hostNetwork"),
    (
        "router-grace-below-prestop-and-margin",
        spec(router={"terminationGracePeriodSeconds": 10}),
        "spec.router.terminationGracePeriodSeconds",
    ),
    ("network-policy-not-boolean", spec(security={"networkPolicy": "off"}), "spec.security.networkPolicy"),
    ("unknown-security-field", spec(security={"mtls": True}), "spec.security.mtls"),
    ("unknown-service-type", spec(router={"serviceType": "Ingress"}), "spec.router.serviceType"),
    ("unknown-router-flow", spec(router={"flow": "grpc"}), "spec.router.flow"),
    ("gid-index-too-high", spec(rdma={"enabled": True, "gidIndex": 300}), "spec.rdma.gidIndex"),
    ("unknown-dtype", spec(model={"name": "m", "dtype": "int4"}), "spec.model.dtype"),
    ("bad-shm-quantity", spec(prefill={"shmSizeLimit": "lots"}), "spec.prefill.shmSizeLimit"),
    (
        "bad-toleration-operator",
        spec(prefill={"tolerations": [{"key": "k", "operator": "Maybe"}]}),
        "spec.prefill.tolerations[0].operator",
    ),
    (
        "bad-router-toleration-operator",
        spec(router={"tolerations": [{"key": "k", "operator": "Maybe"}]}),
        "spec.router.tolerations[0].operator",
    ),
    (
        "unknown-load-failure-policy",
        spec(kvTransfer={"loadFailurePolicy": "retry"}),
        "spec.kvTransfer.loadFailurePolicy",
    ),
    # H7: a role's securityContext sets ids and seccomp only, never root or privilege.
    (
        "run-as-root",
        spec(prefill={"securityContext": {"runAsUser": 0}}),
        "spec.prefill.securityContext.runAsUser",
    ),
    (
        "run-as-group-beyond-int32",
        spec(decode={"securityContext": {"runAsGroup": 2**31}}),
        "spec.decode.securityContext.runAsGroup",
    ),
    (
        "negative-fs-group",
        spec(decode={"securityContext": {"fsGroup": -1}}),
        "spec.decode.securityContext.fsGroup",
    ),
    (
        "privileged-security-context",
        spec(decode={"securityContext": {"privileged": True}}),
        "spec.decode.securityContext.privileged",
    ),
    (
        "added-capabilities",
        spec(prefill={"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}),
        "spec.prefill.securityContext.capabilities",
    ),
    (
        "privilege-escalation",
        spec(prefill={"securityContext": {"allowPrivilegeEscalation": True}}),
        "spec.prefill.securityContext.allowPrivilegeEscalation",
    ),
    (
        "seccomp-unconfined",
        spec(decode={"securityContext": {"seccompProfile": {"type": "Unconfined"}}}),
        "spec.decode.securityContext.seccompProfile.type",
    ),
    (
        "seccomp-localhost-without-profile",
        spec(decode={"securityContext": {"seccompProfile": {"type": "Localhost"}}}),
        "spec.decode.securityContext.seccompProfile.localhostProfile",
    ),
    (
        "seccomp-profile-without-localhost",
        spec(
            prefill={
                "securityContext": {"seccompProfile": {"type": "RuntimeDefault", "localhostProfile": "p"}}
            }
        ),
        "spec.prefill.securityContext.seccompProfile.localhostProfile",
    ),
    (
        "run-as-user-with-rdma-capability",
        spec(rdma={"enabled": True}, decode={"securityContext": {"runAsUser": 2000}}),
        "spec.decode.securityContext.runAsUser",
    ),
]


# Valid, but privileged: refused by the chart's admission policy outside opted-in namespaces and by an
# operator with DLLM_ALLOW_PRIVILEGED_ENGINES=false. (id, patch over minimal()'s spec, the model's path;
# the policy names the part before any index.)
MULTUS = {"k8s.v1.cni.cncf.io/networks": "x"}
APPARMOR = {"container.apparmor.security.beta.kubernetes.io/vllm": "unconfined"}
OTHER_SECRET = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "team-b", "key": "k"}}}]
FOREIGN_HUB_TOKEN = {
    "name": "org/m",
    "source": {"huggingFace": {"tokenSecretRef": {"name": "payments-db", "key": "password"}}},
}
FOREIGN_MODEL_CLAIM = {"name": "m", "source": {"pvc": {"claimName": "team-b-data", "readOnly": False}}}
FOREIGN_CACHE_CLAIM = {"name": "org/m", "source": {"huggingFace": {"cacheVolumeClaim": "team-b-data"}}}
TOLERATE_ALL = [{"operator": "Exists"}]
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
TOLERATE_CONTROL_PLANE = [{"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}]
ONTO_CONTROL_PLANE = {
    "nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}},
            {"weight": 1, "preference": {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "Exists"}]}},
        ]
    }
}
OFF_CONTROL_PLANE = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": CONTROL_PLANE, "operator": "DoesNotExist"}]}]
        }
    }
}
PRIVILEGED: list[tuple[str, dict[str, Any], str]] = [
    ("host-network", {"rdma": {"enabled": True, "hostNetwork": True}}, "spec.rdma.hostNetwork"),
    ("host-devices", {"rdma": {"enabled": True, "mode": "hostDevices"}}, "spec.rdma.mode"),
    ("other-secret", {"decode": {"env": OTHER_SECRET}}, "spec.decode.env[0].valueFrom.secretKeyRef"),
    # NEW-4: the hub token Secret and the model's PVCs only from the administrator's lists
    ("unlisted-hub-token", {"model": FOREIGN_HUB_TOKEN}, "spec.model.source.huggingFace.tokenSecretRef.name"),
    ("unlisted-model-claim", {"model": FOREIGN_MODEL_CLAIM}, "spec.model.source.pvc.claimName"),
    (
        "unlisted-cache-claim",
        {"model": FOREIGN_CACHE_CLAIM},
        "spec.model.source.huggingFace.cacheVolumeClaim",
    ),
    ("multus", {"prefill": {"podAnnotations": MULTUS}}, "spec.prefill.podAnnotations"),
    ("apparmor", {"prefill": {"podAnnotations": APPARMOR}}, "spec.prefill.podAnnotations"),
    ("tolerate-all", {"decode": {"tolerations": TOLERATE_ALL}}, "spec.decode.tolerations[0].key"),
    ("router-tolerate-all", {"router": {"tolerations": TOLERATE_ALL}}, "spec.router.tolerations[0].key"),
    ("foreign-network", {"rdma": {"enabled": True, "networks": ["kube-system/net"]}}, "spec.rdma.networks"),
    ("service-account", {"serviceAccountName": "deployer"}, "spec.serviceAccountName"),
    (
        "system-priority",
        {"prefill": {"priorityClassName": "system-cluster-critical"}},
        "spec.prefill.priorityClassName",
    ),
    (
        "node-critical-priority",
        {"decode": {"priorityClassName": "system-node-critical"}},
        "spec.decode.priorityClassName",
    ),
    ("control-plane-selector", {"decode": {"nodeSelector": {CONTROL_PLANE: ""}}}, "spec.decode.nodeSelector"),
    (
        "router-control-plane-selector",
        {"router": {"nodeSelector": {"node-role.kubernetes.io/master": ""}}},
        "spec.router.nodeSelector",
    ),
    ("control-plane-affinity", {"prefill": {"affinity": ONTO_CONTROL_PLANE}}, "spec.prefill.affinity"),
    (
        "control-plane-toleration",
        {"prefill": {"tolerations": TOLERATE_CONTROL_PLANE}},
        "spec.prefill.tolerations[0].key",
    ),
    (
        "router-control-plane-toleration",
        {"router": {"tolerations": TOLERATE_CONTROL_PLANE}},
        "spec.router.tolerations[0].key",
    ),
]

# Valid and not privileged: admitted everywhere (the namespace's default account, user priority classes,
# affinity that keeps pods off control-plane nodes, a Secret for image pulls, bounded securityContext).
UNPRIVILEGED: list[tuple[str, dict[str, Any]]] = [
    ("default-service-account", {"serviceAccountName": "default"}),
    ("user-priority", {"prefill": {"priorityClassName": "high-priority"}}),
    ("off-control-plane", {"decode": {"affinity": OFF_CONTROL_PLANE}}),
    ("pull-secret", {"imagePullSecrets": [{"name": "registry"}]}),
    (
        "security-context",
        {
            "decode": {
                "securityContext": {
                    "runAsUser": 2000,
                    "runAsGroup": 2000,
                    "fsGroup": 3000,
                    "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/vllm.json"},
                }
            }
        },
    ),
]


def invalid_body(patch: dict[str, Any], name: str) -> dict[str, Any]:
    patch = copy.deepcopy(patch)
    drop_model = patch.pop("_drop_model", False)
    body = merged(minimal(name), patch)
    if drop_model:
        del body["spec"]["model"]
    if body["spec"].get("model", {}).get("name", "") is None:
        del body["spec"]["model"]["name"]
    return body
