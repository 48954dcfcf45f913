"""The AlpaJob's ``status``: written by the operator only, read by users and GitOps tools.

The operator keeps one :class:`Status` per job (its reconciliation works on this
model, not on a dict) and writes it only when it changed. The CRD declares exactly
these fields (generated from them, :mod:`alpajob.api.crd`): a field the operator
wrote but the CRD did not declare would be pruned by the API server, and a
controller comparing what it wrote with what it reads back would write it again
forever.

Phases (:class:`Phase`) and condition types (:class:`ConditionType`)::

    Pending -> Planning -> (Queued ->) Starting -> Running -> Succeeded
                  |                      ^  |         |
                  v                      |  v         v
                Failed              Restarting ->  Failed     (any) <-> Suspended

=============  =======================================================
Planned        the plan ConfigMap holds a plan
MeshesReady    every pod of the current attempt is running
Running        training is under way
Succeeded      the driver finished every step
Failed         the job stopped for good (the reason says why)
Suspended      ``spec.runPolicy.suspend`` is true
Admitted       False while Kueue holds the attempt's pods for quota (Kueue's reason
               and message); True once admitted (the ClusterQueue and flavors)
Ready          True while Running and once Succeeded (for kstatus and Argo CD)
Reconciling    True while Pending, Planning, Starting or Restarting (kstatus)
Stalled        True once Failed, with the failure's reason and message (kstatus)
PodsScheduled  False while a pod is unschedulable, with the scheduler's message
NodesAvailable False while the pool has fewer nodes than ``spec.cluster.nodes``
=============  =======================================================

kstatus (Flux's ``wait``/``healthChecks``, kpt) reads a custom resource from
``observedGeneration`` and the two "abnormal-true" conditions: ``Reconciling`` True is
InProgress, ``Stalled`` True is Failed, neither is Current.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from alpajob.api.progress import Progress
from alpajob.api.schema import Contract, k8s

DATE_TIME = k8s(format="date-time")


class Phase(StrEnum):
    """``status.phase``."""

    PENDING = "Pending"
    PLANNING = "Planning"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    QUEUED = "Queued"  # Kueue holds the attempt's pods until its ClusterQueue has the quota
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class ConditionType(StrEnum):
    """``status.conditions[].type``, in the order the operator lists them."""

    PLANNED = "Planned"
    MESHES_READY = "MeshesReady"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    #: Kueue's admission of the current attempt's pods: False while they wait for
    #: quota (Kueue's reason and message: the ClusterQueue, the flavor, what is
    #: missing), True once admitted. Absent for a job no LocalQueue admits.
    ADMITTED = "Admitted"
    READY = "Ready"
    #: False while the API server refuses to create a child (a pod forbidden for a
    #: missing ServiceAccount or by Pod Security, a quota): its reason and message.
    CHILDREN_CREATED = "ChildrenCreated"
    #: False while a pod of the job has been unschedulable for a few seconds (the
    #: scheduler's message: insufficient CPU, no node matches); True once every pod
    #: is placed again. Absent until a pod was first unschedulable.
    PODS_SCHEDULED = "PodsScheduled"
    #: False when the job was planned, or waits, with fewer usable nodes than
    #: ``spec.cluster.nodes`` (the nodes left out are named, each with why: cordoned,
    #: not Ready, a taint the mesh pods do not tolerate); True once the pool has them
    #: all again. Absent until the pool was first short.
    NODES_AVAILABLE = "NodesAvailable"
    #: kstatus's "abnormal-true" pair, which Flux and kpt read: True while the job is
    #: on its way (Pending, Planning, Queued, Starting, Restarting) ...
    RECONCILING = "Reconciling"
    #: ... and True once it failed for good (the failure's reason and message).
    STALLED = "Stalled"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class _Status(Contract):
    """Status models are built up during a reconciliation: mutable, validated on
    assignment. Reading one drops keys it does not declare, as the API server's pruning
    does."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              frozen=False, validate_assignment=True)


class Condition(_Status):
    """One condition, as ``metav1.Condition`` has it."""

    type: ConditionType = Field(description="Which condition (one entry per type).")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field("", max_length=1024, description="Why, in one CamelCase word.")
    message: str = Field("", max_length=32768, description="Why, for a person: what happened and the fix.")
    last_transition_time: str | None = Field(None, json_schema_extra=DATE_TIME,
                                             description="When status last changed.")
    observed_generation: int | None = Field(None, ge=0, json_schema_extra=k8s(format="int64"),
                                            description="The metadata.generation it was set for.")


class PlanSummary(_Status):
    """``status.plan``: the plan in a few numbers; the whole plan is in ``configMap``."""

    config_map: str = Field(description="The ConfigMap holding the whole plan (plan.json).")
    hash: str | None = Field(None, description="The plan document's content hash.")
    stages: int = Field(0, ge=0, description="Pipeline stages.")
    meshes: int = Field(0, ge=0, description="Submeshes (one per stage), each a pod group.")
    predicted_step_seconds: float | None = Field(None, ge=0, description="The cost model's step time.")
    num_micro_batches: int | None = Field(None, ge=1, description="Micro-batches per step.")


class MeshStatus(_Status):
    """One mesh (a pipeline stage's submesh): its pods."""

    name: str = Field(description="The mesh's name (mesh-0, mesh-1, ...).")
    nodes: int = Field(0, ge=0, description="Nodes the mesh spans.")
    ready_pods: int = Field(0, ge=0, description="Its pods that are Ready.")
    total_pods: int = Field(0, ge=0, description="Its pods (one per mesh host).")


class Children(_Status):
    """The names of the children of the current attempt, saved before they are created
    (a restarted operator finds them instead of creating them twice)."""

    attempt: int = Field(0, ge=0, description="The attempt these children belong to (0 first, +1 per whole-job restart).")
    config: str | None = Field(None, description="The ConfigMap holding the manifest the pods read.")
    plan: str | None = Field(None, description="The ConfigMap the planner pod writes the plan into.")
    progress: str | None = Field(None, description="The ConfigMap the driver reports progress in.")
    planner: str | None = Field(None, description="The planner pod.")
    service: str | None = Field(None, description="The head's Service (Ray, metrics).")
    hosts_service: str | None = Field(None, description="The headless Service that names every pod.")
    head: str | None = Field(None, description="The head pod (Ray head and driver).")
    pod_group: str | None = Field(None, description="The gang-scheduling PodGroup, when spec.scheduling asks for one.")
    mesh_pods: list[str] = Field(default_factory=list, max_length=4096, description="The mesh pods that stand for each host, in mesh order (a pod replaced in place while the one before it terminates is named <name>-r<k>).")
    created: int | None = Field(None, ge=0, description=(
        "The attempt whose pods have all been seen: from then on a vanished pod is a failure."))
    replaced: list[str] | None = Field(None, max_length=4096, description=(
        "UIDs of this attempt's pods already judged and replaced in place (restartScope "
        "FailedPods): never judged twice while they terminate."))


class JobTime(_Status):
    """``status.time``: where the job's wall time went, by phase, as the operator saw it
    (goodput's badput buckets at the job's level: planning, waiting for pods, restarts).
    Each bucket holds the phases that have ended; the phase in progress began at
    ``phaseSince``. Written on phase changes only, never at rest."""

    phase_since: str | None = Field(None, json_schema_extra=DATE_TIME,
                                    description="When the current phase began.")
    planning_seconds: float = Field(0.0, ge=0, description="In Pending and Planning (the planner pod).")
    starting_seconds: float = Field(0.0, ge=0, description="In Starting: waiting for every pod to run.")
    running_seconds: float = Field(0.0, ge=0, description="In Running: training (the trainer's own "
                                   "compile and checkpoint time included; status.progress has those).")
    restarting_seconds: float = Field(0.0, ge=0, description="In Restarting, after a failure.")
    queued_seconds: float = Field(0.0, ge=0, description="In Queued: waiting for Kueue's quota.")
    suspended_seconds: float = Field(0.0, ge=0, description="In Suspended.")

    def goodput(self) -> float | None:
        """Running time over the time of every ended phase (None before any ended).
        Time in Queued and Suspended is left out: the job held no GPUs then."""
        total = (self.planning_seconds + self.starting_seconds + self.running_seconds
                 + self.restarting_seconds)
        return self.running_seconds / total if total > 0 else None


class Status(_Status):
    """``status`` of an AlpaJob."""

    phase: Phase = Field(Phase.PENDING, description=(
        "Pending, Planning, Queued, Starting, Running, Restarting, Succeeded, Failed or Suspended."))
    conditions: list[Condition] = Field(
        default_factory=list, max_length=32,
        description=("Planned, MeshesReady, Running, Succeeded, Failed, Suspended, Admitted, Ready, "
                     "ChildrenCreated, PodsScheduled, NodesAvailable, and kstatus's Reconciling and Stalled."),
        json_schema_extra=k8s(x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["type"]))
    plan: PlanSummary | None = Field(
        None, description="Summary of the plan; the whole plan is in the ConfigMap configMap.")
    meshes: list[MeshStatus] = Field(
        default_factory=list, max_length=1024, description="Each mesh's pods.",
        json_schema_extra=k8s(x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["name"]))
    progress: Progress | None = Field(None, description="The trainer's last report.")
    restarts: int = Field(0, ge=0, json_schema_extra=k8s(format="int32"), description=(
        "Restarts counted against spec.runPolicy.backoffLimit."))
    disruptions: int = Field(0, ge=0, json_schema_extra=k8s(format="int32"), description=(
        "Restarts not counted against backoffLimit (podFailurePolicy Ignore: by default "
        "preemption, eviction, a lost node)."))
    start_time: str | None = Field(None, json_schema_extra=DATE_TIME,
                                   description="When the operator began the job (its planning).")
    completion_time: str | None = Field(None, json_schema_extra=DATE_TIME,
                                        description="When it Succeeded or Failed.")
    observed_generation: int | None = Field(None, ge=0, json_schema_extra=k8s(format="int64"),
                                            description="The metadata.generation this status reflects.")
    children: Children = Field(default_factory=Children, description=(
        "Names of the children the operator made, saved before it creates them."))
    time: JobTime = Field(default_factory=JobTime, description=(
        "Where the job's wall time went, by phase: planning, waiting for pods, running, "
        "restarting."))

    def to_dict(self) -> dict[str, object]:
        """The status as the API stores it: camelCase, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
