"""What a typed spec cannot say about itself: the checks that need a catalogue or two
fields at once.

:func:`spec_problems` judges a parsed :class:`~alpajob.api.spec.Spec`; the CLI, the
Python API and the operator's webhook all call it (through
:func:`alpajob.api.resource.document_problems`), so they refuse the same specs with
the same words. Each problem is a :class:`Problem`: the field's path in the
manifest's camelCase spelling and a message that says how to fix it::

    spec.model.config: unknown gpt size '9b'; choose one of tiny, 350m, 1.3b, ...

Checked, in order:

1. the model: a known zoo family and size, known config keys inside their ranges, the
   family's rules (:mod:`alpajob.api.zoo`);
2. the cluster: the ``nvidia.com/gpu.product`` node selector names a known preset,
   and agrees with ``gpu`` when both are set;
3. the plan options: micro-batches that divide the global batch; ``method: manual`` if
   and only if ``stages`` is a list; manual stages that cover layers 0..numLayers-1
   contiguously on Alpa's submesh shapes ([1, m] with m dividing gpusPerNode, or
   [n, gpusPerNode] with n <= nodes), logical meshes of the submesh's size, and no more
   devices than the cluster has;
4. the training run: evaluation with something to evaluate on, a warm-up no longer
   than the run;
5. when all of that holds, memory: a zoo model whose weights, gradients and optimizer
   state alone exceed the whole pool's memory is refused before anything is traced.

:func:`immutable_problems` compares two specs on an update: every field but those of
:data:`~alpajob.api.spec.MUTABLE` is fixed once the job exists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from alpajob.api.catalog import DEVICE_MEMORY_BYTES, GPU_PRODUCT_PRESETS, DevicePreset
from alpajob.api.errors import Problem
from alpajob.api.names import GPU_PRODUCT_LABEL
from alpajob.api.spec import MUTABLE, ManualStage, Method, ModelSpec, NodePoolSpec, Optimizer, Spec
from alpajob.api.zoo import batch_problems, zoo_problems


def _choices(values: Sequence[str] | Mapping[str, Any]) -> str:
    return ", ".join(values)


def spec_problems(spec: Spec) -> list[Problem]:
    """Every problem of a parsed ``spec`` that its types cannot catch (module docstring)."""
    problems = [*_model_problems(spec.model, spec.training.global_batch_size), *_cluster_problems(spec.cluster),
                *_parallelism_problems(spec), *_data_problems(spec), *_training_problems(spec)]
    return problems or _memory_problems(spec)


def _data_problems(spec: Spec) -> list[Problem]:
    """Evaluation needs something to evaluate on."""
    if spec.training.eval_every is not None and (spec.data is None or spec.data.eval is None):
        return [Problem("spec.training.evalEvery", "needs spec.data.eval, the files to evaluate on; "
                                                   "set it or drop evalEvery")]
    return []


def _model_problems(model: ModelSpec, global_batch_size: int) -> list[Problem]:
    """A known zoo family and size, known config keys inside their ranges, the family's
    rules (:func:`~alpajob.api.zoo.zoo_problems`), and a batch the model can take
    (:func:`~alpajob.api.zoo.batch_problems`)."""
    if model.zoo is None:
        return []
    zoo, problems = zoo_problems(model.zoo, model.config)
    return batch_problems(zoo, global_batch_size) if zoo is not None else problems


#: Bytes every parameter takes somewhere on the pool, by optimizer: float32 weights and
#: gradients (compute in float16/bfloat16 keeps float32 master weights), and Adam's two
#: float32 moments.
BYTES_PER_PARAMETER = {Optimizer.SGD: 8, Optimizer.ADAM: 16, Optimizer.ADAMW: 16}


def _memory_problems(spec: Spec) -> list[Problem]:
    """A zoo model whose weights, gradients and optimizer state alone, spread evenly over
    every device of the pool, exceed one device's memory: no plan can fit it.

    This is a lower bound on what the planner finds (activations, buffers and the
    memory fraction only add to it), so it refuses nothing the planner would have
    planned; it answers in microseconds what the planner says after tracing.
    """
    preset = spec.cluster.preset()
    zoo = zoo_problems(spec.model.zoo, spec.model.config)[0] if spec.model.zoo else None
    if preset is None or zoo is None:
        return []
    optimizer = spec.training.optimizer_spec.name
    devices = spec.cluster.nodes * spec.cluster.gpus_per_node
    total = zoo.parameters * BYTES_PER_PARAMETER[optimizer]
    per_device, memory = total / devices, DEVICE_MEMORY_BYTES[preset]
    if per_device <= memory:
        return []
    return [Problem("spec.cluster", (
        f"{zoo.name} cannot fit: its {zoo.parameters / 1e9:.3g} billion parameters need "
        f"{BYTES_PER_PARAMETER[optimizer]} bytes each with {optimizer.value} (float32 weights, "
        f"gradients{' and two moments' if optimizer is not Optimizer.SGD else ''}), "
        f"{total / 2**30:,.1f} GiB in all, {per_device / 2**30:,.1f} GiB per device even spread "
        f"over all {devices} devices, and a {preset.value} device has {memory / 2**30:,.1f} GiB; "
        f"use at least {math.ceil(total / memory)} devices (spec.cluster.nodes, gpusPerNode), "
        "larger GPUs (spec.cluster.gpu) or a smaller model"))]


def _training_problems(spec: Spec) -> list[Problem]:
    """A warm-up no longer than the run."""
    training = spec.training
    warmup = training.optimizer_spec.warmup_steps
    if warmup > training.steps:
        return [Problem("spec.training.optimizer.warmupSteps",
                        f"{warmup} warm-up steps but spec.training.steps is {training.steps}: the "
                        "learning rate would never reach its peak; warm up for fewer steps than the run")]
    return []


def _cluster_problems(cluster: NodePoolSpec) -> list[Problem]:
    """The GPU product label names a known preset, and agrees with ``gpu``."""
    product = cluster.node_selector.get(GPU_PRODUCT_LABEL)
    implied = GPU_PRODUCT_PRESETS.get(product) if product else None
    if cluster.gpu is not None:
        if implied is not None and implied != cluster.gpu:
            return [Problem("spec.cluster.gpu",
                            f"{cluster.gpu.value!r} disagrees with the node selector's "
                            f"{GPU_PRODUCT_LABEL} {product!r} (preset {implied.value!r}); drop "
                            "spec.cluster.gpu or select nodes of that GPU")]
        return []
    if product and implied is None:
        return [Problem("spec.cluster.nodeSelector",
                        f"{GPU_PRODUCT_LABEL} {product!r} has no device preset; set "
                        f"spec.cluster.gpu to one of {_choices([p.value for p in DevicePreset])}, "
                        f"or select one of {_choices(sorted(GPU_PRODUCT_PRESETS))}")]
    return []


def _parallelism_problems(spec: Spec) -> list[Problem]:
    """Micro-batches dividing the global batch; a manual plan that fits the cluster."""
    problems = []
    par, batch = spec.parallelism, spec.training.global_batch_size
    if isinstance(par.num_micro_batches, int) and batch % par.num_micro_batches:
        problems.append(Problem(
            "spec.parallelism.numMicroBatches",
            f"{par.num_micro_batches} does not divide spec.training.globalBatchSize {batch} "
            "into equal micro-batches; choose a divisor of the global batch, or 'auto'"))
    manual, listed = par.method is Method.MANUAL, isinstance(par.stages, list)
    if manual and not listed:
        problems.append(Problem("spec.parallelism.stages",
                                "method 'manual' needs a list of stages {layers: [first, end], "
                                "submeshShape: [n, m]}; list them or choose another method"))
    elif listed and not manual:
        problems.append(Problem("spec.parallelism.stages",
                                "a list of stages is only used with method: manual; set "
                                "spec.parallelism.method to manual or stages to 'auto'"))
    elif listed:
        num_layers = par.num_layers if isinstance(par.num_layers, int) else None
        problems += _stage_problems(par.manual_stages, num_layers, spec.cluster)
    return problems


def _stage_problems(stages: Sequence[ManualStage], num_layers: int | None,
                    cluster: NodePoolSpec) -> list[Problem]:
    """Contiguous stages from layer 0 (to numLayers), each on one of Alpa's submeshes."""
    field = "spec.parallelism.stages"
    nodes, per_node = cluster.nodes, cluster.gpus_per_node
    problems = []
    expected = devices = 0
    for index, stage in enumerate(stages):
        where = f"{field}[{index}]"
        if stage.first != expected:
            after = (f"stage {index - 1} ends at layer {expected}" if index
                     else "the first stage must start at 0")
            problems.append(Problem(f"{where}.layers", f"starts at layer {stage.first} but "
                                                       f"{after}; stages must cover the layers "
                                                       "contiguously"))
        if num_layers is not None and stage.end > num_layers:
            problems.append(Problem(f"{where}.layers", f"ends at {stage.end} but "
                                                       f"spec.parallelism.numLayers is "
                                                       f"{num_layers}; end the last stage at "
                                                       "numLayers or raise numLayers"))
        n, m = stage.submesh_shape
        if n < 1 or m < 1 or n > nodes or m > per_node or (n > 1 and m != per_node) or per_node % m:
            problems.append(Problem(f"{where}.submeshShape",
                                    f"[{n}, {m}] is not a submesh of the {nodes} x {per_node} "
                                    f"cluster (spec.cluster); use [1, m] with m dividing "
                                    f"{per_node}, or [n, {per_node}] with n <= {nodes}"))
        shape = stage.logical_mesh_shape
        if shape is not None and (min(shape) < 1 or shape[0] * shape[1] != n * m):
            problems.append(Problem(f"{where}.logicalMeshShape",
                                    f"{list(shape)} must be two positive factors of the "
                                    f"submesh's {n * m} devices (submeshShape [{n}, {m}])"))
        devices += max(n, 0) * max(m, 0)
        expected = stage.end
    if num_layers is not None and expected < num_layers:
        problems.append(Problem(field, f"the stages cover layers 0..{expected - 1} but "
                                       f"spec.parallelism.numLayers is {num_layers}; end the "
                                       f"last stage at {num_layers} or lower numLayers"))
    if devices > nodes * per_node:
        problems.append(Problem(field, f"the stages use {devices} devices but spec.cluster has "
                                       f"{nodes} x {per_node} = {nodes * per_node}; use smaller "
                                       "submeshShapes or more nodes"))
    return problems


def immutable_problems(new: Any, old: Any) -> list[Problem]:
    """Fields of the raw ``spec`` mappings changed by an update, but those of
    :data:`~alpajob.api.spec.MUTABLE`."""
    new = new if isinstance(new, Mapping) else {}
    old = old if isinstance(old, Mapping) else {}
    changed: list[str] = []
    for key in sorted(set(new) | set(old)):
        mutable = MUTABLE.get(key)
        if mutable is None:
            changed += [key] if new.get(key) != old.get(key) else []
            continue
        inner_new, inner_old = new.get(key) or {}, old.get(key) or {}
        changed += [f"{key}.{sub}" for sub in sorted(set(inner_new) | set(inner_old))
                    if sub not in mutable and inner_new.get(sub) != inner_old.get(sub)]
    may = ", ".join(f"spec.{section}.{key}" for section, keys in MUTABLE.items() for key in sorted(keys))
    return [Problem(f"spec.{path}", f"is immutable once the AlpaJob exists (only {may} may change); "
                                    "create a new AlpaJob instead")
            for path in changed]
