"""The operator's own refusal of privileged engine settings (H7), the same rules as the chart's
ValidatingAdmissionPolicy (templates/admission-policy.yaml), for clusters or namespaces where that
policy is not installed. Off by default (OperatorConfig.allow_privileged_engines); an operator that
refuses reports the CR as invalid, naming the field, and renders nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dllm_operator.api import DisaggregatedLLM, FieldError, RDMAMode, RoleSpec, Toleration
from dllm_operator.config import OperatorConfig

MULTUS_PREFIX = "k8s.v1.cni.cncf.io/"
OPT_IN = "dllm.dev/allow-privileged-engines=true on the namespace"
# The ServiceAccount pods get when they name none; any other lends the engines its identity.
DEFAULT_SERVICE_ACCOUNT = "default"
# system-cluster-critical and system-node-critical: above every user class, they preempt anyone.
SYSTEM_PRIORITY_PREFIX = "system-"
# The labels and taints that mark control-plane nodes (master: before Kubernetes 1.24).
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# Node affinity operators that keep pods off a label's nodes rather than onto them.
AVOIDING_OPERATORS = ("NotIn", "DoesNotExist")


def _hub_token_secret(cr: DisaggregatedLLM) -> str | None:
    source = cr.spec.model.source
    if source is None or source.hugging_face is None or source.hugging_face.token_secret_ref is None:
        return None
    return source.hugging_face.token_secret_ref.name


def _reference_errors(cr: DisaggregatedLLM, config: OperatorConfig) -> list[FieldError]:
    """NEW-4: the Secret and the PVCs a CR names are read by whoever may create it, so only the ones
    an administrator listed may be named."""
    source = cr.spec.model.source
    named: list[tuple[str, str, tuple[str, ...], str]] = []
    if source is not None and source.pvc is not None:
        path = "spec.model.source.pvc.claimName"
        named.append((path, source.pvc.claim_name, config.model_volume_claims, "DLLM_MODEL_VOLUME_CLAIMS"))
    if source is not None and source.hugging_face is not None:
        hub = source.hugging_face
        if hub.token_secret_ref is not None:
            path = "spec.model.source.huggingFace.tokenSecretRef.name"
            named.append(
                (path, hub.token_secret_ref.name, config.hub_token_secrets, "DLLM_HUB_TOKEN_SECRETS")
            )
        if hub.cache_volume_claim:
            path = "spec.model.source.huggingFace.cacheVolumeClaim"
            named.append(
                (path, hub.cache_volume_claim, config.model_volume_claims, "DLLM_MODEL_VOLUME_CLAIMS")
            )
    return [
        FieldError(
            path, f"{name}: not one of the names the operator allows ({variable}: {', '.join(allowed)})"
        )
        for path, name, allowed, variable in named
        if name not in allowed
    ]


def _role_errors(cr: DisaggregatedLLM, role: str, spec: RoleSpec) -> list[FieldError]:
    errors: list[FieldError] = []
    hub_secret = _hub_token_secret(cr)
    for i, var in enumerate(spec.env):
        ref = (var.value_from or {}).get("secretKeyRef")
        if isinstance(ref, dict) and ref.get("name") != hub_secret:
            errors.append(
                FieldError(
                    f"spec.{role}.env[{i}].valueFrom.secretKeyRef",
                    "only the model's hub token Secret may be referenced (privileged engines not allowed)",
                )
            )
    for key in spec.pod_annotations:
        if key.startswith(MULTUS_PREFIX) or "apparmor" in key:
            errors.append(
                FieldError(
                    f"spec.{role}.podAnnotations",
                    f"{key}: network attachment and AppArmor annotations are not allowed",
                )
            )
    if spec.priority_class_name.startswith(SYSTEM_PRIORITY_PREFIX):
        errors.append(
            FieldError(
                f"spec.{role}.priorityClassName",
                f"{spec.priority_class_name}: system- classes preempt other tenants' pods",
            )
        )
    if _affinity_targets_control_plane(spec.affinity):
        errors.append(
            FieldError(f"spec.{role}.affinity", "node affinity onto control-plane nodes is not allowed")
        )
    errors += _placement_errors(f"spec.{role}", spec.node_selector, spec.tolerations)
    return errors


def _placement_errors(
    path: str, node_selector: Mapping[str, str], tolerations: tuple[Toleration, ...]
) -> list[FieldError]:
    errors = [
        FieldError(f"{path}.nodeSelector", f"{key}: control-plane nodes are not allowed")
        for key in node_selector
        if key in CONTROL_PLANE_KEYS
    ]
    for i, toleration in enumerate(tolerations):
        if not toleration.key:
            message = "a toleration must name a taint key (no tolerate-everything)"
        elif toleration.key in CONTROL_PLANE_KEYS:
            message = f"{toleration.key}: tolerating the control-plane taint is not allowed"
        else:
            continue
        errors.append(FieldError(f"{path}.tolerations[{i}].key", message))
    return errors


def _affinity_targets_control_plane(affinity: Mapping[str, Any]) -> bool:
    """Whether a node affinity term (required or preferred) selects on a control-plane label. The
    affinity is a free-form core/v1 Affinity: anything not shaped like one selects nothing here (the
    API server refuses it when the StatefulSet is applied)."""
    node = affinity.get("nodeAffinity")
    if not isinstance(node, Mapping):
        return False
    terms: list[Any] = []
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if isinstance(required, Mapping) and isinstance(required.get("nodeSelectorTerms"), list):
        terms += required["nodeSelectorTerms"]
    preferred = node.get("preferredDuringSchedulingIgnoredDuringExecution")
    if isinstance(preferred, list):
        terms += [p.get("preference") for p in preferred if isinstance(p, Mapping)]
    for term in terms:
        expressions = term.get("matchExpressions") if isinstance(term, Mapping) else None
        for expression in expressions if isinstance(expressions, list) else []:
            if (
                isinstance(expression, Mapping)
                and expression.get("key") in CONTROL_PLANE_KEYS
                and expression.get("operator") not in AVOIDING_OPERATORS
            ):
                return True
    return False


def _image_errors(cr: DisaggregatedLLM, prefixes: tuple[str, ...]) -> list[FieldError]:
    images = {
        "spec.image": cr.spec.image,
        "spec.prefill.image": cr.spec.prefill.image,
        "spec.decode.image": cr.spec.decode.image,
        "spec.router.image": cr.spec.router.image,
    }
    return [
        FieldError(path, f"{image}: the operator only runs images under {', '.join(prefixes)}")
        for path, image in images.items()
        if image and not image.startswith(prefixes)
    ]


def refused(cr: DisaggregatedLLM, config: OperatorConfig) -> list[FieldError]:
    """What this operator's configuration does not allow in `cr`; empty when all is allowed."""
    errors: list[FieldError] = []
    if config.allowed_image_prefixes:
        errors += _image_errors(cr, config.allowed_image_prefixes)
    if config.allow_privileged_engines:
        return errors
    rdma = cr.spec.rdma
    if rdma.host_network:
        errors.append(FieldError("spec.rdma.hostNetwork", f"host network needs {OPT_IN}"))
    if rdma.mode is RDMAMode.HOST_DEVICES:
        errors.append(FieldError("spec.rdma.mode", f"hostDevices needs {OPT_IN}"))
    errors += [
        FieldError("spec.rdma.networks", f"{name}: a network of another namespace is not allowed")
        for name in rdma.networks
        if "/" in name
    ]
    if cr.spec.service_account_name not in ("", DEFAULT_SERVICE_ACCOUNT):
        errors.append(
            FieldError(
                "spec.serviceAccountName",
                f"{cr.spec.service_account_name}: the engines run the resource's image and arguments, "
                "so naming a ServiceAccount lends them its identity",
            )
        )
    errors += _reference_errors(cr, config)
    errors += _role_errors(cr, "prefill", cr.spec.prefill)
    errors += _role_errors(cr, "decode", cr.spec.decode)
    router = cr.spec.router
    errors += _placement_errors("spec.router", router.node_selector, router.tolerations)
    return errors
