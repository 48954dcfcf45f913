"""Kueue: a job's head and mesh pods queue as one Kueue plain-pod group per attempt.

**Why plain-pod groups.** Kueue documents two ways in for a controller outside it:
*plain pods* (the controller makes pods; Kueue admits, places and preempts them as
one group, with no code of the controller's inside Kueue) and a *custom job*
integration (Kueue's own controller manages the job kind through Kueue's Go job
framework, or an external framework that suspends and resumes the job by Kueue's
protocol). The operator already makes every pod itself, by attempt, so the first
fits it whole: Kueue needs no configuration beyond its ``pod`` integration, and
every decision (quota, flavor, preemption) stays Kueue's.

**How.** A job is queued when its ``kueue.x-k8s.io/queue-name`` label, or else
``spec.scheduling.queue`` with Kueue installed and the gang scheduler not Volcano,
names a LocalQueue (:func:`queue_of`). Then :func:`enqueue` gives every head and
mesh pod of attempt ``a`` Kueue's group fields: label ``pod-group-name=<job>-<a>``
(also the name of the Workload Kueue makes for it), annotation
``pod-group-total-count`` (the head and every mesh host), annotation ``role-hash``
(its pod set: ``head``, or ``mesh-<8 hex>`` of what Kueue admits a pod by, its
containers' resources, node selector, tolerations and priority, but not its node
pin, so mesh pods of one shape are one pod set), the queue label and the job's
``kueue.x-k8s.io/priority-class`` label. Mesh pods also carry the job's
``spec.cluster.nodeSelector`` (:mod:`.children`), so Kueue only assigns a flavor of
the nodes the job was planned for. The planner pod carries none of it: the job is
planned first, then queued (a namespace's LocalQueue named ``default`` queues it
anyway, by Kueue's LocalQueueDefaulting).

Kueue's webhook gates each pod (:data:`~alpajob.api.names.KUEUE_ADMISSION_GATE`);
once every pod of the group exists it makes the Workload, and admits it when its
ClusterQueue has the quota for all of them: it removes the gates and adds the
assigned flavor's node labels and tolerations to each pod. While a pod of the
attempt is gated, :func:`queued` keeps the job **Queued** with Kueue's reason and
message (condition ``Admitted=False``), read again every :data:`QUEUE_REFRESH`
seconds; ``Admitted=True`` then names the ClusterQueue and the flavors.

**Preemption.** Kueue gives each pod of a preempted group the condition
``TerminationTarget`` and deletes it: SIGTERM, so the head saves its checkpoint.
The operator counts a disruption (the DisruptionTarget rule of
``runPolicy.podFailurePolicy``) and starts the next attempt, whose new group queues
again and resumes from the checkpoint once admitted.

**Release** (:func:`release`). Kueue ends a group only when all its pods succeeded,
or when one carries ``retriable-in-group: "false"`` and all have stopped: until
then its Workload holds the quota, and its finalizer holds the pods. So every
attempt the operator leaves (a restart, a suspension, the job's end) has its pods
annotated ``retriable-in-group: "false"``; Kueue then finishes the Workload, frees
the quota and releases the pods.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from alpajob.api import wording
from alpajob.api.names import (
    KUEUE_ADMISSION_GATE,
    KUEUE_GROUP_COUNT_ANNOTATION,
    KUEUE_GROUP_LABEL,
    KUEUE_MANAGED_LABEL,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    KUEUE_RETRIABLE_ANNOTATION,
    KUEUE_ROLE_ANNOTATION,
    LABEL_ATTEMPT,
    LABEL_ROLE,
    Role,
)
from alpajob.api.status import ConditionStatus, ConditionType, Phase
from alpajob.operator.decision import PassState
from alpajob.operator.pods import parse_time
from alpajob.operator.status import set_condition

#: Seconds between two reads of a queued attempt's Workload (its pending message
#: changes with no change to the pods the operator watches).
QUEUE_REFRESH = 10.0
#: Seconds between two looks for the Workload Kueue is about to make.
WORKLOAD_POLL = 1.0
#: Seconds a gated attempt may wait for Kueue to make its Workload before the job
#: says Kueue's pod integration may be off for the namespace.
WORKLOAD_GRACE = 30.0
#: Kueue admits a pod group of at most 8 pod sets (roles).
MAX_POD_SETS = 8


def queue_of(job: Mapping[str, Any], kueue: bool, gang: str | None) -> str | None:
    """The LocalQueue that admits ``job``'s head and mesh pods: its queue label, else
    ``spec.scheduling.queue`` when Kueue is installed (``kueue``) and the gang
    scheduler is not Volcano (whose PodGroup takes that queue instead); None when
    the job is not queued by Kueue."""
    label = ((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    if label:
        return str(label)
    queue = ((job.get("spec") or {}).get("scheduling") or {}).get("queue")
    if queue and kueue and gang != "volcano":
        return str(queue)
    return None


def role_of(pod: Mapping[str, Any]) -> str:
    """The pod set a pod belongs to in the attempt's Workload: ``head``, or
    ``mesh-<8 hex>`` of what Kueue admits it by (module docstring)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_ROLE) == Role.HEAD.value:
        return "head"
    spec = pod.get("spec") or {}
    shape = {"containers": [c.get("resources") or {} for c in spec.get("containers") or []],
             "initContainers": [c.get("resources") or {} for c in spec.get("initContainers") or []],
             "nodeSelector": spec.get("nodeSelector") or {}, "tolerations": spec.get("tolerations") or [],
             "priorityClassName": spec.get("priorityClassName")}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    return f"mesh-{digest}"


def enqueue(pod: dict[str, Any], job: Mapping[str, Any], group: str, queue: str, total: int) -> dict[str, Any]:
    """``pod`` (a head or mesh pod of :mod:`.children`) as a member of Kueue's pod
    group ``group`` of ``total`` pods in LocalQueue ``queue``; changed in place."""
    meta = pod["metadata"]
    labels = meta.setdefault("labels", {})
    labels[KUEUE_QUEUE_LABEL] = queue
    labels[KUEUE_GROUP_LABEL] = group
    priority = ((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_PRIORITY_LABEL)
    if priority:
        labels[KUEUE_PRIORITY_LABEL] = str(priority)
    annotations = meta.setdefault("annotations", {})
    annotations[KUEUE_GROUP_COUNT_ANNOTATION] = str(total)
    annotations[KUEUE_ROLE_ANNOTATION] = role_of(pod)
    return pod


def gated(pod: Mapping[str, Any]) -> bool:
    """Is ``pod`` held by Kueue's admission gate?"""
    return any(g.get("name") == KUEUE_ADMISSION_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def _managed(pod: Mapping[str, Any]) -> bool:
    """Did Kueue's webhook take ``pod`` (its ``kueue.x-k8s.io/managed`` label)?"""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(KUEUE_MANAGED_LABEL) == "true"


def _condition(workload: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def admitted(workload: Mapping[str, Any] | None) -> bool:
    """Has Kueue admitted ``workload`` (quota reserved, admission checks passed)?"""
    condition = _condition(workload or {}, "Admitted")
    return condition is not None and condition.get("status") == "True"


def admission_text(workload: Mapping[str, Any]) -> str:
    """``admitted by ClusterQueue <cq> (flavors ...)``, from the Workload's admission."""
    admission = (workload.get("status") or {}).get("admission") or {}
    flavors = sorted({str(f) for a in admission.get("podSetAssignments") or []
                      for f in (a.get("flavors") or {}).values()})
    shown = f" (flavor{'s' if len(flavors) > 1 else ''} {', '.join(flavors)})" if flavors else ""
    return f"admitted by ClusterQueue {admission.get('clusterQueue', '?')}{shown}"


def queued(state: PassState) -> bool:
    """While a pod of the current attempt is held by Kueue's gate: phase Queued and
    condition ``Admitted=False`` with Kueue's reason and message (or, before Kueue
    made the Workload, why not yet), read again every :data:`QUEUE_REFRESH` seconds;
    True then. Once the attempt is admitted, ``Admitted=True``."""
    queue = state.seen.queue
    if queue is None:
        return False
    pods = state.pods_of(state.attempt)
    waiting = sorted(n for n, p in pods.items() if gated(p))
    workload = state.seen.workload
    before = next((c for c in state.status.conditions if c.type is ConditionType.ADMITTED), None)
    if not waiting:
        if workload is not None and admitted(workload) and (before is None or before.status is not ConditionStatus.TRUE):
            message = admission_text(workload)
            set_condition(state.status, ConditionType.ADMITTED, True, "Admitted", message, state.generation, state.now)
            state.decision.events.append(("Normal", "Admitted", message))
        elif state.seen.kueue and pods and not any(_managed(p) for p in pods.values()) \
                and (before is None or before.reason != "NotManaged"):
            message = (f"the pods name LocalQueue {queue}, but Kueue's webhook did not queue them: enable Kueue's "
                       f"pod integration for namespace {state.meta['namespace']} (integrations.frameworks: pod, "
                       "managedJobsNamespaceSelector); the job runs unqueued")
            set_condition(state.status, ConditionType.ADMITTED, False, "NotManaged", message, state.generation,
                          state.now)
            state.decision.events.append(("Warning", "NotManaged", message))
        return False
    group = state.names.pod_group
    if workload is None:
        made = [parse_time((p.get("metadata") or {}).get("creationTimestamp")) for p in pods.values()]
        oldest = min((t for t in made if t is not None), default=None)
        age = (state.seen.now.replace(tzinfo=None) - oldest).total_seconds() if oldest is not None else 0.0
        reason, message = "WorkloadPending", f"Kueue is making Workload {group} for the attempt's pods"
        if age >= WORKLOAD_GRACE:
            reason = "NoWorkload"
            message = (f"Kueue has made no Workload {group} for the attempt's {wording.counted(len(waiting), 'gated pod')} "
                       f"in {age:.0f} s: is Kueue's pod integration enabled for namespace "
                       f"{state.meta['namespace']} (integrations.frameworks: pod, managedJobsNamespaceSelector)?")
    else:
        reserved = _condition(workload, "QuotaReserved") or {}
        reason = str(reserved.get("reason") or "WorkloadPending")
        message = str(reserved.get("message") or f"Workload {group} waits for Kueue to look at it")
        evicted = _condition(workload, "Evicted")
        if evicted is not None and evicted.get("status") == "True":
            reason, message = str(evicted.get("reason") or reason), str(evicted.get("message") or message)
    set_condition(state.status, ConditionType.ADMITTED, False, reason, message, state.generation, state.now)
    state.phase(Phase.QUEUED, "Queued", f"waiting for quota in LocalQueue {queue} (Workload {group}): {message}")
    fresh = workload is None or _condition(workload, "QuotaReserved") is None  # Kueue has not judged it yet
    state.decision.wake(WORKLOAD_POLL if fresh else QUEUE_REFRESH)
    return True


def too_many_roles(state: PassState, pods: list[dict[str, Any]]) -> str | None:
    """The message when the attempt's pods would make more pod sets than Kueue admits."""
    existing = list(state.pods_of(state.attempt).values())
    roles = {((p.get("metadata") or {}).get("annotations") or {}).get(KUEUE_ROLE_ANNOTATION)
             for p in [*existing, *pods]}
    roles.discard(None)
    if len(roles) <= MAX_POD_SETS:
        return None
    return (f"the plan's mesh pods come in {len(roles) - 1} shapes (resources, node selector, tolerations), "
            f"and Kueue admits a pod group of at most {MAX_POD_SETS} pod sets, the head's included: give the "
            "stages one size with spec.podTemplate.mesh.resources")


def unqueued(state: PassState) -> None:
    """A job whose ``spec.scheduling.queue`` no installed queueing system takes (no
    Kueue, no Volcano) runs unqueued: condition ``Admitted=False`` (reason NoQueueing)
    and one Warning event say so, instead of silence."""
    queue = (state.spec.get("scheduling") or {}).get("queue")
    if not queue or state.seen.queue is not None or state.seen.kueue or state.seen.gang == "volcano":
        return
    before = next((c for c in state.status.conditions if c.type is ConditionType.ADMITTED), None)
    if before is not None and before.reason == "NoQueueing":
        return
    message = (f"spec.scheduling.queue names {queue}, but neither Kueue (CRD workloads.kueue.x-k8s.io) nor "
               "Volcano is installed: the job runs unqueued")
    set_condition(state.status, ConditionType.ADMITTED, False, "NoQueueing", message, state.generation, state.now)
    state.decision.events.append(("Warning", "NoQueueing", message))


def requeue(state: PassState) -> None:
    """``spec.scheduling.queue`` changed while the attempt waits: its gated pods get
    the new queue label (Kueue moves a Workload that is not admitted yet to the queue
    its pods name; an admitted one stays where it runs)."""
    queue = state.seen.queue
    if queue is None:
        return
    for name, pod in sorted(state.pods_of(state.attempt).items()):
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if gated(pod) and KUEUE_GROUP_LABEL in labels and labels.get(KUEUE_QUEUE_LABEL) != queue:
            state.decision.pod_metadata.append((name, {"labels": {KUEUE_QUEUE_LABEL: queue}}))


#: The metadata patch that ends a pod's Kueue group once its pods have stopped.
END_GROUP = {"annotations": {KUEUE_RETRIABLE_ANNOTATION: "false"}}


def in_open_group(pod: Mapping[str, Any]) -> bool:
    """Is ``pod`` in a Kueue group that nothing has ended yet (no pod of it told so)?"""
    meta = pod.get("metadata") or {}
    return KUEUE_GROUP_LABEL in (meta.get("labels") or {}) \
        and (meta.get("annotations") or {}).get(KUEUE_RETRIABLE_ANNOTATION) != "false"


def release(state: PassState) -> None:
    """Annotate ``retriable-in-group: "false"`` on every Kueue-grouped pod of an
    attempt the job has left (every attempt, once it is finished or suspended), so
    Kueue finishes that Workload once its pods stopped (module docstring)."""
    live = None if state.status.phase.finished or state.status.phase is Phase.SUSPENDED else str(state.attempt)
    for name, pod in sorted(state.seen.pods.items()):
        attempt = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT)
        if in_open_group(pod) and attempt != live:
            state.decision.pod_metadata.append((name, END_GROUP))
