"""Kueue for tests: its pod webhook and its controller, played against the test API
server (``kube_emulator.Emulator``) as Kueue's documentation and code specify them.

:meth:`Kueue.install` serves Kueue's kinds (their storage version v1beta2; writes pruned
by Kueue's own CRD schemas where they are at hand: :func:`crd_folder`) and registers the
mutating webhook
of Kueue's ``pod`` integration; :meth:`Kueue.start` runs the controller on a thread.
What each part does, as Kueue does it for plain pods:

- **webhook** (``pod_webhook.go``), for a pod created in a managed namespace whose
  controller owner is not a kind Kueue manages: a pod without a queue label gets
  ``queue-name: default`` when the namespace has a LocalQueue named ``default``
  (LocalQueueDefaulting); a pod with a queue label gets the finalizer and the label
  ``kueue.x-k8s.io/managed``, the scheduling gate ``kueue.x-k8s.io/admission`` and,
  in a group, a role hash when it has none. A group's label without its total-count
  annotation (or the other way round) is refused, as Kueue's validation refuses it;
- **workloads** (``pod_controller.go``): once a group has as many runnable pods as its
  total count, a Workload named after the group, owned by its pods, with a pod set
  per role hash (its count, the first pod's spec as template), the queue, and the
  priority (a ``kueue.x-k8s.io/priority-class`` WorkloadPriorityClass, else the pods'
  PriorityClass);
- **scheduling**: pending Workloads of each ClusterQueue, highest priority first, then
  oldest (BestEffortFIFO: one that does not fit does not hold back the others). Each
  pod set's requests (the sum of its containers', or its largest init container's,
  times its count; and the pods themselves when the queue covers ``pods``) get, per
  resource group, the first flavor that matches the pods'
  node selector and required node affinity on the flavor's own label keys, whose
  taints the pods tolerate, and whose nominal quota has room; else the Workload stays
  ``QuotaReserved=False`` with Kueue's message (``couldn't assign flavors to pod set
  ...: insufficient unused quota for ... in flavor ..., N more needed``). With
  ``preemption.withinClusterQueue: LowerPriority`` it evicts lower-priority admitted
  Workloads of the queue (lowest first, the newest first among equals) until it would
  fit: ``Evicted=True`` and ``Preempted=True`` with Kueue's message;
- **moving** a group not admitted yet whose pods now name another queue: its
  Workload's ``queueName`` follows them;
- **running** an admitted group: its gated pods lose the gate and get the assigned
  flavor's node labels (in ``nodeSelector``) and tolerations; a failed pod that a
  replacement stands in for loses its finalizer;
- **stopping** an evicted group: every pod that is neither gated nor finished gets the
  condition ``TerminationTarget`` (reason ``WorkloadEvictedDueTo<reason>``) and is
  deleted; once none runs, the quota is released (``QuotaReserved=False``, reason
  Pending) and the Workload waits again;
- **finishing**: a group whose pods all succeeded, or that has a pod annotated
  ``retriable-in-group: "false"`` and none still running, is ``Finished=True``; its
  pods lose their finalizers and its quota is free. A Workload whose pods are all gone
  is deleted (the garbage collector's part: its owners are the pods).

Not played: cohorts and borrowing, admission checks, fair sharing, topology-aware
scheduling, waitForPodsReady, the LocalQueue and ClusterQueue status counters.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import kmock
import yaml
from kmock._internal.k8s import KubernetesError
from kubernetes import client
from kubernetes.utils import parse_quantity

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
#: Kueue's kinds as its API serves them: plural -> (kind, namespaced, a status subresource).
KINDS = {"workloads": ("Workload", True, True), "localqueues": ("LocalQueue", True, True),
         "clusterqueues": ("ClusterQueue", False, True), "resourceflavors": ("ResourceFlavor", False, False),
         "workloadpriorityclasses": ("WorkloadPriorityClass", False, False),
         "admissionchecks": ("AdmissionCheck", False, True), "cohorts": ("Cohort", False, True),
         "topologies": ("Topology", False, False)}
#: Where Kueue's own CRDs are (``config/components/crd/bases``): ``$ALPAJOB_KUEUE_CRDS``,
#: else the workplace's ``../shared/kueue-crds``. With them, writes are pruned by their
#: schemas; without them (a clone on its own), the kinds are served unpruned.
CRDS_VARIABLE = "ALPAJOB_KUEUE_CRDS"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
FINALIZER = "kueue.x-k8s.io/managed"
GATE = "kueue.x-k8s.io/admission"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
ROLE_ANNOTATION = "kueue.x-k8s.io/role-hash"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
GROUP_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/is-group-workload"
TERMINATION = "TerminationTarget"
#: Owner kinds whose pods Kueue's ``pod`` integration leaves to their own integration.
MANAGED_OWNERS = {("batch/v1", "Job"), ("jobset.x-k8s.io/v1alpha2", "JobSet"), ("ray.io/v1", "RayJob"),
                  ("ray.io/v1", "RayCluster"), ("kubeflow.org/v1", "PyTorchJob"), ("apps/v1", "ReplicaSet")}


def crd_folder() -> Path | None:
    """Kueue's CRDs (:data:`CRDS_VARIABLE`, else ``../shared/kueue-crds``), if present."""
    named = os.environ.get(CRDS_VARIABLE)
    folder = Path(named) if named else Path(__file__).resolve().parents[2] / "shared" / "kueue-crds"
    return folder if folder.is_dir() else None


def _bare_crd(plural: str, kind: str, namespaced: bool, status: bool) -> dict[str, Any]:
    """A CRD of Kueue's kind with no schema of its fields (no pruning): what a clone
    without Kueue's CRDs serves."""
    version: dict[str, Any] = {"schema": {"openAPIV3Schema": {"type": "object",
                                                              "x-kubernetes-preserve-unknown-fields": True}}}
    if status:
        version["subresources"] = {"status": {}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{GROUP}"},
            "spec": {"group": GROUP, "scope": "Namespaced" if namespaced else "Cluster",
                     "names": {"plural": plural, "kind": kind, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{**version, "name": "v1beta1", "served": True, "storage": False},
                                  {**version, "name": VERSION, "served": True, "storage": True}]}}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _condition(obj: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def _true(obj: Mapping[str, Any], kind: str) -> bool:
    condition = _condition(obj, kind)
    return condition is not None and condition.get("status") == "True"


def _set(conditions: list[dict[str, Any]], kind: str, status: bool, reason: str, message: str,
         generation: int = 1) -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set (its transition time kept unless it flipped)."""
    flag = "True" if status else "False"
    before = next((c for c in conditions if c.get("type") == kind), None)
    since = before["lastTransitionTime"] if before is not None and before.get("status") == flag else _now()
    return [*(c for c in conditions if c.get("type") != kind),
            {"type": kind, "status": flag, "reason": reason, "message": message,
             "lastTransitionTime": since, "observedGeneration": generation}]


def _quantity(value: Decimal) -> str:
    """A quantity as Kubernetes prints one: a whole number, else millis."""
    return str(int(value)) if value == value.to_integral_value() else f"{int(value * 1000)}m"


def pod_requests(spec: Mapping[str, Any]) -> dict[str, Decimal]:
    """What one pod asks of the quota: per resource, the sum over its containers
    (a request, else its limit), or its largest init container's, whichever is more."""
    def of(container: Mapping[str, Any]) -> dict[str, Decimal]:
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {k: Decimal(str(parse_quantity(v))) for k, v in asked.items()}

    total: dict[str, Decimal] = defaultdict(Decimal)
    for container in spec.get("containers") or []:
        for key, value in of(container).items():
            total[key] += value
    for container in spec.get("initContainers") or []:
        for key, value in of(container).items():
            total[key] = max(total[key], value)
    return dict(total)


def _role_hash(pod: Mapping[str, Any]) -> str:
    """Kueue's role hash of a pod without one: what admission depends on, hashed."""
    spec = pod.get("spec") or {}
    shape = {k: spec.get(k) for k in ("nodeSelector", "affinity", "tolerations", "runtimeClassName", "priority",
                                      "topologySpreadConstraints", "overhead")}
    shape["containers"] = [c.get("resources") for c in spec.get("containers") or []]
    shape["initContainers"] = [c.get("resources") for c in spec.get("initContainers") or []]
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]


def _matches(spec: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Do a pod's node selector and required node affinity allow a node with the
    flavor's ``labels``? Only the flavor's own label keys are judged, as Kueue does."""
    for key, value in (spec.get("nodeSelector") or {}).items():
        if key in labels and labels[key] != value:
            return False
    terms = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
              .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
    if not terms:
        return True

    def holds(expression: Mapping[str, Any]) -> bool:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        if key not in labels:
            return True
        return {"In": labels[key] in values, "NotIn": labels[key] not in values, "Exists": True,
                "DoesNotExist": False}.get(operator, True)

    return any(all(holds(e) for e in term.get("matchExpressions") or []) for term in terms)


def _tolerated(spec: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    for toleration in spec.get("tolerations") or []:
        if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration.get("key") == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value") == taint.get("value"):
            return True
    return False


class Kueue:
    """Kueue's ``pod`` integration on the test API server (module docstring), for the
    namespaces in :attr:`managed` (its ``managedJobsNamespaceSelector``)."""

    def __init__(self, emulator: Any, interval: float = 0.25) -> None:
        self.emu = emulator
        self.api = emulator.api()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.interval = interval
        self.managed: set[str] = set()
        self.errors: list[str] = []  # what a sync raised (a test asserts there is none)
        self.said: list[tuple[str, str]] = []  # (workload, what Kueue did): its events, in order
        self._admitted_at: dict[str, float] = {}  # workload uid -> when it was admitted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kueue", daemon=True)

    # ------------------------------------------------------------ installing
    def install(self) -> Kueue:
        """Serve Kueue's kinds (v1beta2, v1beta1 served beside it: their CRDs, which the
        operator reads to find Kueue), pruned by Kueue's own schemas when they are at
        hand (:func:`crd_folder`), and register its pod webhook."""
        extensions = client.ApiextensionsV1Api(self.api)
        folder = crd_folder()
        for plural, (kind, namespaced, status) in KINDS.items():
            self.emu.kmock.resources[f"{GROUP}/{VERSION}/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, subresources={"status"} if status else set(),
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
            path = folder / f"{GROUP}_{plural}.yaml" if folder is not None else None
            if path is not None and path.exists():
                crd = yaml.safe_load(path.read_text())
                [version] = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
                self.emu.schemas[GROUP, plural] = version["schema"]["openAPIV3Schema"]
            else:
                crd = _bare_crd(plural, kind, namespaced, status)
            with contextlib.suppress(client.ApiException):
                extensions.create_custom_resource_definition(crd)
        self.emu.pod_mutators.append(self.webhook)
        return self

    def manage(self, namespace: str) -> None:
        """Manage the pods of ``namespace`` (it matches managedJobsNamespaceSelector)."""
        self.managed.add(namespace)

    def start(self) -> Kueue:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with contextlib.suppress(ValueError):
            self.emu.pod_mutators.remove(self.webhook)

    # ------------------------------------------------------------ the webhook
    def _stored(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """An object as the API server holds it (read in the server's own loop: no request)."""
        from kube_emulator import _plain

        key = (kmock.resource(GROUP, VERSION, plural), namespace, name)
        objects = self.emu.kmock.objects
        if key not in objects or objects[key].deleted:
            return None
        return _plain(objects[key])

    def webhook(self, pod: dict[str, Any], namespace: str) -> KubernetesError | None:
        """Kueue's mutating and validating webhook for a pod created (module docstring)."""
        if namespace not in self.managed:
            return None
        meta = pod.setdefault("metadata", {})
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if owner is not None and (owner.get("apiVersion"), owner.get("kind")) in MANAGED_OWNERS:
            return None
        labels = meta.setdefault("labels", {})
        if not labels.get(QUEUE_LABEL) and self._stored("localqueues", namespace, "default") is not None:
            labels[QUEUE_LABEL] = "default"  # LocalQueueDefaulting
        if not labels.get(QUEUE_LABEL):
            return None
        annotations = meta.setdefault("annotations", {})
        if (GROUP_LABEL in labels) != (COUNT_ANNOTATION in annotations):
            missing = f"metadata.annotations[{COUNT_ANNOTATION}]" if GROUP_LABEL in labels \
                else f"metadata.labels[{GROUP_LABEL}]"
            return KubernetesError(status=400, reason="BadRequest", message=(
                f'admission webhook "vpod.kb.io" denied the request: {missing}: Required value: both the '
                f"'{COUNT_ANNOTATION}' annotation and the '{GROUP_LABEL}' label should be set"))
        if GROUP_LABEL in labels and not str(annotations[COUNT_ANNOTATION]).isdigit():
            return KubernetesError(status=400, reason="BadRequest", message=(
                f'admission webhook "vpod.kb.io" denied the request: metadata.annotations[{COUNT_ANNOTATION}]: '
                f'Invalid value: "{annotations[COUNT_ANNOTATION]}"'))
        meta["finalizers"] = [*(meta.get("finalizers") or []), FINALIZER]
        labels[MANAGED_LABEL] = "true"
        spec = pod.setdefault("spec", {})
        spec["schedulingGates"] = [*(spec.get("schedulingGates") or []), {"name": GATE}]
        if GROUP_LABEL in labels and ROLE_ANNOTATION not in annotations:
            annotations[ROLE_ANNOTATION] = _role_hash(pod)
        return None

    # ------------------------------------------------------------ the controller
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as error:  # noqa: BLE001 - a test's Kueue keeps going, and tells
                self.errors.append(f"{type(error).__name__}: {error}")
            self._stop.wait(self.interval)

    def _list(self, plural: str) -> list[dict[str, Any]]:
        return list(self.custom.list_cluster_custom_object(GROUP, VERSION, plural)["items"])

    def sync(self) -> None:
        """One pass of Kueue's controllers over everything (module docstring)."""
        pods: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for namespace in sorted(self.managed):
            for item in self.core.list_namespaced_pod(namespace).items:
                pod = self.api.sanitize_for_serialization(item)
                labels = pod["metadata"].get("labels") or {}
                if labels.get(MANAGED_LABEL) == "true" and labels.get(GROUP_LABEL):
                    pods[namespace, labels[GROUP_LABEL]].append(pod)
        workloads = {(w["metadata"]["namespace"], w["metadata"]["name"]): w for w in self._list("workloads")}
        for key, members in pods.items():
            workload = workloads.get(key)
            if workload is None:
                made = self._make_workload(key, members)
                if made is not None:
                    workloads[key] = made
            else:
                self._reconcile(workload, members)
        for key in list(workloads):
            if key not in pods:  # every owner gone: the garbage collector deletes it
                with contextlib.suppress(client.ApiException):
                    self.custom.delete_namespaced_custom_object(GROUP, VERSION, key[0], "workloads", key[1])
                del workloads[key]
        self._schedule([w for w in self._list("workloads")])

    def _priority(self, pod: Mapping[str, Any]) -> tuple[int, dict[str, str] | None]:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(PRIORITY_LABEL):
            name = labels[PRIORITY_LABEL]
            with contextlib.suppress(client.ApiException):
                wpc = self.custom.get_cluster_custom_object(GROUP, VERSION, "workloadpriorityclasses", name)
                return int(wpc.get("value") or 0), {"group": GROUP, "kind": "WorkloadPriorityClass", "name": name}
        spec = pod.get("spec") or {}
        if spec.get("priorityClassName"):
            return int(spec.get("priority") or 0), {"group": "scheduling.k8s.io", "kind": "PriorityClass",
                                                    "name": spec["priorityClassName"]}
        return int(spec.get("priority") or 0), None

    def _make_workload(self, key: tuple[str, str], members: list[dict[str, Any]]) -> dict[str, Any] | None:
        runnable = [p for p in members if _runnable(p)]
        total = int((members[0]["metadata"].get("annotations") or {}).get(COUNT_ANNOTATION) or 0)
        if len(runnable) < total:
            return None  # Kueue waits for the whole group
        roles: dict[str, dict[str, Any]] = {}
        for pod in sorted(runnable, key=lambda p: p["metadata"]["name"]):
            role = pod["metadata"]["annotations"][ROLE_ANNOTATION]
            if role in roles:
                roles[role]["count"] += 1
            else:
                template = {"spec": copy.deepcopy(pod["spec"])}
                template["spec"].pop("schedulingGates", None)
                roles[role] = {"name": role, "count": 1, "template": template}
        priority, ref = self._priority(runnable[0])
        spec: dict[str, Any] = {"queueName": runnable[0]["metadata"]["labels"][QUEUE_LABEL],
                                "podSets": [roles[r] for r in sorted(roles)], "priority": priority}
        if ref is not None:
            spec["priorityClassRef"] = ref
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload",
                "metadata": {"name": key[1], "namespace": key[0], "annotations": {GROUP_WORKLOAD_ANNOTATION: "true"},
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": p["metadata"]["name"],
                                                  "uid": p["metadata"]["uid"]} for p in members]},
                "spec": spec}
        try:
            made = self.custom.create_namespaced_custom_object(GROUP, VERSION, key[0], "workloads", body)
        except client.ApiException as error:
            if error.status == 409:
                return None
            raise
        self.said.append((key[1], "Created"))
        return made

    def _status(self, workload: Mapping[str, Any], status: dict[str, Any]) -> None:
        meta = workload["metadata"]
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, meta["namespace"], "workloads",
                                                          meta["name"], {"status": status})

    def _release_pods(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            finalizers = pod["metadata"].get("finalizers") or []
            if FINALIZER in finalizers:
                with contextlib.suppress(client.ApiException):
                    self.core.patch_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"], {
                        "metadata": {"finalizers": [f for f in finalizers if f != FINALIZER]}})

    def _reconcile(self, workload: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        """A group with its Workload: finish, stop, or run it (module docstring)."""
        name = workload["metadata"]["name"]
        conditions = list((workload.get("status") or {}).get("conditions") or [])
        if _true(workload, "Finished"):
            self._release_pods(pods)
            return
        total = int((pods[0]["metadata"].get("annotations") or {}).get(COUNT_ANNOTATION) or 0)
        succeeded = sum(1 for p in pods if _phase(p) == "Succeeded")
        active = any(_phase(p) not in ("Succeeded", "Failed") for p in pods)
        unretriable = any((p["metadata"].get("annotations") or {}).get(RETRIABLE_ANNOTATION) == "false" for p in pods)
        if succeeded == total or (unretriable and not active):
            message = f"Pods succeeded: {succeeded}/{total}."
            self._status(workload, {"conditions": _set(conditions, "Finished", True, "Succeeded", message)})
            self.said.append((name, "Finished"))
            self._release_pods(pods)
            return
        evicted = _condition(workload, "Evicted")
        if evicted is not None and evicted.get("status") == "True":
            for pod in pods:
                meta = pod["metadata"]
                if meta.get("deletionTimestamp") or _gated(pod) or _phase(pod) in ("Succeeded", "Failed"):
                    continue
                stop = {"type": TERMINATION, "status": "True", "reason": f"WorkloadEvictedDueTo{evicted['reason']}",
                        "message": evicted.get("message", ""), "lastTransitionTime": _now()}
                with contextlib.suppress(client.ApiException):
                    self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": {
                        "conditions": [*((pod.get("status") or {}).get("conditions") or []), stop]}})
                    self.core.delete_namespaced_pod(meta["name"], meta["namespace"])
                    self.said.append((name, f"Stopped {meta['name']}"))
            if _true(workload, "QuotaReserved") and not any(_phase(p) == "Running" for p in pods):
                message = str(evicted.get("message", ""))
                conditions = _set(conditions, "QuotaReserved", False, "Pending", message)
                conditions = _set(conditions, "Admitted", False, "NoReservation", "The workload has no reservation")
                conditions = _set(conditions, "Requeued", evicted.get("reason") == "Preempted",
                                  str(evicted.get("reason")), message)
                self._status(workload, {"conditions": conditions, "admission": None})
                self.said.append((name, "QuotaReleased"))
            return
        if not _true(workload, "Admitted"):
            queue = (pods[0]["metadata"].get("labels") or {}).get(QUEUE_LABEL)
            if queue and queue != workload["spec"].get("queueName") and not _true(workload, "QuotaReserved"):
                meta = workload["metadata"]  # the pods moved to another queue: so does their Workload
                self.custom.patch_namespaced_custom_object(GROUP, VERSION, meta["namespace"], "workloads",
                                                           meta["name"], {"spec": {"queueName": queue}})
                workload["spec"]["queueName"] = queue
                self.said.append((name, f"Moved to {queue}"))
            return
        assignments = {a["name"]: a for a in workload["status"]["admission"]["podSetAssignments"]}
        for pod in pods:
            if not _gated(pod):
                continue
            meta = pod["metadata"]
            flavors = set((assignments.get(meta["annotations"][ROLE_ANNOTATION]) or {}).get("flavors", {}).values())
            selector, tolerations = dict(pod["spec"].get("nodeSelector") or {}), list(pod["spec"].get("tolerations") or [])
            for flavor in sorted(flavors):
                with contextlib.suppress(client.ApiException):
                    spec = self.custom.get_cluster_custom_object(GROUP, VERSION, "resourceflavors", flavor)["spec"]
                    selector.update(spec.get("nodeLabels") or {})
                    tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
            gates = [g for g in pod["spec"].get("schedulingGates") or [] if g.get("name") != GATE]
            with contextlib.suppress(client.ApiException):
                self.core.patch_namespaced_pod(meta["name"], meta["namespace"], {"spec": {
                    "schedulingGates": gates or None, "nodeSelector": selector or None,
                    "tolerations": tolerations or None}})
                self.said.append((name, f"Started {meta['name']}"))
        # Failed pods a replacement stands in for lose their finalizer.
        by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for pod in pods:
            by_role[pod["metadata"]["annotations"][ROLE_ANNOTATION]].append(pod)
        for pod_set in workload["spec"]["podSets"]:
            members = by_role.get(pod_set["name"], [])
            live = [p for p in members if _runnable(p)]
            failed = [p for p in members if not _runnable(p)]
            spare = len(failed) + len(live) - int(pod_set["count"])
            if spare > 0:
                self._release_pods(failed[:spare])

    # ------------------------------------------------------------ scheduling
    def _usage(self, workloads: list[dict[str, Any]], cq: str,
               without: frozenset[str] = frozenset()) -> dict[tuple[str, str], Decimal]:
        used: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
        for workload in workloads:
            admission = (workload.get("status") or {}).get("admission") or {}
            if admission.get("clusterQueue") != cq or _true(workload, "Finished") \
                    or workload["metadata"]["uid"] in without:
                continue
            for assignment in admission.get("podSetAssignments") or []:
                for resource, flavor in (assignment.get("flavors") or {}).items():
                    used[flavor, resource] += Decimal(str(parse_quantity((assignment.get("resourceUsage") or {})
                                                                         .get(resource, "0"))))
        return used

    def _assign(self, workload: Mapping[str, Any], queue: Mapping[str, Any],
                used: Mapping[tuple[str, str], Decimal]) -> tuple[list[dict[str, Any]] | None, str]:
        """The flavor of each pod set's resources, or None and Kueue's message."""
        extra: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
        out = []
        for pod_set in workload["spec"]["podSets"]:
            spec = pod_set["template"].get("spec") or {}
            asked = {k: v * int(pod_set["count"]) for k, v in pod_requests(spec).items() if v > 0}
            if any("pods" in g.get("coveredResources", []) for g in queue["spec"].get("resourceGroups") or []):
                asked["pods"] = Decimal(int(pod_set["count"]))  # a queue that covers "pods" counts them
            flavors: dict[str, str] = {}
            for group in queue["spec"].get("resourceGroups") or []:
                wanted = [r for r in sorted(asked) if r in group.get("coveredResources", [])]
                if not wanted:
                    continue
                reasons, chosen = [], None
                for entry in group.get("flavors") or []:
                    flavor = self._flavor(entry["name"])
                    if flavor is None:
                        reasons.append(f"flavor {entry['name']} not found")
                        continue
                    if not _matches(spec, flavor.get("nodeLabels") or {}):
                        reasons.append(f"flavor {entry['name']} doesn't match node affinity")
                        continue
                    untolerated = [t for t in flavor.get("nodeTaints") or [] if not _tolerated(spec, t)]
                    if untolerated:
                        taint = untolerated[0]
                        reasons.append(f"untolerated taint {taint.get('key')}={taint.get('value', '')}:"
                                       f"{taint.get('effect')} in flavor {entry['name']}")
                        continue
                    quota = {r["name"]: Decimal(str(parse_quantity(r["nominalQuota"]))) for r in entry["resources"]}
                    short = None
                    for resource in wanted:
                        nominal = quota.get(resource, Decimal(0))
                        if asked[resource] > nominal:
                            short = (f"insufficient quota for {resource} in flavor {entry['name']}, request > "
                                     f"maximum capacity ({_quantity(asked[resource])} > {_quantity(nominal)})")
                            break
                        have = used.get((entry["name"], resource), Decimal(0)) + extra[entry["name"], resource]
                        if have + asked[resource] > nominal:
                            short = (f"insufficient unused quota for {resource} in flavor {entry['name']}, "
                                     f"{_quantity(have + asked[resource] - nominal)} more needed")
                            break
                    if short is not None:
                        reasons.append(short)
                        continue
                    chosen = entry["name"]
                    break
                if chosen is None:
                    return None, f"couldn't assign flavors to pod set {pod_set['name']}: {', '.join(reasons)}"
                for resource in wanted:
                    flavors[resource] = chosen
                    extra[chosen, resource] += asked[resource]
            uncovered = [r for r in sorted(asked) if r not in flavors]
            if uncovered:
                return None, (f"couldn't assign flavors to pod set {pod_set['name']}: resource {uncovered[0]} "
                              "unavailable in ClusterQueue")
            out.append({"name": pod_set["name"], "count": pod_set["count"], "flavors": flavors,
                        "resourceUsage": {r: _quantity(asked[r]) for r in sorted(flavors)}})
        return out, ""

    def _flavor(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.custom.get_cluster_custom_object(GROUP, VERSION, "resourceflavors", name).get("spec") or {})
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def _pending(self, workload: dict[str, Any], reason: str, message: str) -> None:
        reserved = _condition(workload, "QuotaReserved") or {}
        if (reserved.get("status"), reserved.get("reason"), reserved.get("message")) == ("False", reason, message):
            return
        conditions = _set(list((workload.get("status") or {}).get("conditions") or []), "QuotaReserved", False,
                          reason, message)
        self._status(workload, {"conditions": conditions})

    def _schedule(self, workloads: list[dict[str, Any]]) -> None:
        """Admit what fits, queue by queue; preempt where the queue says so."""
        queues = {q["metadata"]["name"]: q for q in self._list("clusterqueues")}
        pending = [w for w in workloads if not _true(w, "QuotaReserved") and not _true(w, "Finished")]
        pending.sort(key=lambda w: (-int(w["spec"].get("priority") or 0), w["metadata"].get("creationTimestamp", "")))
        for workload in pending:
            namespace, queue_name = workload["metadata"]["namespace"], workload["spec"].get("queueName")
            try:
                local = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "localqueues", queue_name)
            except client.ApiException as error:
                if error.status != 404:
                    raise
                self._pending(workload, "Inadmissible", f"LocalQueue {queue_name} doesn't exist")
                continue
            cq = local["spec"].get("clusterQueue")
            queue = queues.get(cq)
            if queue is None:
                self._pending(workload, "Inadmissible", f"ClusterQueue {cq} doesn't exist")
                continue
            assignment, message = self._assign(workload, queue, self._usage(workloads, cq))
            if assignment is not None:
                self._admit(workload, cq, assignment)
                workload.setdefault("status", {})["admission"] = {"clusterQueue": cq, "podSetAssignments": assignment}
                workload["status"]["conditions"] = _set(workload["status"].get("conditions") or [],
                                                        "QuotaReserved", True, "QuotaReserved", "")
                continue
            self._pending(workload, "Pending", message)
            self._preempt(workload, queue, cq, workloads)

    def _admit(self, workload: dict[str, Any], cq: str, assignment: list[dict[str, Any]]) -> None:
        conditions = list((workload.get("status") or {}).get("conditions") or [])
        conditions = _set(conditions, "QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue {cq}")
        conditions = _set(conditions, "Admitted", True, "Admitted", "The workload is admitted")
        evicted = next((c for c in conditions if c.get("type") == "Evicted"), None)
        if evicted is not None and evicted.get("status") == "True":
            conditions = _set(conditions, "Evicted", False, "QuotaReserved", f"Previously: {evicted.get('message')}")
        self._status(workload, {"conditions": conditions,
                                "admission": {"clusterQueue": cq, "podSetAssignments": assignment}})
        self._admitted_at[workload["metadata"]["uid"]] = time.monotonic()
        self.said.append((workload["metadata"]["name"], f"Admitted by {cq}"))

    def _preempt(self, workload: dict[str, Any], queue: Mapping[str, Any], cq: str,
                 workloads: list[dict[str, Any]]) -> None:
        """Evict lower-priority admitted Workloads of ``cq`` until ``workload`` would fit
        (nothing while earlier evictions are still releasing their quota)."""
        policy = (queue["spec"].get("preemption") or {}).get("withinClusterQueue", "Never")
        if policy not in ("LowerPriority", "LowerOrNewerEqualPriority"):
            return
        priority = int(workload["spec"].get("priority") or 0)
        admitted = [w for w in workloads if ((w.get("status") or {}).get("admission") or {}).get("clusterQueue") == cq
                    and _true(w, "QuotaReserved") and not _true(w, "Finished")]
        leaving = frozenset(w["metadata"]["uid"] for w in admitted if _true(w, "Evicted"))
        if leaving and self._assign(workload, queue, self._usage(workloads, cq, leaving))[0] is not None:
            return  # what is being evicted already makes room
        candidates = [w for w in admitted if not _true(w, "Evicted") and int(w["spec"].get("priority") or 0) < priority]
        candidates.sort(key=lambda w: (int(w["spec"].get("priority") or 0),
                                       -self._admitted_at.get(w["metadata"]["uid"], 0.0)))
        chosen: list[dict[str, Any]] = []
        for candidate in candidates:
            chosen.append(candidate)
            gone = leaving | {w["metadata"]["uid"] for w in chosen}
            if self._assign(workload, queue, self._usage(workloads, cq, frozenset(gone)))[0] is not None:
                break
        else:
            return
        message = (f"Preempted to accommodate a workload (UID: {workload['metadata']['uid']}, JobUID: UNKNOWN) "
                   "due to prioritization in the ClusterQueue")
        for victim in chosen:
            conditions = list((victim.get("status") or {}).get("conditions") or [])
            conditions = _set(conditions, "Evicted", True, "Preempted", message)
            conditions = _set(conditions, "Preempted", True, "InClusterQueue", message)
            self._status(victim, {"conditions": conditions})
            self.said.append((victim["metadata"]["name"], f"Preempted for {workload['metadata']['name']}"))


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def _runnable(pod: Mapping[str, Any]) -> bool:
    """Kueue's ``isPodRunnableOrSucceeded``: not Failed, and not deleted before a node
    took it (here, with no scheduler, before a kubelet started it)."""
    placed = (pod.get("spec") or {}).get("nodeName") or (pod.get("status") or {}).get("hostIP") \
        or _phase(pod) != "Pending"
    if pod["metadata"].get("deletionTimestamp") and not placed:
        return False
    return _phase(pod) != "Failed"
