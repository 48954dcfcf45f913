"""Admission checks for an AlpaJob that need code: what the CRD's schema and CEL cannot judge.

The API server first checks an AlpaJob against ``manifests/crd.yaml``: types, enums,
minimums, defaults and the CEL rules (one model source, 'auto' or a positive count,
micro-batches dividing the batch, immutable typed fields). A validating webhook then
calls :func:`validate_alpajob`, which returns one message per problem, each starting
with the field's path in the manifest's camelCase spelling and saying how to fix it::

    spec.cluster.gpu: unknown GPU preset 'h200'; choose one of a100-40gb, a100-80gb, ...

It checks, in order:

1. what the pydantic model is laxer about than the CRD, so that the message names
   the field itself: the job's name, the entrypoint's form, 'auto' or a positive
   count, ``method: manual`` if and only if ``stages`` is a list;
2. everything :func:`~alpajob.planner.manifest.parse_manifest` (the CLI's reader)
   refuses;
3. the model: a known zoo family and size, known config keys with positive values
   (:data:`ZOO`, a copy of the zoo's catalogue: the zoo itself imports JAX, which the
   operator never does; a test keeps the copy equal to the zoo);
4. the cluster: a known device preset, named by ``spec.cluster.gpu`` or by the
   ``nvidia.com/gpu.product`` node selector, and the two agreeing;
5. the plan options: micro-batches that divide the global batch and, for a manual
   plan, stages that cover layers 0..numLayers-1 contiguously on Alpa's submesh
   shapes ([1, m] with m dividing gpusPerNode, or [n, gpusPerNode] with n <= nodes),
   logical meshes of the submesh's size, and no more devices than the cluster has;
6. on an update (``old`` given): every immutable field, as the CRD's transition
   rules do, so that the webhook is complete on its own.

``spec.model.config`` and ``spec.parallelism.stages`` are untyped to the API server
(a string or a mapping, a string or a list), and Kubernetes lets no CEL rule name an
untyped field: checks 1, 3 and 5 are the only ones their content gets.

It imports neither kopf nor JAX; the operator's webhook handler wraps it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alpajob.planner.cluster import preset_names
from alpajob.planner.errors import ManifestError
from alpajob.planner.manifest import (
    GPU_PRODUCT_PRESETS,
    ClusterSpecModel,
    ManualStage,
    Method,
    ModelSpec,
    Spec,
    parse_manifest,
)

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: Longest job name: children are named ``<job>-<attempt>-m<mesh>-h<host>`` and
#: ``<job>-hosts`` and must stay DNS labels (63 characters).
MAX_NAME_LENGTH = 45
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_ENTRYPOINT = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}")

#: spec fields that may change after creation; every other spec field is immutable.
MUTABLE: dict[str, frozenset[str]] = {
    "runPolicy": frozenset({"suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished"}),
    "scheduling": frozenset({"queue"}),
}


@dataclass(frozen=True)
class ZooFamily:
    """A zoo family as admission sees it: its named sizes and its config keys."""

    sizes: tuple[str, ...]
    int_keys: frozenset[str]
    float_keys: frozenset[str] = frozenset()


_GPT_KEYS = frozenset({"hidden", "layers", "heads", "seqLen", "vocab"})

#: The zoo's catalogue (``alpajob models``), as ``alpajob.trainer.zoo`` defines it.
ZOO: dict[str, ZooFamily] = {
    "gpt": ZooFamily(("tiny", "350m", "1.3b", "2.6b", "6.7b", "15b", "39b"), _GPT_KEYS),
    "moe": ZooFamily(
        ("tiny", "380m", "690m", "1.3b", "2.4b", "10b", "27b", "70b"),
        _GPT_KEYS | {"experts", "expertGroupSize"},
        frozenset({"capacityFactor"}),
    ),
    "wresnet": ZooFamily(
        ("tiny", "250m", "500m", "1b", "2b", "4b", "6.8b", "13b"),
        frozenset({"layers", "channels", "widthFactor", "imageSize", "numClasses"}),
    ),
    "mlp": ZooFamily(("tiny",), frozenset({"hidden", "layers", "inputDim", "outputDim"})),
}


def validate_alpajob(body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem of the AlpaJob ``body`` (``old``: the stored object, on an update)."""
    problems = _raw_problems(body)
    try:
        manifest = parse_manifest(dict(body))
    except ManifestError as error:
        # The raw checks name a field more precisely than pydantic's parent path does.
        if not any(p.startswith(error.field) for p in problems):
            problems.append(str(error))
        return problems
    if problems:
        return problems
    spec = manifest.spec
    problems += _model_problems(spec.model)
    problems += _cluster_problems(spec.cluster)
    problems += _parallelism_problems(spec)
    if old is not None:
        problems += _immutable_problems(body.get("spec"), old.get("spec"))
    return problems


def _get(mapping: Any, *keys: str) -> Any:
    """``mapping[k1][k2]...``, or None where a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


def _is_count(value: Any) -> bool:
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _raw_problems(body: Mapping[str, Any]) -> list[str]:
    """Checks on the raw document where the CRD is stricter than the pydantic model."""
    problems = []
    name = _get(body, "metadata", "name")
    if isinstance(name, str) and (len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name)):
        problems.append(
            f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} "
            "characters (lowercase letters, digits and '-', starting with a letter): the "
            "job's Services, pods and labels are named after it; choose a shorter name"
        )
    entrypoint = _get(body, "spec", "model", "entrypoint")
    if isinstance(entrypoint, str) and not _ENTRYPOINT.fullmatch(entrypoint):
        problems.append(
            f"spec.model.entrypoint: {entrypoint!r} must look like 'package.module:function' "
            "(an importable module, a colon, a function name)"
        )
    parallelism = _get(body, "spec", "parallelism")
    if not isinstance(parallelism, Mapping):
        return problems
    for key in ("numMicroBatches", "numLayers"):
        if key in parallelism and not _is_count(parallelism[key]):
            problems.append(
                f"spec.parallelism.{key}: must be 'auto' or a positive integer, "
                f"got {parallelism[key]!r}"
            )
    manual = parallelism.get("method") == Method.MANUAL.value
    listed = isinstance(parallelism.get("stages"), list)
    if manual and not listed:
        problems.append(
            "spec.parallelism.stages: method 'manual' needs a list of stages "
            "{layers: [first, end], submeshShape: [n, m]}; list them or choose another method"
        )
    elif listed and not manual:
        problems.append(
            "spec.parallelism.stages: a list of stages is only used with method: manual; "
            "set spec.parallelism.method to manual or stages to 'auto'"
        )
    return problems


def _choices(values: Sequence[str] | Mapping[str, Any]) -> str:
    return ", ".join(values)


def _model_problems(model: ModelSpec) -> list[str]:
    """A known zoo family and size, and known config keys with positive values."""
    if model.zoo is None:
        return []
    family_name, _, size = model.zoo.strip().lower().partition("-")
    family = ZOO.get(family_name)
    if family is None:
        return [
            f"spec.model.zoo: unknown model family {family_name!r}; choose one of {_choices(ZOO)}"
        ]
    config = model.config
    if size:
        if size not in family.sizes:
            return [
                f"spec.model.zoo: unknown {family_name} size {size!r}; "
                f"choose one of {_choices(family.sizes)}"
            ]
        if isinstance(config, str):
            return [
                f"spec.model.config: zoo {model.zoo!r} already names a size; drop config "
                f"{config!r} or set zoo to {family_name!r}"
            ]
    if isinstance(config, str):
        if config.strip().lower() not in family.sizes:
            return [
                f"spec.model.config: unknown {family_name} size {config!r}; "
                f"choose one of {_choices(family.sizes)}"
            ]
        return []
    problems = []
    keys = family.int_keys | family.float_keys
    for key, value in (config or {}).items():
        field = f"spec.model.config.{key}"
        positive = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if key not in keys:
            problems.append(
                f"{field}: unknown {family_name} config key; valid keys: {_choices(sorted(keys))}"
            )
        elif key in family.float_keys and not positive:
            problems.append(f"{field}: must be a positive number, got {value!r}")
        elif key in family.int_keys and not (positive and isinstance(value, int)):
            problems.append(f"{field}: must be a positive integer, got {value!r}")
    return problems


def _cluster_problems(cluster: ClusterSpecModel) -> list[str]:
    """A known device preset, from ``gpu`` or the GPU product label, the two agreeing."""
    product = cluster.node_selector.get(GPU_PRODUCT_LABEL)
    implied = GPU_PRODUCT_PRESETS.get(product) if product else None
    presets = preset_names()
    if cluster.gpu is not None:
        if cluster.gpu not in presets:
            return [
                f"spec.cluster.gpu: unknown GPU preset {cluster.gpu!r}; "
                f"choose one of {_choices(presets)}"
            ]
        if implied is not None and implied != cluster.gpu:
            return [
                f"spec.cluster.gpu: {cluster.gpu!r} disagrees with the node selector's "
                f"{GPU_PRODUCT_LABEL} {product!r} (preset {implied!r}); drop spec.cluster.gpu "
                "or select nodes of that GPU"
            ]
        return []
    if product and implied is None:
        return [
            f"spec.cluster.nodeSelector: {GPU_PRODUCT_LABEL} {product!r} has no device preset; "
            f"set spec.cluster.gpu to one of {_choices(presets)}, or select one of "
            f"{_choices(sorted(GPU_PRODUCT_PRESETS))}"
        ]
    return []


def _parallelism_problems(spec: Spec) -> list[str]:
    """Micro-batches dividing the global batch; a manual plan that fits the cluster."""
    problems = []
    par, batch = spec.parallelism, spec.training.global_batch_size
    if isinstance(par.num_micro_batches, int) and batch % par.num_micro_batches:
        problems.append(
            f"spec.parallelism.numMicroBatches: {par.num_micro_batches} does not divide "
            f"spec.training.globalBatchSize {batch} into equal micro-batches; choose a "
            "divisor of the global batch, or 'auto'"
        )
    if isinstance(par.stages, list):
        num_layers = par.num_layers if isinstance(par.num_layers, int) else None
        problems += _stage_problems(par.stages, num_layers, spec.cluster)
    return problems


def _stage_problems(
    stages: Sequence[ManualStage], num_layers: int | None, cluster: ClusterSpecModel
) -> list[str]:
    """Contiguous stages from layer 0 (to numLayers), each on one of Alpa's submeshes."""
    field = "spec.parallelism.stages"
    nodes, per_node = cluster.nodes, cluster.gpus_per_node
    problems = []
    expected = devices = 0
    for index, stage in enumerate(stages):
        where = f"{field}[{index}]"
        first, end = stage.layers
        if first != expected:
            after = f"stage {index - 1} ends at layer {expected}" if index else "the first stage must start at 0"
            problems.append(
                f"{where}.layers: starts at layer {first} but {after}; stages must cover the "
                "layers contiguously"
            )
        if num_layers is not None and end > num_layers:
            problems.append(
                f"{where}.layers: ends at {end} but spec.parallelism.numLayers is {num_layers}; "
                "end the last stage at numLayers or raise numLayers"
            )
        n, m = stage.submesh_shape
        if n < 1 or m < 1 or n > nodes or m > per_node or (n > 1 and m != per_node) or per_node % m:
            problems.append(
                f"{where}.submeshShape: [{n}, {m}] is not a submesh of the {nodes} x {per_node} "
                f"cluster (spec.cluster); use [1, m] with m dividing {per_node}, or "
                f"[n, {per_node}] with n <= {nodes}"
            )
        shape = stage.logical_mesh_shape
        if shape is not None and (min(shape) < 1 or shape[0] * shape[1] != n * m):
            problems.append(
                f"{where}.logicalMeshShape: {list(shape)} must be two positive factors of the "
                f"submesh's {n * m} devices (submeshShape [{n}, {m}])"
            )
        devices += max(n, 0) * max(m, 0)
        expected = end
    if num_layers is not None and expected < num_layers:
        problems.append(
            f"{field}: the stages cover layers 0..{expected - 1} but spec.parallelism.numLayers "
            f"is {num_layers}; end the last stage at {num_layers} or lower numLayers"
        )
    if devices > nodes * per_node:
        problems.append(
            f"{field}: the stages use {devices} devices but spec.cluster has {nodes} x "
            f"{per_node} = {nodes * per_node}; use smaller submeshShapes or more nodes"
        )
    return problems


def _immutable_problems(new: Any, old: Any) -> list[str]:
    """Spec fields changed on an update, except the few of :data:`MUTABLE`."""
    new = new if isinstance(new, Mapping) else {}
    old = old if isinstance(old, Mapping) else {}
    problems = []
    for key in sorted(set(new) | set(old)):
        mutable = MUTABLE.get(key)
        if mutable is None:
            changed = [key] if new.get(key) != old.get(key) else []
        else:
            inner_new, inner_old = new.get(key) or {}, old.get(key) or {}
            changed = [
                f"{key}.{sub}"
                for sub in sorted(set(inner_new) | set(inner_old))
                if sub not in mutable and inner_new.get(sub) != inner_old.get(sub)
            ]
        problems += [
            f"spec.{path}: is immutable once the AlpaJob exists (only spec.runPolicy.suspend, "
            "activeDeadlineSeconds, ttlSecondsAfterFinished and spec.scheduling.queue may "
            "change); create a new AlpaJob instead"
            for path in changed
        ]
    return problems
