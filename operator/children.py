"""Builders of an AlpaJob's child objects: plain dicts, as ``kubectl`` would send them.

Nothing here talks to the API; :mod:`.reconcile` decides which children to create
and the handlers send them. Every child carries the job's owner reference (deleting
the job deletes them), a name from :mod:`.names` and the labels of
:mod:`alpajob.api.names`.

The pods run the trainer image's entry points: the planner pod ``alpajob plan``
(writing the Plan into the ``<job>-plan`` ConfigMap), the head pod ``alpajob driver``
(the job's Ray head and the driver that trains), and one pod per mesh
host ``alpajob mesh-worker``, each pinned to the node the plan's slot maps to. What a
pod is told (paths, ports, its mesh and host, the head's address) is one
:class:`~alpajob.api.runtime.TrainerRuntime`, put into its environment with
``to_env()``; the commands read it back with ``from_env()``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from alpajob.api.names import (
    API_VERSION,
    COSCHEDULING_GROUP_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    KIND,
    LABEL_ATTEMPT,
    LABEL_HOST,
    LABEL_JOB,
    LABEL_MESH,
    LABEL_ROLE,
    MANIFEST_KEY,
    VOLCANO_GROUP_ANNOTATION,
    Role,
)
from alpajob.api.pod_template import PodTemplates
from alpajob.api.pools import GpuPool
from alpajob.api.release import TRAINER_IMAGE
from alpajob.api.run_policy import RestartScope
from alpajob.api.runtime import (
    CALIBRATION_DIR,
    CALIBRATION_PATH,
    CHECKPOINT_DIR,
    COMPILE_CACHE_DIR,
    CONFIG_DIR,
    COORDINATOR_PORT,
    INIT_COMMAND,
    MANIFEST_PATH,
    METRICS_PORT,
    PLAN_CACHE_DIR,
    PLAN_DIR,
    PLAN_PATH,
    RAY_PORT,
    RAY_TOKEN_DIR,
    RAY_TOKEN_KEY,
    RAY_TOKEN_PATH,
    TERMINATION_LOG,
    TrainerRuntime,
)
from alpajob.api.spec import CHECKPOINT_CLAIM_SUFFIX, PlannerSpec
from alpajob.operator import sizing
from alpajob.operator.names import ChildNames
from alpajob.operator.network import NetworkSettings, job_network_policy
from alpajob.operator.pod_overrides import finish, object_store_bytes
from alpajob.operator.pool import PoolCluster

#: The image of jobs without spec.image (the operator's --default-image replaces it).
DEFAULT_IMAGE = TRAINER_IMAGE

#: Gang schedulers: the PodGroup's API and the scheduler that honours it.
GANG = {
    "volcano": {"apiVersion": "scheduling.volcano.sh/v1beta1", "scheduler": "volcano"},
    "coscheduling": {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "scheduler": "scheduler-plugins-scheduler"},
}


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _meta(job: Mapping[str, Any], name: str, role: Role, attempt: int | None = None,
          **labels: str) -> dict[str, Any]:
    out = {LABEL_JOB: job["metadata"]["name"], LABEL_ROLE: role.value, **labels}
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    return {"name": name, "namespace": job["metadata"]["namespace"], "labels": out,
            "ownerReferences": [owner_reference(job)]}


def _image(job: Mapping[str, Any]) -> str:
    return str(job["spec"].get("image") or DEFAULT_IMAGE)


def config_map(job: Mapping[str, Any], names: ChildNames, manifest_yaml: str) -> dict[str, Any]:
    """``<job>-config``: the AlpaJob as the pods read it."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.config, Role.CONFIG),
            "data": {MANIFEST_KEY: manifest_yaml}}


def plan_config_map(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-plan``: empty until the planner pod writes the plan into it."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.plan, Role.PLAN), "data": {}}


def progress_config_map(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-progress``: the driver keeps its progress here."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.progress, Role.PROGRESS),
            "data": {}}


def ray_token_secret(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-<a>-ray``: a fresh random token that the attempt's Ray cluster requires
    of every connection (GCS, raylets, the dashboard agent's job API, Ray Client). A
    new one each call: the first one created stands (a later create is a 409), and
    only the attempt's head and mesh pods mount it (:func:`_ray_auth`)."""
    meta = _meta(job, names.ray_token, Role.RAY_TOKEN, names.attempt)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "stringData": {RAY_TOKEN_KEY: secrets.token_urlsafe(32)}}


def service_account(job: Mapping[str, Any], names: ChildNames) -> str:
    """The ServiceAccount of the job's pods: ``spec.serviceAccountName``, else the
    job's own ``<job>-trainer`` (:func:`identity`)."""
    return str(job["spec"].get("serviceAccountName") or names.identity)


def identity(job: Mapping[str, Any], names: ChildNames) -> list[dict[str, Any]]:
    """The job's own identity, when it names no ``spec.serviceAccountName``: the
    ServiceAccount ``<job>-trainer``, a Role of that name that may ``get`` and
    ``patch`` only the job's ``<job>-plan`` (the planner writes the plan) and
    ``<job>-progress`` (the head's driver its progress), and the RoleBinding between
    them; all owned by the job. None of the job's pods may read another job's
    ConfigMaps, its own manifest or any Secret through the API, and only the
    planner and head pods get a token at all. Created before the pods that run as it
    (a 409 keeps what is there). The operator holds both verbs on ConfigMaps itself,
    which is what the API server asks of whoever creates such a Role and binds it."""
    if job["spec"].get("serviceAccountName"):
        return []
    name = names.identity
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name, Role.IDENTITY),
               "automountServiceAccountToken": False}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(job, name, Role.IDENTITY),
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "resourceNames": [names.plan, names.progress], "verbs": ["get", "patch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(job, name, Role.IDENTITY),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job["metadata"]["namespace"]}]}
    return [account, role, binding]


def _ray_auth(pod: dict[str, Any], names: ChildNames) -> None:
    """Ray token authentication on in ``pod``: the attempt's Secret mounted read-only
    (readable by the pod's user only) and Ray told to require it."""
    spec = pod["spec"]
    spec["volumes"].append({"name": "ray-token", "secret": {"secretName": names.ray_token, "defaultMode": 0o400}})
    [container] = spec["containers"]
    container["volumeMounts"].append({"name": "ray-token", "mountPath": RAY_TOKEN_DIR, "readOnly": True})
    container["env"] = [*container["env"], {"name": "RAY_AUTH_MODE", "value": "token"},
                        {"name": "RAY_AUTH_TOKEN_PATH", "value": RAY_TOKEN_PATH}]


def checkpoint_claim(job: Mapping[str, Any]) -> str | None:
    """The PersistentVolumeClaim of the job's checkpoints: ``spec.checkpoint.volume``,
    or the one made from ``volumeClaimTemplate``; None without checkpoints."""
    checkpoint = job["spec"].get("checkpoint") or {}
    if checkpoint.get("volume"):
        return str(checkpoint["volume"])
    if checkpoint.get("volumeClaimTemplate"):
        return f"{job['metadata']['name']}-{CHECKPOINT_CLAIM_SUFFIX}"
    return None


def checkpoint_volume_claim(job: Mapping[str, Any]) -> dict[str, Any] | None:
    """``<job>-checkpoints``, from ``spec.checkpoint.volumeClaimTemplate`` (None when the
    job names its own claim, or has none). Owned by the job, so it goes with it, unless
    ``retain``: then it only carries the job's label, and outlives the job."""
    template = (job["spec"].get("checkpoint") or {}).get("volumeClaimTemplate")
    if not template:
        return None
    name = checkpoint_claim(job)
    assert name is not None
    meta = _meta(job, name, Role.CHECKPOINTS)
    if template.get("retain"):
        del meta["ownerReferences"]
    spec: dict[str, Any] = {"accessModes": list(template.get("accessModes") or ["ReadWriteMany"]),
                            "resources": {"requests": {"storage": str(template["size"])}}}
    if template.get("storageClassName"):
        spec["storageClassName"] = template["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


#: Pod Security "restricted" (what a namespace labelled
#: ``pod-security.kubernetes.io/enforce=restricted`` admits): non-root, the runtime's
#: default seccomp profile, no privilege escalation, every capability dropped. Set on
#: the pod and on its container alike.
RUNTIME_DEFAULT_SECCOMP = {"type": "RuntimeDefault"}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": RUNTIME_DEFAULT_SECCOMP}


def _security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": RUNTIME_DEFAULT_SECCOMP}


def _volumes(names: ChildNames, with_plan: bool, job: Mapping[str, Any]) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "config", "configMap": {"name": names.config}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if with_plan:
        volumes.append({"name": "plan", "configMap": {"name": names.plan}})
        mounts.append({"name": "plan", "mountPath": PLAN_DIR, "readOnly": True})
    claim = checkpoint_claim(job)
    if claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    return volumes, mounts


def _templates(job: Mapping[str, Any], templates: PodTemplates | None) -> PodTemplates:
    """The job's ``spec.podTemplate`` (given parsed, or read from the job)."""
    return templates if templates is not None else PodTemplates.model_validate(job["spec"].get("podTemplate") or {})


def _runtime(job: Mapping[str, Any], names: ChildNames, role: Role, **fields: Any) -> TrainerRuntime:
    """The runtime contract every pod of the job shares, and its own ``fields``."""
    return TrainerRuntime(role=role, job=names.job, namespace=job["metadata"]["namespace"],
                          attempt=names.attempt, manifest=MANIFEST_PATH, termination_log=TERMINATION_LOG,
                          **fields)


def _env(runtime: TrainerRuntime) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in runtime.to_env().items()]


def planner_pod(job: Mapping[str, Any], names: ChildNames, clusters: Sequence[PoolCluster],
                templates: PodTemplates | None = None) -> dict[str, Any]:
    """The pod that plans the job for the pool (``alpajob plan``), once: for the one
    cluster of ``clusters``, or, with ``spec.cluster.pools``, across all of them."""
    namespace = job["metadata"]["namespace"]
    volumes, mounts = _volumes(names, False, job)
    # With a checkpoint volume, plans are cached there: a later attempt or a job applied
    # again on the same claim and an unchanged pool reads its plan back.
    calibration = PlannerSpec.model_validate(job["spec"].get("planner") or {}).calibration
    if calibration is not None:
        # optional: a missing ConfigMap or key is the planner's one-line error naming
        # spec.planner.calibration, not a pod stuck in ContainerCreating
        volumes.append({"name": "calibration", "configMap": {
            "name": calibration.config_map, "optional": True,
            "items": [{"key": calibration.key, "path": PurePosixPath(CALIBRATION_PATH).name}]}})
        mounts.append({"name": "calibration", "mountPath": CALIBRATION_DIR, "readOnly": True})
    if (job["spec"].get("cluster") or {}).get("pools") is None:
        (cluster,) = clusters
        pool: dict[str, Any] = {"gpu": cluster.preset, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node}
    else:
        pool = {"pools": [GpuPool(gpu=c.preset, nodes=c.nodes, gpus_per_node=c.gpus_per_node) for c in clusters]}
    runtime = _runtime(job, names, Role.PLANNER, plan_configmap=f"{namespace}/{names.plan}", **pool,
                       plan_cache=PLAN_CACHE_DIR if checkpoint_claim(job) else None,
                       calibration=CALIBRATION_PATH if calibration is not None else None)
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": _meta(job, names.planner, Role.PLANNER),
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": service_account(job, names),
            "automountServiceAccountToken": True,
            "containers": [{
                "name": "planner", "image": _image(job), "command": ["alpajob", "plan"],
                "env": _env(runtime), "volumeMounts": mounts, "securityContext": _security(),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }],
            "volumes": volumes,
            "securityContext": _pod_security(),
        },
    }
    return finish(pod, _templates(job, templates).of(Role.PLANNER.value), sizing.planner_size())


def head_service(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-head``: the Ray head's GCS port and the driver's metrics."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(job, names.service, Role.HEAD),
        "spec": {"selector": {LABEL_JOB: names.job, LABEL_ROLE: Role.HEAD.value},
                 "ports": [{"name": "gcs", "port": RAY_PORT}, {"name": "metrics", "port": METRICS_PORT}]},
    }


def network_policy(job: Mapping[str, Any], names: ChildNames, settings: NetworkSettings) -> dict[str, Any]:
    """``<job>-pods``: ingress to the job's pods from the job, the operator and the
    metrics scraper only (:mod:`.network`)."""
    return job_network_policy(job, _meta(job, names.network_policy, Role.NETWORK), settings)


def hosts_service(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-hosts``: headless, so every mesh pod has a DNS name (its hostname)."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(job, names.hosts_service, Role.MESH),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {LABEL_JOB: names.job, LABEL_ROLE: Role.MESH.value},
                 "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}]},
    }


def _gang_fields(job: Mapping[str, Any], names: ChildNames, gang: str | None) -> tuple[dict, dict, str | None]:
    """Labels, annotations and scheduler name that put a pod into the attempt's gang."""
    scheduling = job["spec"].get("scheduling") or {}
    scheduler = scheduling.get("schedulerName")
    if gang == "volcano":
        return {}, {VOLCANO_GROUP_ANNOTATION: names.pod_group}, scheduler or GANG["volcano"]["scheduler"]
    if gang == "coscheduling":
        return ({COSCHEDULING_GROUP_LABEL: names.pod_group}, {},
                scheduler or GANG["coscheduling"]["scheduler"])
    return {}, {}, scheduler


def _pod(job: Mapping[str, Any], names: ChildNames, name: str, role: Role, gang: str | None,
         container: dict[str, Any], labels: dict[str, str], hostname: str | None) -> dict[str, Any]:
    gang_labels, annotations, scheduler = _gang_fields(job, names, gang)
    meta = _meta(job, name, role, names.attempt, **labels, **gang_labels)
    if annotations:
        meta["annotations"] = annotations
    volumes, mounts = _volumes(names, True, job)
    container = {**container, "volumeMounts": mounts, "securityContext": _security(),
                 "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError"}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": volumes,
                            "serviceAccountName": service_account(job, names),
                            "automountServiceAccountToken": role is Role.HEAD,
                            "securityContext": _pod_security()}
    if scheduler:
        spec["schedulerName"] = scheduler
    priority = (job["spec"].get("scheduling") or {}).get("priorityClassName")
    if priority:
        spec["priorityClassName"] = priority
    if hostname:
        spec["hostname"] = hostname
        spec["subdomain"] = names.hosts_service
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _driver_restarts(job: Mapping[str, Any]) -> int:
    """How often the driver restarts the stages itself: never when the operator restarts
    the job (restartScope Job), else (FailedPods, the default) up to backoffLimit (the operator replaces the
    failed mesh pods; the driver waits for them to join again)."""
    policy = job["spec"].get("runPolicy") or {}
    if policy.get("restartScope", RestartScope.FAILED_PODS.value) != RestartScope.FAILED_PODS.value:
        return 0
    return int(policy.get("backoffLimit", 3))


def head_pod(job: Mapping[str, Any], names: ChildNames, gang: str | None,
             templates: PodTemplates | None = None, size: sizing.PodSize | None = None) -> dict[str, Any]:
    """Attempt ``a``'s head: the Ray head and the driver, which resumes from the last
    complete checkpoint; the pod succeeds when training is done."""
    checkpoint = job["spec"].get("checkpoint") or {}
    saves: dict[str, Any] = {}
    claim = checkpoint_claim(job)
    if claim:
        saves = {"checkpoint_dir": f"{CHECKPOINT_DIR}/{checkpoint.get('path') or names.job}",
                 "checkpoint_every": checkpoint.get("intervalSteps", 500),
                 "checkpoint_volume": f"PersistentVolumeClaim {claim} at {CHECKPOINT_DIR}"}
    overrides, size = _templates(job, templates).of(Role.HEAD.value), size or sizing.head_size(None)
    runtime = _runtime(job, names, Role.HEAD, plan=PLAN_PATH, ray_port=RAY_PORT,
                       metrics_port=METRICS_PORT, object_store_bytes=object_store_bytes(overrides, size),
                       progress_configmap=f"{job['metadata']['namespace']}/{names.progress}", **saves)
    container = {"name": "driver", "image": _image(job),
                 "command": [*INIT_COMMAND, "alpajob", "driver", "--max-restarts", str(_driver_restarts(job))],
                 "ports": [{"name": "gcs", "containerPort": RAY_PORT},
                           {"name": "metrics", "containerPort": METRICS_PORT}],
                 "env": _env(runtime)}
    pod = _pod(job, names, names.head, Role.HEAD, gang, container, {}, None)
    _ray_auth(pod, names)
    return finish(pod, overrides, size)


def mesh_pod(job: Mapping[str, Any], names: ChildNames, mesh: int, host: int, hosts: int,
             node: str, gpus: int, cpu: bool, gang: str | None, templates: PodTemplates | None = None,
             size: sizing.PodSize | None = None, name: str | None = None,
             product: str | None = None) -> dict[str, Any]:
    """Host ``host`` of mesh ``mesh``: a Ray worker offering that host's resource, on
    ``node``, with the mesh's JAX process-group coordinates; named ``name`` (a
    replacement's), else as :meth:`.names.ChildNames.mesh_pod` says. ``product``: a
    plan across GPU types, the node's ``nvidia.com/gpu.product``, also selected."""
    namespace = job["metadata"]["namespace"]
    hostname = names.mesh_hostname(mesh, host)
    coordinator = f"{names.mesh_hostname(mesh, 0)}.{names.hosts_service}.{namespace}.svc"
    overrides, size = _templates(job, templates).of(Role.MESH.value), size or sizing.mesh_size(None, None, gpus, cpu)
    runtime = _runtime(job, names, Role.MESH, plan=PLAN_PATH, object_store_bytes=object_store_bytes(overrides, size),
                       compile_cache=COMPILE_CACHE_DIR if checkpoint_claim(job) else None,
                       ray_address=f"{names.service}.{namespace}.svc:{RAY_PORT}", mesh=mesh,
                       host=host, process_id=host, process_count=hosts,
                       coordinator=f"{coordinator}:{COORDINATOR_PORT}",
                       devices=gpus if cpu else None)
    resources: dict[str, Any] = {} if cpu else {"limits": {GPU_RESOURCE: str(gpus)}}
    container = {"name": "worker", "image": _image(job), "command": [*INIT_COMMAND, "alpajob", "mesh-worker"],
                 "env": _env(runtime), "resources": resources,
                 "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}]}
    labels = {LABEL_MESH: str(mesh), LABEL_HOST: str(host)}
    # A mesh host never calls the Kubernetes API: its pod gets no ServiceAccount token
    # (:func:`_pod`: only the head's does).
    pod = _pod(job, names, name or names.mesh_pod(mesh, host), Role.MESH, gang, container, labels, hostname)
    _ray_auth(pod, names)
    pod["spec"]["initContainers"] = [{
        "name": "wait-for-head", "image": _image(job), "command": ["alpajob", "wait-for-head"],
        "env": _env(runtime), "securityContext": _security(),
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError"}]
    pod = finish(pod, overrides, size, node)
    # The pool's selector too (the pin's node matches it): a queue's flavors are judged
    # by it, so Kueue assigns only a flavor of the nodes the job was planned for.
    # Across GPU types the node's product, so that Kueue gives each type's pod set its flavor.
    selector = (job["spec"].get("cluster") or {}).get("nodeSelector") or {}
    if product is not None:
        selector = {**selector, GPU_PRODUCT_LABEL: product}
    if selector:
        pod["spec"]["nodeSelector"] = {**selector, **(pod["spec"].get("nodeSelector") or {})}
    return pod


def pod_group(job: Mapping[str, Any], names: ChildNames, gang: str, members: int, gpus: int) -> dict[str, Any]:
    """The attempt's PodGroup: admitted only when every pod of it can be placed."""
    meta = _meta(job, names.pod_group, Role.GANG, names.attempt)
    resources = {GPU_RESOURCE: str(gpus)} if gpus else {}
    if gang == "volcano":
        spec: dict[str, Any] = {"minMember": members, "minResources": resources}
        queue = (job["spec"].get("scheduling") or {}).get("queue")
        if queue:
            spec["queue"] = queue
    else:
        spec = {"minMember": members, "minResources": resources, "scheduleTimeoutSeconds": 600}
    return {"apiVersion": GANG[gang]["apiVersion"], "kind": "PodGroup", "metadata": meta, "spec": spec}
