"""``spec.podTemplate``: what a user may change of the pods the operator makes, per role.

The operator builds three kinds of pods (:class:`~alpajob.api.names.Role`): the
planner, the head (Ray head and driver) and one pod per mesh host. Each kind takes a
:class:`PodOverrides` under its role's name, as Kubeflow's pod template overrides and
KubeRay's group templates do::

    spec:
      podTemplate:
        mesh:
          resources: {requests: {cpu: 8, memory: 64Gi}}
          nodeSelector: {cloud.google.com/gke-nodepool: a3}
          tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
          env: [{name: NCCL_DEBUG, value: INFO}]
          shmSize: 16Gi
        head:
          priorityClassName: training-high

Every field is optional. What is not set keeps the operator's default: resources sized
from the plan (:mod:`alpajob.operator.sizing`), ``fsGroup`` 1000, ``/dev/shm`` sized
from the plan. What the job's own wiring needs stays the operator's and is refused
here with the field named: ``ALPAJOB_*`` variables (the runtime contract), labels
under ``alpajob.io/``, volumes named like the operator's, and anything Pod Security
"restricted" forbids (host paths, running as root), so the pods are still admitted in
a restricted namespace.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints, field_validator

from alpajob.api.names import ANNOTATION_PREFIX
from alpajob.api.runtime import ENV_PREFIX
from alpajob.api.schema import INT64, INT64_MAX, Contract, k8s

#: A Kubernetes resource quantity of 0 or more (``2``, ``500m``, ``16Gi``): the API
#: server's grammar without the minus sign, since every size and count of a job (a
#: request, a limit, /dev/shm, a claim, a cache) is refused negative by a pod or a claim.
QUANTITY = (r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
            r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
#: A label's or annotation's key: an optional DNS-subdomain prefix and ``/``, then a name
#: of at most 63 letters, digits, ``-``, ``_`` and ``.`` that starts and ends alphanumeric.
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
#: A label's value: empty, or like a key's name part.
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def _quantity(value: Any) -> Any:
    negative = (isinstance(value, int) and not isinstance(value, bool) and value < 0) or (
        isinstance(value, str) and value.startswith("-"))
    if negative:
        raise ValueError(f"{value!r} is negative; a size or a count is 0 or more")
    if isinstance(value, bool) or not isinstance(value, int | str) or (
            isinstance(value, str) and not re.fullmatch(QUANTITY, value)):
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write e.g. 2, 500m or 16Gi")
    return value


def _keys(value: dict[str, Any]) -> dict[str, Any]:
    """Every key a qualified name (a label's or an annotation's key), as the API server
    requires of the pods these keys end up on."""
    for key in value:
        prefix, _, name = key.rpartition("/")
        if not re.fullmatch(QUALIFIED_NAME, key) or len(name) > 63 or len(prefix) > 253:
            raise ValueError(f"{key!r} is not a valid label key: an optional DNS prefix and '/', then at "
                             "most 63 letters, digits, '-', '_' or '.', starting and ending with a letter "
                             "or digit (e.g. example.com/team)")
    return value


Quantity = Annotated[int | str, BeforeValidator(_quantity),
                     Field(json_schema_extra=k8s(x_kubernetes_int_or_string=True, pattern=QUANTITY))]
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE)]
AnnotationValue = Annotated[str, StringConstraints(max_length=65536)]
#: Labels (a node selector, a pod's labels): qualified keys, label values.
Labels = Annotated[dict[str, LabelValue], AfterValidator(_keys)]

#: Volumes the operator mounts itself: a template's volume may not take these names.
RESERVED_VOLUMES = frozenset({"config", "plan", "checkpoints", "dshm", "calibration"})
#: The volume sources Pod Security "restricted" admits.
RESTRICTED_VOLUME_SOURCES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                             "persistentVolumeClaim", "projected", "secret")


class PodMetadata(Contract):
    """Labels and annotations added to the pods (the operator's own win)."""

    labels: Labels = Field(default_factory=dict, max_length=64,
                           description="Labels added to the pods (not under alpajob.io/).")
    annotations: Annotated[dict[str, AnnotationValue], AfterValidator(_keys)] = Field(
        default_factory=dict, max_length=64, description=(
        "Annotations added to the pods (not under alpajob.io/)."))

    @field_validator("labels", "annotations")
    @classmethod
    def _not_ours(cls, value: dict[str, str]) -> dict[str, str]:
        ours = sorted(k for k in value if k.startswith(ANNOTATION_PREFIX))
        if ours:
            raise ValueError(f"{', '.join(ours)}: keys under {ANNOTATION_PREFIX} are the operator's; "
                             "choose another prefix")
        return value


class Resources(Contract):
    """The container's requests and limits (``cpu``, ``memory``, ``nvidia.com/gpu``,
    any extended resource); a key set here replaces the operator's value for that key."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16, description=(
        "What the scheduler reserves, by resource name (e.g. cpu: 4, memory: 32Gi)."))
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16, description=(
        "The most the container may use, by resource name."))


class Toleration(Contract):
    """A toleration, as in a pod spec."""

    key: str | None = Field(None, max_length=316, description="The taint's key (empty with Exists: every taint).")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Equal (the default) or Exists.")
    value: str | None = Field(None, max_length=63, description="The taint's value, with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint effect to tolerate; empty: every effect.")
    toleration_seconds: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX, json_schema_extra=INT64, description=(
        "With NoExecute: how long the pod stays on a node after the taint appears."))


class EnvVar(Contract):
    """An environment variable: a ``value``, or ``valueFrom`` as in a pod spec."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="The variable's name (not ALPAJOB_*: those are the runtime contract).")
    value: str | None = Field(None, max_length=32768, description="Its value.")
    value_from: dict[str, Any] | None = Field(
        None, json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description="As in a pod spec: secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef.")

    @field_validator("name")
    @classmethod
    def _not_the_contract(cls, value: str) -> str:
        if value.startswith(ENV_PREFIX):
            raise ValueError(f"{value}: {ENV_PREFIX}* variables are the operator's runtime contract; "
                             "choose another name")
        return value


class VolumeMount(Contract):
    """Where a volume of ``volumes`` appears in the container."""

    name: str = Field(min_length=1, max_length=63, description="The name of a volume in volumes.")
    mount_path: str = Field(min_length=1, max_length=1024, pattern=r"^/",
                            description="Where it appears in the container (an absolute path).")
    read_only: bool = Field(False, description="Mount it read-only.")
    sub_path: str | None = Field(None, max_length=1024, description="A path inside the volume to mount instead of its root.")

    @field_validator("sub_path")
    @classmethod
    def _inside(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError(f"subPath {value!r} must be a relative path inside the volume, without '..'")
        return value


class PodSecurity(Contract):
    """Pod-level security settings a user may choose (the rest stays "restricted")."""

    fs_group: int | None = Field(None, ge=0, le=INT64_MAX, json_schema_extra=INT64, description=(
        "Group that owns the pods' volumes (default 1000, the image's user's group), so "
        "uid 1000 can write a volume made by root."))
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = Field(None, description=(
        "When the kubelet changes the volumes' ownership to fsGroup: always, or only when the root differs."))
    run_as_user: int | None = Field(None, ge=1, le=INT64_MAX, json_schema_extra=INT64,
                                    description="Any uid but 0 (Pod Security restricted).")
    run_as_group: int | None = Field(None, ge=0, le=INT64_MAX, json_schema_extra=INT64,
                                     description="The containers' primary group id (default the image's).")
    supplemental_groups: list[int] = Field(default_factory=list, max_length=32,
                                           description="More group ids of the containers' processes.")


class PodOverrides(Contract):
    """What one role's pods may change (module docstring)."""

    metadata: PodMetadata | None = Field(None, description="Labels and annotations added to the pods.")
    resources: Resources | None = Field(None, description=(
        "The container's requests and limits; a key set here replaces the operator's, sized from the plan."))
    node_selector: Labels = Field(default_factory=dict, max_length=32, description=(
        "Node labels the pods must match, added to the operator's."))
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32,
                                          description="Taints the pods tolerate, as in a pod spec.")
    affinity: dict[str, Any] | None = Field(
        None, json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True), description=(
            "As in a pod spec. A mesh pod's node (from the plan) is added to every "
            "nodeSelectorTerm of requiredDuringSchedulingIgnoredDuringExecution."))
    env: list[EnvVar] = Field(default_factory=list, max_length=128,
                              description="Environment variables of the container.")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32,
        json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description=("Volumes as in a pod spec, each with a name and one source that Pod Security "
                     "restricted admits: " + ", ".join(RESTRICTED_VOLUME_SOURCES) + "."))
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=32,
                                             description="Where the volumes appear in the container.")
    security_context: PodSecurity | None = Field(None, description=(
        "Pod-level security settings a user may choose; the rest stays Pod Security restricted."))
    priority_class_name: str | None = Field(None, max_length=253, description=(
        "The pods' PriorityClass (default spec.scheduling.priorityClassName)."))
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="When the kubelet pulls the image (default: the Kubernetes default for its tag).")
    image_pull_secrets: list[Annotated[str, StringConstraints(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Names of Secrets to pull the image with.")
    shm_size: Quantity | None = Field(None, description=(
        "Size of the memory-backed /dev/shm (Ray's object store lives there); default: sized "
        "from the plan. Counted in the pod's memory."))
    termination_grace_period_seconds: int | None = Field(None, ge=0, le=INT64_MAX, json_schema_extra=INT64,
                                                         description="Seconds a deleted pod may take to stop.")

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, volumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for index, volume in enumerate(volumes):
            name = volume.get("name") if isinstance(volume, dict) else None
            if not isinstance(name, str) or not name:
                raise ValueError(f"volumes[{index}] needs a name")
            if name in RESERVED_VOLUMES:
                raise ValueError(f"volumes[{index}]: the name {name!r} is the operator's own "
                                 f"({', '.join(sorted(RESERVED_VOLUMES))}); choose another")
            sources = [k for k in volume if k != "name"]
            if len(sources) != 1:
                raise ValueError(f"volumes[{index}] ({name}) needs exactly one source, got "
                                 f"{', '.join(sources) or 'none'}")
            if sources[0] not in RESTRICTED_VOLUME_SOURCES:
                raise ValueError(f"volumes[{index}] ({name}): {sources[0]} is not admitted by Pod Security "
                                 f"restricted; use one of {', '.join(RESTRICTED_VOLUME_SOURCES)}")
        return volumes


class PodTemplates(Contract):
    """``spec.podTemplate``: overrides of each role's pods."""

    planner: PodOverrides | None = Field(None, description="The planner pod (alpajob plan).")
    head: PodOverrides | None = Field(None, description="The head pod (Ray head and the driver).")
    mesh: PodOverrides | None = Field(None, description="Every mesh pod (one per mesh host).")

    def of(self, role: str) -> PodOverrides:
        """The overrides of ``role`` (planner, head or mesh); empty when unset."""
        return getattr(self, role, None) or PodOverrides()
