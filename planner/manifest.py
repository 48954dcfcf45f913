"""The AlpaJob manifest (contract 1), as the planner and the CLI read it.

A user's manifest is the same YAML they ``kubectl apply``::

    apiVersion: alpajob.io/v1alpha1
    kind: AlpaJob
    metadata: {name: gpt-2-6b}
    spec:
      model: {zoo: gpt, config: 2.6b}
      training: {globalBatchSize: 1024, dtype: float16, optimizer: adam}
      cluster: {gpu: v100-16gb, nodes: 1, gpusPerNode: 8}
      parallelism: {method: auto, numMicroBatches: auto, schedule: 1f1b}

:func:`load_manifest` validates it into :class:`AlpaJobManifest` (unknown keys are
refused) and turns every validation failure into a :class:`ManifestError` naming the
field in the manifest's own camelCase spelling, e.g. ``spec.training.globalBatchSize``.
Fields the planner does not use (image, serviceAccountName, checkpoint, runPolicy,
scheduling) are accepted and kept for the operator.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from alpajob.planner.errors import ManifestError

API_VERSION = "alpajob.io/v1alpha1"
KIND = "AlpaJob"

#: ``nvidia.com/gpu.product`` label values (as NVIDIA's GPU feature discovery writes
#: them) mapped to device presets.
GPU_PRODUCT_PRESETS: dict[str, str] = {
    "Tesla-V100-SXM2-16GB": "v100-16gb",
    "NVIDIA-A100-SXM4-40GB": "a100-40gb",
    "NVIDIA-A100-SXM4-80GB": "a100-80gb",
    "NVIDIA-H100-80GB-HBM3": "h100-80gb",
}


class Method(StrEnum):
    """``spec.parallelism.method``: how much of the plan the planner decides."""

    AUTO = "auto"  # inter-op DP over intra-op ILPs, single-stage plans included
    DATA = "data"  # plain data parallelism, one stage on every device
    ZERO2 = "zero2"  # data parallelism with sharded gradients and optimizer state
    SHARD = "shard"  # one stage on every device, sharding chosen by the ILP
    PIPESHARD = "pipeshard"  # the DP, at least two pipeline stages
    MANUAL = "manual"  # stages given in spec.parallelism.stages


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelSpec(_Model):
    """``spec.model``: exactly one of ``zoo`` and ``entrypoint``."""

    zoo: str | None = None
    config: str | dict[str, Any] | None = None
    entrypoint: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.zoo is None) == (self.entrypoint is None):
            raise ValueError(
                "set exactly one of spec.model.zoo (gpt, moe, wresnet, mlp) "
                "and spec.model.entrypoint ('module:function')"
            )
        if self.entrypoint is not None and ":" not in self.entrypoint:
            raise ValueError(
                f"entrypoint {self.entrypoint!r} must look like 'package.module:function'"
            )
        return self


class TrainingSpec(_Model):
    """``spec.training``."""

    global_batch_size: int = Field(1024, gt=0)
    steps: int = Field(1000, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    learning_rate: float = Field(1e-4, gt=0)
    seed: int = 0


class ClusterSpecModel(_Model):
    """``spec.cluster``: the node pool to cut into submeshes.

    ``gpu`` names a device preset; when absent it is derived from the
    ``nvidia.com/gpu.product`` value of ``nodeSelector``.
    """

    node_selector: dict[str, str] = Field(default_factory=dict)
    nodes: int = Field(1, gt=0)
    gpus_per_node: int = Field(8, gt=0)
    gpu: str | None = None

    def preset(self) -> str | None:
        """The device preset: ``gpu``, else the one the node selector's product maps to."""
        if self.gpu is not None:
            return self.gpu
        product = self.node_selector.get("nvidia.com/gpu.product")
        return GPU_PRODUCT_PRESETS.get(product) if product else None


class ManualStage(_Model):
    """One stage of a manual plan: layers [first, last+1) on a submesh."""

    layers: tuple[int, int]
    submesh_shape: tuple[int, int]
    logical_mesh_shape: tuple[int, int] | None = None

    @field_validator("layers")
    @classmethod
    def _range(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] < value[1]:
            raise ValueError(f"layers must be [first, last+1) with first < last+1, got {list(value)}")
        return value


class ParallelismSpec(_Model):
    """``spec.parallelism``: the planner's options (defaults: fully automatic)."""

    method: Method = Method.AUTO
    num_micro_batches: int | Literal["auto"] = "auto"
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    stages: Literal["auto", "uniform"] | list[ManualStage] = "auto"
    num_layers: int | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _manual_needs_stages(self) -> ParallelismSpec:
        manual = isinstance(self.stages, list)
        if self.method is Method.MANUAL and not manual:
            raise ValueError(
                "method 'manual' needs spec.parallelism.stages as a list of "
                "{layers: [first, last+1], submeshShape: [n, m]}"
            )
        if manual and self.method is not Method.MANUAL:
            raise ValueError("explicit stages are only used with method: manual")
        if isinstance(self.num_micro_batches, int) and self.num_micro_batches < 1:
            raise ValueError("numMicroBatches must be 'auto' or a positive integer")
        return self


class Spec(_Model):
    """``spec`` of an AlpaJob."""

    model: ModelSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)  # type: ignore[arg-type]
    cluster: ClusterSpecModel = Field(default_factory=ClusterSpecModel)  # type: ignore[arg-type]
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)  # type: ignore[arg-type]
    image: str | None = None
    service_account_name: str | None = None
    checkpoint: dict[str, Any] | None = None
    run_policy: dict[str, Any] | None = None
    scheduling: dict[str, Any] | None = None


class Metadata(BaseModel):
    """``metadata``: only the name matters to the planner; other keys are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = "alpajob"
    namespace: str | None = None


class AlpaJobManifest(_Model):
    """A whole AlpaJob document."""

    api_version: Literal["alpajob.io/v1alpha1"]
    kind: Literal["AlpaJob"]
    metadata: Metadata = Field(default_factory=Metadata)  # type: ignore[arg-type]
    spec: Spec


def _field_path(loc: tuple[Any, ...]) -> str:
    """``('spec', 'training', 'globalBatchSize')`` -> ``spec.training.globalBatchSize``.

    Pydantic puts union-member tags (``int``, ``list[ManualStage]``, ...) into the
    location; they are not fields and are dropped.
    """
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif "[" in str(part) or str(part) in {"int", "str", "dict", "literal['auto']"} or str(part).startswith(("literal[", "function-")):
            continue
        else:
            parts.append(("." if parts else "") + to_camel(str(part)))
    return "".join(parts).replace(".[", "[") or "manifest"


def parse_manifest(data: Any, source: str = "manifest") -> AlpaJobManifest:
    """Validate a loaded YAML document; raise :class:`ManifestError` naming the field."""
    if not isinstance(data, dict):
        raise ManifestError(source, "must be a YAML mapping with apiVersion, kind and spec")
    try:
        return AlpaJobManifest.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
        # For a union (e.g. stages: "auto" | list), the deepest location is the
        # member the user meant, and the most specific message.
        first = max(errors, key=lambda e: len(e["loc"]))
        field = _field_path(tuple(first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field; remove it or check its spelling"
        elif first["type"] == "literal_error" and field == "apiVersion":
            message = f"must be {API_VERSION}"
        elif first["type"] == "missing":
            message = "is required"
        if field.endswith(("numMicroBatches", "numLayers")):
            message = "must be 'auto' or a positive integer"
        raise ManifestError(field, message) from None


def load_manifest(path: str | Path) -> AlpaJobManifest:
    """Read and validate the AlpaJob manifest at ``path``.

    A file with several YAML documents (a ``---`` list) must hold exactly one AlpaJob.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ManifestError(str(path), f"cannot read the manifest: {error.strerror}") from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as error:
        raise ManifestError(str(path), f"is not valid YAML: {error}") from None
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == KIND]
    if len(documents) == 1:
        return parse_manifest(documents[0], str(path))
    if len(jobs) != 1:
        raise ManifestError(
            str(path), f"must contain exactly one document of kind {KIND}, found {len(jobs)}"
        )
    return parse_manifest(jobs[0], str(path))
