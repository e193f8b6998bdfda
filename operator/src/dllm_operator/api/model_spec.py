"""spec.model: what model the engines serve and where its weights come from."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from dllm_contract.types import PositiveInt
from dllm_operator.api.common import Name, _Model, cel, rules

# ---- spec.model -----------------------------------------------------------------------------------


class PVCSource(_Model):
    claim_name: Annotated[
        str, Field(min_length=1, max_length=253, description="Name of the PersistentVolumeClaim.")
    ]
    sub_path: Annotated[
        str, Field(max_length=1024, description="Folder inside the volume that holds the model.")
    ] = ""
    read_only: Annotated[bool, Field(description="Mount read-only.")] = True


class SecretKeyRef(_Model):
    name: Annotated[Name, Field(description="Name of the Secret, in the resource's namespace.")]
    key: Annotated[Name, Field(description="Key in the Secret's data.")]


class HuggingFaceSource(_Model):
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="The hub token, by reference (HF_TOKEN from this Secret key; never copied)."
    )
    cache_volume_claim: Annotated[
        Name, Field(description="PersistentVolumeClaim for the hub cache, shared between restarts.")
    ] = ""


TWO_SOURCES = "at most one of pvc and huggingFace may be set"


class ModelSource(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(cel("!(has(self.pvc) && has(self.huggingFace))", TWO_SOURCES))
    )

    pvc: PVCSource | None = Field(None, description="Weights on a PersistentVolumeClaim, mounted at /models.")
    hugging_face: HuggingFaceSource | None = Field(
        None, description="Download from the Hugging Face hub at start."
    )


class ModelSpec(_Model):
    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=512,
            description="Model name or path: vLLM --model (a hub id, or a path inside the source).",
        ),
    ]
    revision: Annotated[
        str, Field(max_length=128, description="Model revision (branch, tag or commit): vLLM --revision.")
    ] = ""
    served_model_name: Annotated[
        str, Field(max_length=256, description="Name clients use in requests: vLLM --served-model-name.")
    ] = ""
    max_model_len: PositiveInt | None = Field(
        None, description="Context length: vLLM --max-model-len, the same on both roles."
    )
    block_size: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None,
        description="KV-cache block size in tokens: vLLM --block-size, the same on both roles "
        "(vLLM's CPU backend needs a multiple of 32).",
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "auto", description="Weights and activations dtype: vLLM --dtype."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"] = Field(
        "auto",
        description="KV-cache dtype: vLLM --kv-cache-dtype. With fp8 the KV is already 8-bit and "
        "kvTransfer.compression is not applied again.",
    )
    source: ModelSource | None = Field(
        None,
        description="Where the weights come from; at most one of pvc and huggingFace. Unset: the image or "
        "the hub without a token.",
    )
