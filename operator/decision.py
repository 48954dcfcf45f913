"""One reconciliation pass's input, output and state: what the steps of
:mod:`.reconcile` read and the primitive actions they take.

:class:`Observed` is what the handlers read (the job, its children, the pool, the
time), :class:`Decision` what a pass decides (the new status, children to create or
delete, events, when to run again), and :class:`PassState` one pass's working state
with the actions every step shares: set the phase (and every condition with it), find
the pods of an attempt, delete or stop pods (forcing the stuck), start the next
attempt, read the plan's hosts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from alpajob.api.names import LABEL_ATTEMPT, LABEL_HOST, LABEL_MESH, LABEL_ROLE, Role
from alpajob.api.plan import Plan
from alpajob.api.pod_template import PodTemplates
from alpajob.api.status import Phase, Status
from alpajob.operator import children
from alpajob.operator.names import ChildNames
from alpajob.operator.network import NetworkSettings
from alpajob.operator.pods import done, forced, parse_time, terminating, uid
from alpajob.operator.pool import PoolNode
from alpajob.operator.status import set_phase

#: Seconds after a pod's deletion time (its ``deletionTimestamp``: the delete plus its
#: grace period) when the operator forces the deletion of a pod still there: past the
#: grace period its kubelet has sent SIGKILL already, so only a kubelet that cannot
#: confirm (a hung or partitioned node) keeps the pod, and a new attempt waits for it.
FORCE_AFTER = 15.0

@dataclass(frozen=True)
class Observed:
    """The job and its world as the handlers read them."""

    job: Mapping[str, Any]
    now: datetime
    manifest_yaml: str
    pool: Sequence[PoolNode] = ()
    left_out: Sequence[tuple[str, str]] = ()  # matching nodes not in the pool, and why
    configmaps: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    pods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # the job's pods, by name
    services: frozenset[str] = frozenset()
    claims: frozenset[str] = frozenset()  # the job's PersistentVolumeClaims (labelled with it)
    pod_groups: frozenset[str] = frozenset()
    gang: str | None = None  # installed gang scheduler: volcano, coscheduling or None
    queue: str | None = None  # the Kueue LocalQueue that admits the job (.queueing.queue_of), or None
    kueue: bool = False  # Kueue is installed
    workload: Mapping[str, Any] | None = None  # Kueue's Workload of the current attempt's pod group
    ready_nodes: frozenset[str] = frozenset()
    default_image: str = children.DEFAULT_IMAGE  # for jobs without spec.image
    network: NetworkSettings = NetworkSettings()  # the jobs' NetworkPolicies


@dataclass
class Decision:
    """What to do: status first (children's names included), then creations, deletions."""

    status: Status
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str, int | None]] = field(default_factory=list)  # kind, name, grace seconds
    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message
    #: Pods' metadata to merge: (pod, {"labels": {...}, "annotations": {...}}).
    pod_metadata: list[tuple[str, dict[str, dict[str, str]]]] = field(default_factory=list)
    delete_job: bool = False
    clear_plan: bool = False  # empty the plan ConfigMap: the job is planned again
    #: Seconds until a rule may fire with no change in the world (a deadline, a TTL);
    #: None: only a change can alter the decision.
    wake_after: float | None = None

    def wake(self, seconds: float) -> None:
        """Ask for a pass ``seconds`` from now (the earliest of the asked)."""
        seconds = max(seconds, 0.0)
        self.wake_after = seconds if self.wake_after is None else min(self.wake_after, seconds)


def time_text(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")



class PassState:
    """One pass's working state and shared actions (module docstring)."""

    def __init__(self, seen: Observed) -> None:
        self.seen = seen
        spec = dict(seen.job.get("spec") or {})
        spec.setdefault("image", seen.default_image)  # a view: the operator never writes spec
        self.job = {**seen.job, "spec": spec}
        self.spec = spec
        self.meta = seen.job["metadata"]
        self.generation = int(self.meta.get("generation") or 1)
        self.now = time_text(seen.now)
        self.status = Status.model_validate(seen.job.get("status") or {})
        self.decision = Decision(status=self.status)
        self.attempt = self.status.children.attempt
        self.names = ChildNames(self.meta["name"], self.attempt)
        self.run_policy = self.spec.get("runPolicy") or {}
        self.plan_doc: Plan | None = None
        self.templates, self.template_error = PodTemplates(), ""
        try:
            self.templates = PodTemplates.model_validate(self.spec.get("podTemplate") or {})
        except ValidationError as error:  # the webhook refuses these; without it, say so here
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            self.template_error = f"spec.podTemplate.{where}: {first['msg']}"

    def phase(self, phase: Phase, reason: str, message: str = "", meshes_ready: bool = False) -> None:
        before = self.status.phase
        set_phase(self.status, phase, reason, message, self.generation, self.now, meshes_ready)
        if phase is not before:
            kind = "Warning" if phase in (Phase.FAILED, Phase.RESTARTING) else "Normal"
            self.decision.events.append((kind, reason, message or f"phase {before} -> {phase}"))
            if phase.finished:
                self.status.completion_time = self.now

    def pods_of(self, attempt: int | None = None, role: Role | None = None) -> dict[str, Mapping[str, Any]]:
        out = {}
        for name, pod in self.seen.pods.items():
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if attempt is not None and labels.get(LABEL_ATTEMPT) != str(attempt):
                continue
            if role is not None and labels.get(LABEL_ROLE) != role.value:
                continue
            out[name] = pod
        return out

    def host_pods(self, mesh: int, host: int) -> dict[str, Mapping[str, Any]]:
        """The current attempt's pods of mesh ``mesh``'s host ``host`` (by their
        labels): one, or while it is replaced in place, the one that terminates and
        its replacement."""
        out = {}
        for name, pod in self.pods_of(self.attempt, Role.MESH).items():
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if (labels.get(LABEL_MESH), labels.get(LABEL_HOST)) == (str(mesh), str(host)):
                out[name] = pod
        return out

    def host_pod(self, mesh: int, host: int) -> tuple[str, Mapping[str, Any]] | None:
        """The pod that stands for mesh ``mesh``'s host ``host``: the one not being
        replaced (its uid not in ``status.children.replaced``); None if there is none."""
        judged = set(self.status.children.replaced or [])
        standing = [(n, p) for n, p in self.host_pods(mesh, host).items() if uid(p) not in judged]
        return min(standing, key=lambda item: item[0]) if standing else None

    def judge(self, pods: Mapping[str, Mapping[str, Any]]) -> None:
        """Remember ``pods`` (by uid, in ``status.children.replaced``) as judged and
        being replaced: while they terminate, no pass counts them again, and
        :meth:`host_pod` looks past them."""
        made = self.status.children
        made.replaced = sorted({*(made.replaced or []), *(key for p in pods.values() if (key := uid(p)))})

    def replacement_name(self, mesh: int, host: int) -> str:
        """The name for a new pod of mesh ``mesh``'s host ``host``: its usual name, or
        while a pod of that name still terminates, the first free ``<name>-r<k>``
        (as a Job makes a replacement while the pod it replaces terminates)."""
        base = self.names.mesh_pod(mesh, host)
        name, k = base, 0
        while name in self.seen.pods:
            k += 1
            name = f"{base}-r{k}"
        return name

    def delete_pods(self, pods: Mapping[str, Mapping[str, Any]]) -> None:
        """Delete ``pods``. One already terminating is left to its kubelet for its grace
        period, then forced (its API object removed: the kubelet still kills what is
        left) :data:`FORCE_AFTER` seconds later, or at once when its node is not Ready
        (a lost node's kubelet never confirms), as the pod garbage collector does."""
        for name, pod in pods.items():
            node = (pod.get("spec") or {}).get("nodeName")
            if forced(pod):
                continue  # forced already: only a finalizer (Kueue's) keeps it
            if not terminating(pod):
                self.decision.delete.append(("Pod", name, None))
                continue
            if node and node not in self.seen.ready_nodes:
                self.decision.delete.append(("Pod", name, 0))
                continue
            due = parse_time(pod["metadata"]["deletionTimestamp"])
            if due is None:
                continue
            left = FORCE_AFTER - (self.seen.now.replace(tzinfo=None) - due).total_seconds()
            if left <= 0:
                self.decision.delete.append(("Pod", name, 0))
            else:
                self.decision.wake(left)

    def stop_pods(self, pods: Mapping[str, Mapping[str, Any]]) -> None:
        """Delete those of ``pods`` that still run; finished ones keep their logs (but
        one whose deletion was asked already is seen through: forced when stuck)."""
        self.delete_pods({n: p for n, p in pods.items() if not done(p) or terminating(p)})

    @property
    def plan(self) -> Plan:
        assert self.plan_doc is not None, "the plan step found no plan"
        return self.plan_doc

    def hosts(self) -> list[tuple[int, int, int]]:
        """(mesh, host, hosts of the mesh) of the plan."""
        return [(m, h, n) for m, h, n, _ in self.host_devices()]

    def host_devices(self) -> list[tuple[int, int, int, int]]:
        """(mesh, host, hosts of the mesh, devices per host) of the plan."""
        out: list[tuple[int, int, int, int]] = []
        for stage in self.plan.stages:
            n, m = stage.submesh_shape
            out.extend((stage.index, j, n, m) for j in range(n))
        return out

    def next_attempt(self) -> None:
        self.decision.delete.append(("Secret", self.names.ray_token, None))  # the old attempt's Ray token
        self.attempt += 1
        self.names = ChildNames(self.meta["name"], self.attempt)
        self.status.children.attempt = self.attempt
        self.status.children.replaced = None

