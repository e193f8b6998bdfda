"""The operator's own refusal of privileged engine settings (H7), the same rules as the chart's
ValidatingAdmissionPolicy (templates/admission-policy.yaml), for clusters or namespaces where that
policy is not installed. Off by default (OperatorConfig.allow_privileged_engines); an operator that
refuses reports the CR as invalid, naming the field, and renders nothing for it.
"""

from __future__ import annotations

from dllm_operator.api import DisaggregatedLLM, FieldError, RDMAMode, RoleSpec, Toleration
from dllm_operator.config import OperatorConfig

MULTUS_PREFIX = "k8s.v1.cni.cncf.io/"
OPT_IN = "dllm.dev/allow-privileged-engines=true on the namespace"


def _hub_token_secret(cr: DisaggregatedLLM) -> str | None:
    source = cr.spec.model.source
    if source is None or source.hugging_face is None or source.hugging_face.token_secret_ref is None:
        return None
    return source.hugging_face.token_secret_ref.name


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
    errors += _toleration_errors(f"spec.{role}.tolerations", spec.tolerations)
    return errors


def _toleration_errors(path: str, tolerations: tuple[Toleration, ...]) -> list[FieldError]:
    return [
        FieldError(f"{path}[{i}].key", "a toleration must name a taint key (no tolerate-everything)")
        for i, toleration in enumerate(tolerations)
        if not toleration.key
    ]


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
    errors += _role_errors(cr, "prefill", cr.spec.prefill)
    errors += _role_errors(cr, "decode", cr.spec.decode)
    errors += _toleration_errors("spec.router.tolerations", cr.spec.router.tolerations)
    return errors
