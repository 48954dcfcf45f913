"""The operator's side of the Kubernetes API: read a job, apply a decision.

A thin adapter over the ``kubernetes`` client, so :mod:`.reconcile` stays pure. A
pass reads the job itself fresh (its status is what the last pass wrote); its
children and the nodes come from the watches' snapshot (:class:`~.world.World`), so
a pass lists nothing. Creating what already exists and deleting what is gone are
not errors: a snapshot may lag a creation by a moment, and every pass may repeat
the last one's work.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import yaml
from kubernetes import client
from pydantic import ValidationError

from alpajob.api.names import (
    API_VERSION,
    GROUP,
    KIND,
    KUEUE_WORKLOAD_CRD,
    LABEL_JOB,
    PLAN_KEY,
    PLURAL,
    VERSION,
)
from alpajob.api.pod_template import PodTemplates
from alpajob.api.status import ConditionType, Status
from alpajob.operator.names import ChildNames
from alpajob.operator.network import NetworkSettings
from alpajob.operator.pool import EVERY_TAINT, pool_products, read_pool
from alpajob.operator.queueing import END_GROUP, in_open_group, queue_of
from alpajob.operator.reconcile import Decision, Observed
from alpajob.operator.status import set_condition
from alpajob.operator.world import World

#: Kueue's API group, and the Workload versions the operator reads, the newest first.
KUEUE_GROUP, KUEUE_VERSIONS = "kueue.x-k8s.io", ("v1beta2", "v1beta1")

#: CRDs whose presence means a gang scheduler is installed.
GANG_CRDS = {"volcano": "podgroups.scheduling.volcano.sh", "coscheduling": "podgroups.scheduling.x-k8s.io"}
_POD_GROUP_API = {"volcano": ("scheduling.volcano.sh", "v1beta1"), "coscheduling": ("scheduling.x-k8s.io", "v1alpha1")}


def client_from_environment() -> client.ApiClient:
    """An API client for the pod's service account in a cluster, else ``$KUBECONFIG``."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@dataclass(frozen=True)
class Refusal:
    """The API server's refusal to create a child: its kind, name, reason, message."""

    kind: str
    name: str
    code: int
    reason: str
    message: str

    @staticmethod
    def of(obj: Mapping[str, Any], error: client.ApiException) -> Refusal:
        try:
            body = json.loads(error.body or "{}")
        except ValueError:
            body = {}
        return Refusal(kind=str(obj["kind"]), name=str(obj["metadata"]["name"]), code=int(error.status or 0),
                       reason=str(body.get("reason") or error.reason or "Refused"),
                       message=str(body.get("message") or error.reason or "")[:2000])


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: what changed,
    and ``None`` for every key ``new`` no longer has."""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return new
    patch = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


class Cached:
    """Values by key, each recomputed when older than ``ttl`` seconds (thread-safe)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._values: dict[object, tuple[float, object]] = {}
        self._lock = threading.Lock()

    def get(self, key: object, compute: Callable[[], object]) -> object:
        with self._lock:
            hit = self._values.get(key)
            if hit is not None and time.monotonic() - hit[0] < self.ttl:
                return hit[1]
            value = compute()
            self._values[key] = (time.monotonic(), value)
            return value


class Kube:
    """Reads and writes for the operator, on one ``ApiClient``."""

    def __init__(self, api: client.ApiClient, default_image: str | None = None,
                 network: NetworkSettings | None = None) -> None:
        self.api = api
        self.default_image = default_image
        self.network = network or NetworkSettings()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.extensions = client.ApiextensionsV1Api(api)
        self.gangs = Cached(60.0)  # installed gang schedulers (and Kueue) change rarely

    def _dict(self, obj: Any) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(obj)

    def _get(self, read: Any, *args: Any) -> dict[str, Any] | None:
        try:
            return self._dict(read(*args))
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    # ------------------------------------------------------------ reading
    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def vanished(self, namespace: str, job: str, world: World) -> set[str]:
        """The uids of ``world``'s children that the API server no longer has: each
        kind is listed by the job's label, and a child missing from its list is asked
        for by name (404, or another uid under its name: it is gone; there, it was made
        after the list). Run after a gap in the watches, when kopf's indexes may still
        hold objects deleted meanwhile."""
        core = self.core
        listing = ((world.pods, core.list_namespaced_pod, core.read_namespaced_pod),
                   (world.configmaps, core.list_namespaced_config_map, core.read_namespaced_config_map),
                   (world.services, core.list_namespaced_service, core.read_namespaced_service),
                   (world.claims, core.list_namespaced_persistent_volume_claim,
                    core.read_namespaced_persistent_volume_claim))
        gone: set[str] = set()
        for seen, list_them, read in listing:
            if not seen:
                continue
            there = {item.metadata.uid for item in list_them(namespace, label_selector=f"{LABEL_JOB}={job}").items}
            for obj in seen:
                meta = obj.get("metadata") or {}
                if meta.get("uid") in there:
                    continue
                now = self._get(read, meta.get("name"), namespace)
                if now is None or (now.get("metadata") or {}).get("uid") != meta.get("uid"):
                    gone.add(str(meta.get("uid")))
        return gone

    def may_create_pods(self, user: Mapping[str, Any], namespace: str) -> bool:
        """Whether ``user`` (an admission request's ``userInfo``) may create pods in
        ``namespace``: the API server's own answer (a SubjectAccessReview)."""
        review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=user.get("username"), uid=user.get("uid"), groups=list(user.get("groups") or []),
            extra={k: list(v) for k, v in (user.get("extra") or {}).items()},
            resource_attributes=client.V1ResourceAttributes(namespace=namespace, verb="create", resource="pods")))
        answer = client.AuthorizationV1Api(self.api).create_subject_access_review(review, _request_timeout=5.0)
        return bool(answer.status and answer.status.allowed)

    def gang(self, job: Mapping[str, Any]) -> str | None:
        wanted = ((job.get("spec") or {}).get("scheduling") or {}).get("gang", "auto")
        if wanted == "none":
            return None
        if wanted in GANG_CRDS:
            return str(wanted)

        def installed() -> str | None:
            for name, crd in GANG_CRDS.items():
                if self._get(self.extensions.read_custom_resource_definition, crd) is not None:
                    return name
            return None

        return self.gangs.get("gang", installed)  # type: ignore[return-value]

    def kueue(self) -> str | None:
        """The Workload version Kueue serves (newest first), None without Kueue."""

        def served() -> str | None:
            crd = self._get(self.extensions.read_custom_resource_definition, KUEUE_WORKLOAD_CRD)
            if crd is None:
                return None
            versions = {v.get("name") for v in crd["spec"].get("versions") or [] if v.get("served")}
            return next((v for v in KUEUE_VERSIONS if v in versions), None)

        return self.gangs.get("kueue", served)  # type: ignore[return-value]

    def workload(self, namespace: str, name: str, version: str) -> dict[str, Any] | None:
        """Kueue's Workload ``namespace/name``, None while there is none."""
        try:
            return self.custom.get_namespaced_custom_object(KUEUE_GROUP, version, namespace, "workloads", name)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def release_groups(self, namespace: str, world: World) -> int:
        """Annotate ``retriable-in-group: "false"`` on every Kueue-grouped pod of
        ``world`` that lacks it (a job being deleted: its pods go, and Kueue must end
        their groups to free the quota and release them); how many it annotated."""
        open_pods = [pod for pod in world.pods if in_open_group(pod)]
        for pod in open_pods:
            self.patch_pod(namespace, str(pod["metadata"]["name"]), END_GROUP)
        return len(open_pods)

    def patch_pod(self, namespace: str, pod: str, metadata: Mapping[str, Mapping[str, str]]) -> None:
        """Merge ``metadata`` (labels, annotations) into pod ``namespace/pod`` (gone
        already: nothing to do)."""
        try:
            self.core.patch_namespaced_pod(pod, namespace, {"metadata": {k: dict(v) for k, v in metadata.items()}})
        except client.ApiException as error:
            if error.status != 404:
                raise

    def observe(self, job: Mapping[str, Any], now: datetime, world: World) -> Observed:
        """Everything :func:`~.reconcile.reconcile` needs about ``job``, its children and
        the nodes from ``world``."""
        meta = job["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        attempt = Status.model_validate(job.get("status") or {}).children.attempt
        names = ChildNames(name, attempt)
        pods = {pod["metadata"]["name"]: pod for pod in world.pods}
        configmaps = {cm["metadata"]["name"]: cm for cm in world.configmaps}
        services = frozenset(s["metadata"]["name"] for s in world.services)
        claims = frozenset(c["metadata"]["name"] for c in world.claims)
        gang = self.gang(job)
        groups: frozenset[str] = frozenset()
        if gang:
            group, version = _POD_GROUP_API[gang]
            try:
                self.custom.get_namespaced_custom_object(group, version, namespace, "podgroups", names.pod_group)
                groups = frozenset({names.pod_group})
            except client.ApiException as error:
                if error.status != 404:
                    raise
        kueue = self.kueue()
        queue = queue_of(job, kueue is not None, gang)
        workload = self.workload(namespace, names.pod_group, kueue) if queue is not None and kueue else None
        nodes = world.nodes
        spec = job.get("spec") or {}
        cluster = spec.get("cluster") or {}
        try:
            tolerations = PodTemplates.model_validate(spec.get("podTemplate") or {}).of("mesh").tolerations
        except ValidationError:
            tolerations = []  # the pass fails the job naming the field (decision.PassState)
        pool = read_pool(nodes, cluster.get("nodeSelector") or {}, tolerations,
                         cpu=cluster.get("gpu") == "cpu", products=pool_products(cluster))
        ready = frozenset(n.name for n in read_pool(nodes, {}, [EVERY_TAINT], cpu=True).nodes)
        manifest = {"apiVersion": API_VERSION, "kind": KIND,
                    "metadata": {"name": name, "namespace": namespace}, "spec": spec}
        return Observed(job=job, now=now, manifest_yaml=yaml.safe_dump(manifest, sort_keys=False),
                        pool=pool.nodes, left_out=pool.left_out, configmaps=configmaps, pods=pods, services=services, claims=claims,
                        pod_groups=groups, gang=gang, queue=queue, kueue=kueue is not None, workload=workload,
                        ready_nodes=ready,
                        network=self.network,
                        **({"default_image": self.default_image} if self.default_image else {}))

    # ------------------------------------------------------------ writing
    def apply(self, job: Mapping[str, Any], decision: Decision) -> list[Refusal]:
        """Status first (children's names are in it), then creations, deletions, events.
        Children the API server refuses to create are returned (and shown: :meth:`refused`)."""
        meta = job["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        stored = job.get("status") or {}
        status = decision.status.to_dict()
        if status != Status.model_validate(stored).to_dict():  # as the API server keeps it
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": merge_patch(stored, status)})
        if decision.clear_plan:  # a merge patch's null removes the key
            self.core.patch_namespaced_config_map(
                ChildNames(name, 0).plan, namespace, {"data": {PLAN_KEY: None}})
        refusals = [refusal for obj in decision.create if (refusal := self.create(obj)) is not None]
        self.refused(job, decision.status, status, refusals, bool(decision.create))
        for kind, child, grace in decision.delete:
            self.delete(kind, namespace, child, grace)
        for pod, metadata in decision.pod_metadata:
            self.patch_pod(namespace, pod, metadata)
        for kind, reason, message in decision.events:
            self.event(job, kind, reason, message)
        if decision.delete_job:
            try:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            except client.ApiException as error:
                if error.status != 404:
                    raise
        return refusals

    def refused(self, job: Mapping[str, Any], status: Status, written: dict[str, Any],
                refusals: list[Refusal], created: bool) -> None:
        """Show a refused creation as the condition ``ChildrenCreated=False`` (the API's
        reason and message) and a ``FailedCreate`` Warning event, as Kubernetes' own
        Job and ReplicaSet controllers do; once creations succeed again the condition
        turns True. The status is written only when the condition changed."""
        before = next((c for c in status.conditions if c.type is ConditionType.CHILDREN_CREATED), None)
        if not refusals and (before is None or before.status == "True" or not created):
            return
        meta = job["metadata"]
        generation = int(meta.get("generation") or 1)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if refusals:
            first = refusals[0]
            message = "; ".join(f"{r.kind} {r.name}: {r.message}" for r in refusals)
            set_condition(status, ConditionType.CHILDREN_CREATED, False, first.reason, message, generation, now)
            self.event(job, "Warning", "FailedCreate", message)
        else:
            set_condition(status, ConditionType.CHILDREN_CREATED, True, "Created", "", generation, now)
        new = status.to_dict()
        if new != written:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {"status": merge_patch(written, new)})

    def create(self, obj: Mapping[str, Any]) -> Refusal | None:
        """Create ``obj``; None when it exists afterwards, else the API server's refusal
        (4xx: forbidden, invalid, over quota). Other errors raise (the pass is retried)."""
        namespace = obj["metadata"]["namespace"]
        kind = obj["kind"]
        try:
            if kind == "Pod":
                self.core.create_namespaced_pod(namespace, obj)
            elif kind == "ConfigMap":
                self.core.create_namespaced_config_map(namespace, obj)
            elif kind == "Service":
                self.core.create_namespaced_service(namespace, obj)
            elif kind == "PersistentVolumeClaim":
                self.core.create_namespaced_persistent_volume_claim(namespace, obj)
            elif kind == "Secret":
                self.core.create_namespaced_secret(namespace, obj)
            elif kind == "ServiceAccount":
                self.core.create_namespaced_service_account(namespace, obj)
            elif kind == "Role":
                client.RbacAuthorizationV1Api(self.api).create_namespaced_role(namespace, obj)
            elif kind == "RoleBinding":
                client.RbacAuthorizationV1Api(self.api).create_namespaced_role_binding(namespace, obj)
            elif kind == "NetworkPolicy":
                client.NetworkingV1Api(self.api).create_namespaced_network_policy(namespace, obj)
            elif kind == "PodGroup":
                group, version = obj["apiVersion"].split("/")
                self.custom.create_namespaced_custom_object(group, version, namespace, "podgroups", obj)
            else:
                raise ValueError(f"cannot create a {kind}")
        except client.ApiException as error:
            if error.status == 409:  # already there: an earlier pass made it
                return None
            if error.status is not None and 400 <= error.status < 500:
                return Refusal.of(obj, error)
            raise
        return None

    def delete(self, kind: str, namespace: str, name: str, grace: int | None) -> None:
        options = client.V1DeleteOptions(grace_period_seconds=grace) if grace is not None else None
        try:
            if kind == "Pod":
                self.core.delete_namespaced_pod(name, namespace, body=options)
            elif kind == "Secret":
                self.core.delete_namespaced_secret(name, namespace, body=options)
            else:
                raise ValueError(f"cannot delete a {kind}")
        except client.ApiException as error:
            if error.status != 404:
                raise

    def event(self, job: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": kind, "reason": reason, "message": message[:1024],
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "source": {"component": "alpajob-operator"}, "reportingComponent": "alpajob-operator",
        }
        self.core.create_namespaced_event(meta["namespace"], body)
