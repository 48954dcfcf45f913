"""The AlpaJob's ``spec`` (contract 1): what to train, on which node pool, and how.

One typed model per section, read by the CLI, the planner, the trainer and the
operator's webhook alike; the CRD's schema is generated from these models
(:mod:`alpajob.api.crd`), CEL rules included, so the API server, the webhook and
``alpajob run`` refuse the same specs. A user writes camelCase keys::

    spec:
      model: {zoo: gpt, config: 2.6b}
      training: {globalBatchSize: 1024, dtype: float16, optimizer: adam}
      cluster: {gpu: v100-16gb, nodes: 1, gpusPerNode: 8}
      parallelism: {method: auto, numMicroBatches: auto, schedule: 1f1b}

What a schema cannot say (a known zoo size, manual stages that cover the layers and fit
the cluster, micro-batches dividing the batch) is checked by
:func:`alpajob.api.validation.spec_problems` on a parsed spec. ``spec.runPolicy`` has
its own module (:mod:`.run_policy`), as ``spec.podTemplate`` has (:mod:`.pod_template`).

Mutable once a job exists: ``runPolicy.suspend``, ``runPolicy.activeDeadlineSeconds``,
``runPolicy.ttlSecondsAfterFinished``, ``runPolicy.schedulingTimeoutSeconds``,
``runPolicy.cleanPodPolicy``, ``scheduling.queue`` and ``podTemplate`` (:data:`MUTABLE`);
everything else is fixed (transition rules in the CRD, and
:func:`~alpajob.api.validation.immutable_problems` in the webhook).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from alpajob.api.catalog import GPU_PRODUCT_PRESETS, DevicePreset
from alpajob.api.data import DataSpec
from alpajob.api.limits import (
    EVAL_STEPS,
    GLOBAL_BATCH_SIZE,
    LAYERS,
    MICRO_BATCHES,
    NODES,
    STEPS,
    Limit,
)
from alpajob.api.names import GPU_PRODUCT_LABEL
from alpajob.api.pod_template import Labels, PodTemplates, Quantity
from alpajob.api.pools import MAX_POOLS, POWERS_OF_TWO, GpuPool, GpusPerNode
from alpajob.api.run_policy import RunPolicy
from alpajob.api.schema import INT32, INT64, INT64_MAX, Contract, cel, k8s, unchanged

#: A DNS-1123 subdomain (a Kubernetes object name).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, StringConstraints(max_length=253, pattern=DNS_SUBDOMAIN)]
#: An image reference: ``[registry[:port]/]path[:tag][@digest]``, the path of lowercase
#: components separated by ``/``, as a container runtime parses it
#: (``ghcr.io/team/trainer:1.2``, ``trainer@sha256:...``).
_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_REGISTRY = r"([A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*(:[0-9]+)?/)"
IMAGE_REFERENCE = (rf"^{_REGISTRY}?{_COMPONENT}(/{_COMPONENT})*(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                   r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
#: ``package.module:function``.
ENTRYPOINT = r"[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"


class Method(StrEnum):
    """``spec.parallelism.method``: how much of the plan the planner decides."""

    AUTO = "auto"  # inter-op DP over intra-op ILPs, single-stage plans included
    DATA = "data"  # plain data parallelism, one stage on every device
    ZERO2 = "zero2"  # data parallelism with sharded gradients and optimizer state
    SHARD = "shard"  # one stage on every device, sharding chosen by the ILP
    PIPESHARD = "pipeshard"  # the DP, at least two pipeline stages
    MANUAL = "manual"  # stages given in spec.parallelism.stages


class Schedule(StrEnum):
    """``spec.parallelism.schedule``: the order of micro-batches in the pipeline."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class DType(StrEnum):
    """``spec.training.dtype``: parameter and compute dtype."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Optimizer(StrEnum):
    """``spec.training.optimizer``."""

    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"


class Gang(StrEnum):
    """``spec.scheduling.gang``: which gang scheduler holds the job's pods together."""

    AUTO = "auto"  # Volcano or coscheduling, whichever is installed
    VOLCANO = "volcano"
    COSCHEDULING = "coscheduling"
    NONE = "none"


class ModelSpec(Contract):
    """``spec.model``: exactly one of ``zoo`` and ``entrypoint``."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("has(self.zoo) != has(self.entrypoint)",
            "set exactly one of spec.model.zoo (a zoo family: gpt, moe, wresnet, mlp) and "
            "spec.model.entrypoint ('package.module:function'); remove the other"),
        cel("self == oldSelf", "spec.model is immutable once the AlpaJob exists; create a new "
            "AlpaJob to train another model"))}

    zoo: str | None = Field(
        None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]*$",
        description="A zoo family (gpt, moe, wresnet, mlp), or a family and size in one name "
                    "(gpt-2.6b); `alpajob models` lists them.")
    config: str | dict[str, Any] | None = Field(
        None, json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description="A named size of the zoo family (e.g. 2.6b), or a mapping of overrides on "
                    "the family's default (e.g. {hidden: 512, layers: 4}). Free-form to the API "
                    "server (a string or an object); the admission webhook checks it.")
    entrypoint: str | None = Field(
        None, max_length=253, json_schema_extra=k8s(cel(
            f"self.matches('^{ENTRYPOINT}$')",
            "spec.model.entrypoint must look like 'package.module:function' (an importable "
            "module, a colon, a function name)")),
        description="A function in the trainer image that returns the model: "
                    "'package.module:function'.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.zoo is None) == (self.entrypoint is None):
            raise ValueError("set exactly one of spec.model.zoo (gpt, moe, wresnet, mlp) and "
                             "spec.model.entrypoint ('package.module:function')")
        return self

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(ENTRYPOINT, value):
            raise ValueError(f"{value!r} must look like 'package.module:function' (an "
                             "importable module, a colon, a function name)")
        return value


class LRSchedule(StrEnum):
    """``spec.training.optimizer.schedule``: the learning rate after warm-up."""

    CONSTANT = "constant"
    COSINE = "cosine"  # to 0 at the last step
    LINEAR = "linear"  # to 0 at the last step


class OptimizerSpec(Contract):
    """``spec.training.optimizer`` as an object: the optimizer and its schedule.

    The learning rate rises linearly from 0 over ``warmupSteps``, then follows
    ``schedule`` from its peak (``learningRate``, else ``spec.training.learningRate``)
    over the remaining steps. ``weightDecay`` is decoupled (AdamW's; for ``adam`` it
    turns it into AdamW), ``clipNorm`` clips the global gradient norm first.
    """

    name: Optimizer = Optimizer.ADAMW
    learning_rate: float | None = Field(None, gt=0, allow_inf_nan=False)
    schedule: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: Annotated[int, STEPS.validator, STEPS.schema] = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    clip_norm: float | None = Field(None, gt=0, allow_inf_nan=False)
    b1: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False)
    b2: float = Field(0.999, ge=0, lt=1, allow_inf_nan=False)


class TrainingSpec(Contract):
    """``spec.training``: the training run."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("self == oldSelf", "spec.training is immutable once the AlpaJob exists; create a new "
            "AlpaJob to change it"))}

    global_batch_size: Annotated[int, GLOBAL_BATCH_SIZE.validator, GLOBAL_BATCH_SIZE.schema] = Field(
        1024, ge=1, json_schema_extra=INT64, description="Samples per step, over all devices.")
    steps: Annotated[int, STEPS.validator, STEPS.schema] = Field(
        1000, ge=1, json_schema_extra=INT64, description="Training steps.")
    dtype: DType = Field(DType.FLOAT32, description="Parameter and compute dtype.")
    optimizer: Optimizer | OptimizerSpec = Field(
        Optimizer.ADAM, json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description="adam, adamw or sgd, or an object {name, learningRate, schedule: "
                    "constant|cosine|linear, warmupSteps, weightDecay, clipNorm, b1, b2}. "
                    "Free-form to the API server (a name or an object); the admission webhook "
                    "checks it.")
    learning_rate: float = Field(1e-4, gt=0, allow_inf_nan=False, description=(
        "The peak learning rate (unless spec.training.optimizer.learningRate is set)."))
    seed: int = Field(0, ge=0, le=INT64_MAX, json_schema_extra=INT64,
                      description="Seed of the parameters' and the data's random numbers (0 or more).")
    eval_every: Annotated[int, Field(ge=1), STEPS.validator, STEPS.schema] | None = Field(
        None, json_schema_extra=INT64, description=(
        "Evaluate on spec.data.eval every this many steps and after the last step; "
        "unset, a job with spec.data.eval evaluates once, after the last step."))
    eval_steps: Annotated[int, EVAL_STEPS.validator, EVAL_STEPS.schema] = Field(8, ge=1, json_schema_extra=INT64, description=(
        "Batches of spec.data.eval each evaluation averages over."))

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        """The optimizer as an object, with its peak learning rate filled in."""
        spec = (self.optimizer if isinstance(self.optimizer, OptimizerSpec)
                else OptimizerSpec(name=self.optimizer))
        if spec.learning_rate is None:
            spec = spec.model_copy(update={"learning_rate": self.learning_rate})
        return spec


class NodePoolSpec(Contract):
    """``spec.cluster``: the node pool the planner cuts into submeshes.

    ``gpu`` names a device preset; when absent it is derived from the
    ``nvidia.com/gpu.product`` value of ``nodeSelector``. ``pools`` instead names
    several pools of different GPU types, which the planner plans across (each stage
    on GPUs of one type); the operator finds each pool's nodes by their
    ``nvidia.com/gpu.product`` label and puts every stage's pods on nodes of its type.
    """

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("self == oldSelf", "spec.cluster is immutable once the AlpaJob exists; create a new "
            "AlpaJob for another node pool"),
        cel("!has(self.pools) || !has(self.gpu)",
            "spec.cluster.gpu and spec.cluster.pools exclude each other: name each pool's gpu in its entry"))}

    node_selector: Labels = Field(
        default_factory=dict, max_length=32,
        description="Labels of the pool's nodes; nvidia.com/gpu.product also names the device "
                    "preset when gpu is not set.")
    nodes: Annotated[int, NODES.validator, NODES.schema] = Field(
        1, ge=1, json_schema_extra=INT32, description="Nodes of the pool the job may use.")
    gpus_per_node: GpusPerNode = Field(
        8, ge=1, json_schema_extra=INT32 | k8s(cel(
            f"self in {list(POWERS_OF_TWO)}",
            "spec.cluster.gpusPerNode must be a power of two (1, 2, 4, 8 or 16) so submeshes tile a node")),
        description="GPUs of each node the job may use: 1, 2, 4, 8 or 16.")
    gpu: DevicePreset | None = Field(
        None, description="A device preset; default: the preset of the nodeSelector's "
                          "nvidia.com/gpu.product.")
    when_fewer_nodes: Literal["Plan", "Wait"] = Field("Plan", description=(
        "When the pool has fewer usable nodes than nodes (some cordoned, not Ready, or "
        "tainted against spec.podTemplate.mesh.tolerations): Plan plans for the nodes there "
        "are; Wait waits until there are enough (at most runPolicy.schedulingTimeoutSeconds, "
        "when set). Either way the condition NodesAvailable=False and an event say so."))
    pools: list[GpuPool] | None = Field(None, min_length=2, max_length=MAX_POOLS, description=(
        "Pools of different GPU types to plan across, instead of gpu, nodes and gpusPerNode: "
        "each pipeline stage runs on GPUs of one pool, the slower type holds fewer layers."))
    pool_link_gbps: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False, description=(
        "With pools: the bandwidth between two pools, in Gb/s (default: the slowest pool's "
        "inter-node link)."))

    @model_validator(mode="after")
    def _pools_alone(self) -> NodePoolSpec:
        if self.pools is None:
            if self.pool_link_gbps is not None:
                raise ValueError("spec.cluster.poolLinkGbps is the link between spec.cluster.pools; name the pools "
                                 "or drop it")
            return self
        # Set beside pools (the API server fills nodes and gpusPerNode with their defaults).
        beside = [name for name, value, default in (("gpu", self.gpu, None), ("nodes", self.nodes, 1),
                                                    ("gpusPerNode", self.gpus_per_node, 8),
                                                    ("nodeSelector", self.node_selector, {}))
                  if value != default]
        if beside:
            raise ValueError(f"spec.cluster.pools names each pool's gpu, nodes and gpusPerNode; drop spec.cluster."
                             f"{', spec.cluster.'.join(beside)} beside it")
        types = [pool.gpu for pool in self.pools]
        if len(set(types)) < len(types):
            twice = sorted({t.value for t in types if types.count(t) > 1})
            raise ValueError(f"spec.cluster.pools names {', '.join(twice)} twice; give one pool per GPU type "
                             "(its nodes together)")
        return self


    def preset(self) -> DevicePreset | None:
        """The device preset: ``gpu``, else the one the node selector's product maps to
        (None with ``pools``: several)."""
        if self.pools is not None:
            return None
        if self.gpu is not None:
            return self.gpu
        product = self.node_selector.get(GPU_PRODUCT_LABEL)
        return GPU_PRODUCT_PRESETS.get(product) if product else None


class ManualStage(Contract):
    """One stage of a manual plan: layers [first, end) on an ``n x m`` submesh."""

    layers: tuple[int, int]
    submesh_shape: tuple[int, int]
    logical_mesh_shape: tuple[int, int] | None = None

    @field_validator("layers")
    @classmethod
    def _range(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] < value[1]:
            raise ValueError(f"layers must be [first, end) with first < end, got {list(value)}")
        if value[1] > LAYERS.most:
            raise ValueError(f"layers: {LAYERS.message(value[1])}")
        return value

    @property
    def first(self) -> int:
        return self.layers[0]

    @property
    def end(self) -> int:
        return self.layers[1]


def _auto_or_count(limit: Limit) -> str:
    """``'auto'`` or a positive integer up to ``limit``, as CEL checks it."""
    return f"type(self) == int ? self >= 1 && self <= {limit.most} : self == 'auto'"


class ParallelismSpec(Contract):
    """``spec.parallelism``: the planner's options; the defaults are fully automatic."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("self == oldSelf", "spec.parallelism is immutable once the AlpaJob exists; create a "
            "new AlpaJob to plan it differently"))}

    method: Method = Field(Method.AUTO, description=(
        "auto (Alpa's search), data, zero2, shard, pipeshard (at least two stages) or manual "
        "(spec.parallelism.stages)."))
    num_micro_batches: int | Literal["auto"] = Field(
        "auto", json_schema_extra=k8s(
            cel(_auto_or_count(MICRO_BATCHES),
                f"spec.parallelism.numMicroBatches must be 'auto' or a positive integer up to {MICRO_BATCHES.most}"),
            x_kubernetes_int_or_string=True),
        description="Micro-batches per step: 'auto' (the planner chooses) or a positive "
                    "integer that divides the global batch.")
    schedule: Schedule = Field(Schedule.ONE_F_ONE_B, description="Pipeline schedule.")
    stages: Literal["auto", "uniform"] | list[ManualStage] = Field(
        "auto", json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description="'auto' or 'uniform', or with method manual a list of stages {layers: "
                    "[first, end], submeshShape: [n, m], logicalMeshShape: [a, b]} covering "
                    "layers 0..numLayers-1 in order. Free-form to the API server (a string or a "
                    "list); the admission webhook checks it.")
    transport: Literal["auto", "objectStore", "collective"] = Field("auto", description=(
        "How activations and gradients cross between meshes on the Ray runtime: auto "
        "(collectives on GPUs, the object store on CPU devices), objectStore (Ray's object "
        "store, through host memory) or collective (NCCL on GPUs, gloo on CPUs)."))
    num_layers: int | Literal["auto"] = Field(
        "auto", json_schema_extra=k8s(
            cel(_auto_or_count(LAYERS),
                f"spec.parallelism.numLayers must be 'auto' or a positive integer up to {LAYERS.most}"),
            x_kubernetes_int_or_string=True),
        description="Layers the planner clusters the model into: 'auto' or a positive integer.")

    @field_validator("num_micro_batches", "num_layers")
    @classmethod
    def _positive(cls, value: int | str, info: ValidationInfo) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be 'auto' or a positive integer")
        limit = MICRO_BATCHES if info.field_name == "num_micro_batches" else LAYERS
        if isinstance(value, int) and value > limit.most:
            raise ValueError(limit.message(value))
        return value

    @property
    def manual_stages(self) -> tuple[ManualStage, ...]:
        """The manual stages (empty unless ``stages`` is a list)."""
        return tuple(self.stages) if isinstance(self.stages, list) else ()


class AccessMode(StrEnum):
    READ_WRITE_MANY = "ReadWriteMany"
    READ_WRITE_ONCE = "ReadWriteOnce"
    READ_WRITE_ONCE_POD = "ReadWriteOncePod"


class VolumeClaimTemplate(Contract):
    """``spec.checkpoint.volumeClaimTemplate``: the claim the operator makes for the
    checkpoints (``<job>-checkpoints``), so no one has to make it by hand."""

    size: Quantity = Field(description="The claim's storage request, e.g. 50Gi.")
    storage_class_name: ObjectName | None = Field(None, description=(
        "The StorageClass (default: the cluster's default class)."))
    access_modes: list[AccessMode] = Field(
        default_factory=lambda: [AccessMode.READ_WRITE_MANY], min_length=1, max_length=3,
        description="ReadWriteMany (default: the head and every mesh host write their parts); "
                    "ReadWriteOnce serves a job whose pods share one node.")
    retain: bool = Field(False, description=(
        "false (default): the claim belongs to the job and is deleted with it; true: it is kept "
        "(its checkpoints with it) after the job is deleted."))


class CheckpointSpec(Contract):
    """``spec.checkpoint``: periodic checkpoints on a volume every pod mounts: an
    existing claim (``volume``) or one the operator makes (``volumeClaimTemplate``)."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("has(self.volume) != has(self.volumeClaimTemplate)",
            "set exactly one of spec.checkpoint.volume (an existing PersistentVolumeClaim) and "
            "spec.checkpoint.volumeClaimTemplate (the operator makes one)"))}

    volume: ObjectName | None = Field(None, description=(
        "Name of an existing PersistentVolumeClaim (ReadWriteMany) in the job's namespace."))
    volume_claim_template: VolumeClaimTemplate | None = Field(None, description=(
        "A claim the operator makes for the job (<job>-checkpoints): size, storageClassName, "
        "accessModes, retain."))
    interval_steps: Annotated[int, STEPS.validator, STEPS.schema] = Field(500, ge=1, json_schema_extra=INT64,
                                description="Steps between two checkpoints.")
    path: str | None = Field(
        None, max_length=1024, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$",
        description="Directory inside the volume, relative (default: the job's name).")
    keep_last: int = Field(3, ge=1, le=1000, json_schema_extra=INT32, description=(
        "Complete checkpoints kept; older ones are deleted once a newer one is complete."))
    async_save: bool = Field(True, description=(
        "Write checkpoints in the background while training goes on (false: training waits "
        "for every save)."))

    @model_validator(mode="after")
    def _one_volume(self) -> CheckpointSpec:
        if (self.volume is None) == (self.volume_claim_template is None):
            raise ValueError("set exactly one of spec.checkpoint.volume (an existing PersistentVolumeClaim) "
                             "and spec.checkpoint.volumeClaimTemplate (the operator makes one)")
        return self


#: ``<job>-checkpoints``: the claim made from ``spec.checkpoint.volumeClaimTemplate``.
CHECKPOINT_CLAIM_SUFFIX = "checkpoints"


def _scheduling_immutable(key: str) -> dict[str, Any]:
    return unchanged(key, f"spec.scheduling.{key} is immutable once the AlpaJob exists; only "
                          "spec.scheduling.queue may change")


class SchedulingSpec(Contract):
    """``spec.scheduling``: gang scheduling, queues and priority of the job's pods."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        _scheduling_immutable("gang"), _scheduling_immutable("schedulerName"),
        _scheduling_immutable("priorityClassName"))}

    gang: Gang = Field(Gang.AUTO, description=(
        "auto (Volcano or coscheduling when installed), volcano, coscheduling or none: a "
        "PodGroup holding every pod of the job."))
    scheduler_name: ObjectName | None = Field(None, description=(
        "The pods' scheduler (default: the gang scheduler's, else the cluster's default)."))
    queue: ObjectName | None = Field(None, description=(
        "The queue that admits the job: with Kueue installed, the LocalQueue of its head and "
        "mesh pods (as the kueue.x-k8s.io/queue-name label on the job; the planner pod is not "
        "queued); with Volcano, the PodGroup's queue."))
    priority_class_name: ObjectName | None = Field(
        None, description="The PriorityClass of the job's pods.")


#: A ConfigMap key (as Kubernetes validates one).
CONFIG_MAP_KEY = r"^[-._a-zA-Z0-9]+$"


class CalibrationRef(Contract):
    """Where a calibration file made by ``alpajob calibrate`` is: a key of a ConfigMap in
    the job's namespace (``kubectl create configmap NAME --from-file=KEY=FILE``)."""

    config_map: ObjectName = Field(description="The ConfigMap's name.")
    key: str = Field("calibration.json", min_length=1, max_length=253, pattern=CONFIG_MAP_KEY,
                     description="The key holding the file (default calibration.json).")


class PlannerSpec(Contract):
    """``spec.planner``: the planner's knobs (``alpajob plan``'s flags, for the planner pod)."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("self == oldSelf", "spec.planner is immutable once the AlpaJob exists; create a new "
            "AlpaJob to plan it differently"))}

    ilp_time_limit_seconds: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False, description=(
        "Seconds allowed to each intra-operator ILP solve (alpajob plan --ilp-time-limit); a "
        "solve cut short keeps its best sharding so far."))
    calibration: CalibrationRef | None = Field(None, description=(
        "Cost-model constants measured on your GPUs by alpajob calibrate (alpajob plan "
        "--calibration), from a ConfigMap key; default: the device preset's stored ones."))


def _spec_immutable(key: str, why: str) -> dict[str, Any]:
    return unchanged(key, f"spec.{key} is immutable once the AlpaJob exists{why}")


class Spec(Contract):
    """``spec`` of an AlpaJob."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("!has(self.training) || !has(self.parallelism) || "
            "!has(self.training.globalBatchSize) || !has(self.parallelism.numMicroBatches) || "
            "type(self.parallelism.numMicroBatches) != int || "
            "self.parallelism.numMicroBatches < 1 || "
            "self.training.globalBatchSize % self.parallelism.numMicroBatches == 0",
            "spec.parallelism.numMicroBatches must divide spec.training.globalBatchSize into "
            "equal micro-batches; choose a divisor of the global batch, or 'auto'",
            ".parallelism.numMicroBatches"),
        _spec_immutable("image", "; create a new AlpaJob to use another image"),
        _spec_immutable("checkpoint", " (restarts resume from it); create a new "
                                      "AlpaJob to change it"),
        _spec_immutable("serviceAccountName", "; create a new AlpaJob to change it"))}

    model: ModelSpec = Field(description=(
        "The model: exactly one of zoo (a built-in family of the Alpa paper) and entrypoint (a "
        "function in the user's image)."))
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="The training run.")
    cluster: NodePoolSpec = Field(default_factory=NodePoolSpec,
                                 description="The GPU node pool the planner cuts into submeshes.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec,
                                         description="The planner's options; the defaults are "
                                                     "fully automatic.")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description=(
        "The planner's knobs: the ILP time limit and measured cost-model constants."))
    data: DataSpec | None = Field(None, description=(
        "What to train and evaluate on; without it the job trains on synthetic tokens (and "
        "says so)."))
    image: str | None = Field(None, min_length=1, max_length=512, pattern=IMAGE_REFERENCE, description=(
        "The trainer image of the planner, head and mesh pods (default: the operator's)."))
    service_account_name: ObjectName | None = Field(None, description=(
        "The service account of the job's pods (default: the job's own <job>-trainer, which "
        "the operator creates with a Role that may get and patch only <job>-plan and "
        "<job>-progress); one named here needs get and patch on those two ConfigMaps."))
    checkpoint: CheckpointSpec | None = Field(None, description=(
        "Periodic checkpoints on a PersistentVolumeClaim every pod mounts; restarts resume "
        "from the last complete one."))
    run_policy: RunPolicy = Field(default_factory=RunPolicy,
                                  description="Restarts, deadlines, clean-up and suspension.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description=(
        "Gang scheduling, queues and priority of the job's pods."))
    pod_template: PodTemplates = Field(default_factory=PodTemplates, description=(
        "Overrides of the planner, head and mesh pods: resources (default: sized from the plan), "
        "node selection, tolerations, affinity, labels, env, volumes, fsGroup, priority, image "
        "pulling, /dev/shm size. May change: pods made from then on use it, and a pod that "
        "cannot be scheduled is made again with it."))


#: Fields of ``spec`` that may change after creation, by section; every other field is
#: immutable (a running job's plan, pods and checkpoints all follow from it).
MUTABLE: dict[str, frozenset[str]] = {
    "runPolicy": frozenset({"suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished",
                            "schedulingTimeoutSeconds", "cleanPodPolicy"}),
    "scheduling": frozenset({"queue"}),
    "podTemplate": frozenset({"planner", "head", "mesh"}),
}
