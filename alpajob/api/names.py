"""Every name that two parts of AlpaJob must spell alike, in one place.

The API group and kind, the labels and annotations on a job's children, the keys of
its ConfigMaps, the finalizer, the node labels and resources the operator reads. The
operator writes them, the trainer and users' tools (``kubectl -l``, dashboards) read
them; a literal of any of them appears nowhere else in the code.

Child objects' *names* (``<job>-plan``, ``<job>-<attempt>-m<i>-h<j>``) follow from
the job and the attempt: :class:`alpajob.operator.names.ChildNames` makes them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

# --------------------------------------------------------------------------- the resource
GROUP = "alpajob.io"
VERSION = "v1alpha1"
API_VERSION: Final[Literal["alpajob.io/v1alpha1"]] = "alpajob.io/v1alpha1"
KIND: Final[Literal["AlpaJob"]] = "AlpaJob"
LIST_KIND = "AlpaJobList"
PLURAL = "alpajobs"
SINGULAR = "alpajob"
SHORT_NAMES = ("aj",)
CATEGORIES = ("all", "alpajob")
CRD_NAME = f"{PLURAL}.{GROUP}"

#: The finalizer kopf keeps on every AlpaJob while the operator follows it.
FINALIZER = f"{GROUP}/operator"
#: Prefix of the annotations kopf keeps its progress and diff base in.
ANNOTATION_PREFIX = GROUP

# --------------------------------------------------------------------------- labels
#: On every child: the job it belongs to (the operator's and users' selector).
LABEL_JOB = f"{GROUP}/job"
#: On every child: what it is (:class:`Role`).
LABEL_ROLE = f"{GROUP}/role"
#: On pods and PodGroups: the attempt (0, then one more per restart of the whole job).
LABEL_ATTEMPT = f"{GROUP}/attempt"
#: On mesh pods: the mesh (the plan's stage) and the host inside it.
LABEL_MESH = f"{GROUP}/mesh"
LABEL_HOST = f"{GROUP}/host"


class Role(StrEnum):
    """The value of :data:`LABEL_ROLE`: which part of the job a child is."""

    CONFIG = "config"  # ConfigMap: the job as applied
    PLAN = "plan"  # ConfigMap: the Plan document
    PROGRESS = "progress"  # ConfigMap: the trainer's progress
    PLANNER = "planner"  # Pod: runs `alpajob plan` once
    HEAD = "head"  # Pod and Service: the Ray head and the driver
    MESH = "mesh"  # Pods and the headless Service: the mesh hosts
    GANG = "gang"  # PodGroup
    CHECKPOINTS = "checkpoints"  # PersistentVolumeClaim made from spec.checkpoint.volumeClaimTemplate
    RAY_TOKEN = "ray-token"  # Secret: the attempt's Ray authentication token
    NETWORK = "network"  # NetworkPolicy: who may connect to the job's pods
    IDENTITY = "identity"  # ServiceAccount, Role and RoleBinding: what the job's pods may do in the API


# --------------------------------------------------------------------------- ConfigMap keys
#: ``<job>-config``: the AlpaJob as its pods read it.
MANIFEST_KEY = "manifest.yaml"
#: ``<job>-plan``: the Plan document (:mod:`alpajob.api.plan`), written by the planner pod.
PLAN_KEY = "plan.json"
#: ``<job>-progress``: the trainer's progress (:mod:`alpajob.api.progress`).
PROGRESS_KEY = "progress.json"

# --------------------------------------------------------------------------- nodes and schedulers
#: The extended resource of NVIDIA's device plugin, on nodes and in pods' limits.
GPU_RESOURCE = "nvidia.com/gpu"
#: The GPU model label of NVIDIA's GPU feature discovery, on nodes.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: The node label the operator pins a mesh pod's affinity on.
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: Kueue's queue label: on the job, the LocalQueue that admits its head and mesh pods.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Kueue's WorkloadPriorityClass label: copied from the job onto its head and mesh pods.
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
#: Kueue's plain-pod group: the label naming it (one group per attempt, ``<job>-<a>``,
#: which is also the name of the Workload Kueue makes for it) ...
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
#: ... the annotation counting its pods ...
KUEUE_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
#: ... the annotation naming a pod's pod set in the Workload (``head``, ``mesh-<hash>``) ...
KUEUE_ROLE_ANNOTATION = "kueue.x-k8s.io/role-hash"
#: ... and the annotation that ends the group once its pods have stopped (``"false"``).
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
#: The label Kueue's webhook puts on a pod it manages (``"true"``).
KUEUE_MANAGED_LABEL = "kueue.x-k8s.io/managed"
#: The scheduling gate Kueue's webhook puts on a pod it queues; removed on admission.
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
#: The pod condition Kueue sets on a pod it stops (preemption, eviction).
KUEUE_TERMINATION_CONDITION = "TerminationTarget"
#: The CRD whose presence means Kueue is installed.
KUEUE_WORKLOAD_CRD = "workloads.kueue.x-k8s.io"
#: Volcano's pod annotation naming its PodGroup.
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
#: The scheduler-plugins coscheduling plugin's pod label naming its PodGroup.
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
