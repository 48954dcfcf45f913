"""Builders of an AlpaJob's child objects: plain dicts, as ``kubectl`` would send them.

Nothing here talks to the API; :mod:`.reconcile` decides which children to create
and the handlers send them. Every child carries the job's owner reference (deleting
the job deletes them) and the labels of :mod:`.names`.

The pods run the trainer image's entry points: the planner pod ``alpajob plan``
(writing the Plan into the ``<job>-plan`` ConfigMap), the head pod ``alpajob driver
--head-port`` (the job's Ray head and the driver that trains), and one pod per mesh
host ``alpajob mesh-worker``, each pinned to the node the plan's slot maps to, with
the environment the trainer reads (:mod:`alpajob.trainer.distributed.cluster`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from alpajob.operator.names import (
    GROUP,
    KIND,
    LABEL_ATTEMPT,
    LABEL_HOST,
    LABEL_JOB,
    LABEL_MESH,
    LABEL_ROLE,
    VERSION,
    ChildNames,
)
from alpajob.operator.pool import GPU_RESOURCE, PoolCluster

DEFAULT_IMAGE = "ghcr.io/alpajob/alpajob:0.1.0"
RAY_PORT = 6379
METRICS_PORT = 9090
COORDINATOR_PORT = 8476
CONFIG_DIR = "/etc/alpajob"
PLAN_DIR = "/etc/alpajob/plan"
CHECKPOINT_DIR = "/checkpoints"

#: Gang schedulers: the PodGroup's API and the pod's labels/annotations for it.
GANG = {
    "volcano": {"apiVersion": "scheduling.volcano.sh/v1beta1", "scheduler": "volcano"},
    "coscheduling": {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "scheduler": "scheduler-plugins-scheduler"},
}
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _meta(job: Mapping[str, Any], name: str, role: str, attempt: int | None = None, **labels: str) -> dict[str, Any]:
    out = {LABEL_JOB: job["metadata"]["name"], LABEL_ROLE: role, **labels}
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    queue = (job["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    if queue:
        out[KUEUE_QUEUE_LABEL] = queue
    return {"name": name, "namespace": job["metadata"]["namespace"], "labels": out,
            "ownerReferences": [owner_reference(job)]}


def _image(job: Mapping[str, Any]) -> str:
    return str(job["spec"].get("image") or DEFAULT_IMAGE)


def config_map(job: Mapping[str, Any], names: ChildNames, manifest_yaml: str) -> dict[str, Any]:
    """``<job>-config``: the AlpaJob as the pods read it."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.config, "config"),
            "data": {"manifest.yaml": manifest_yaml}}


def plan_config_map(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-plan``: empty until the planner pod writes ``plan.json`` into it."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.plan, "plan"), "data": {}}


def progress_config_map(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-progress``: the driver keeps its progress here (``progress.json``)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.progress, "progress"), "data": {}}


def _security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}}


def _volumes(names: ChildNames, with_plan: bool, job: Mapping[str, Any]) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "config", "configMap": {"name": names.config}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if with_plan:
        volumes.append({"name": "plan", "configMap": {"name": names.plan}})
        mounts.append({"name": "plan", "mountPath": PLAN_DIR, "readOnly": True})
    claim = (job["spec"].get("checkpoint") or {}).get("volume")
    if claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    return volumes, mounts


def planner_pod(job: Mapping[str, Any], names: ChildNames, cluster: PoolCluster) -> dict[str, Any]:
    """The pod that plans the job for the pool (``alpajob plan``), once."""
    namespace = job["metadata"]["namespace"]
    volumes, mounts = _volumes(names, False, job)
    command = ["alpajob", "plan", f"{CONFIG_DIR}/manifest.yaml", "--gpu", cluster.preset,
               "--nodes", str(cluster.nodes), "--gpus-per-node", str(cluster.gpus_per_node),
               "--output-configmap", f"{namespace}/{names.plan}"]
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": _meta(job, names.planner, "planner"),
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": job["spec"].get("serviceAccountName") or "alpajob-trainer",
            "containers": [{
                "name": "planner", "image": _image(job), "command": command,
                "volumeMounts": mounts, "securityContext": _security(),
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": {"requests": {"cpu": "2", "memory": "8Gi"}},
            }],
            "volumes": volumes,
        },
    }


def head_service(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-head``: the Ray head's GCS port and the driver's metrics."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(job, names.service, "head"),
        "spec": {"selector": {LABEL_JOB: names.job, LABEL_ROLE: "head"},
                 "ports": [{"name": "gcs", "port": RAY_PORT}, {"name": "metrics", "port": METRICS_PORT}]},
    }


def hosts_service(job: Mapping[str, Any], names: ChildNames) -> dict[str, Any]:
    """``<job>-hosts``: headless, so every mesh pod has a DNS name (its hostname)."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(job, names.hosts_service, "mesh"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {LABEL_JOB: names.job, LABEL_ROLE: "mesh"},
                 "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}]},
    }


def _gang_fields(job: Mapping[str, Any], names: ChildNames, gang: str | None) -> tuple[dict, dict, str | None]:
    """Labels, annotations and scheduler name that put a pod into the attempt's gang."""
    scheduling = job["spec"].get("scheduling") or {}
    scheduler = scheduling.get("schedulerName")
    if gang == "volcano":
        return {}, {"scheduling.k8s.io/group-name": names.pod_group}, scheduler or GANG["volcano"]["scheduler"]
    if gang == "coscheduling":
        return ({"scheduling.x-k8s.io/pod-group": names.pod_group}, {},
                scheduler or GANG["coscheduling"]["scheduler"])
    return {}, {}, scheduler


def _pod(job: Mapping[str, Any], names: ChildNames, name: str, role: str, gang: str | None,
         container: dict[str, Any], labels: dict[str, str], node: str | None, hostname: str | None) -> dict[str, Any]:
    gang_labels, annotations, scheduler = _gang_fields(job, names, gang)
    meta = _meta(job, name, role, names.attempt, **labels, **gang_labels)
    if annotations:
        meta["annotations"] = annotations
    volumes, mounts = _volumes(names, True, job)
    container = {**container, "volumeMounts": mounts, "securityContext": _security(),
                 "terminationMessagePolicy": "FallbackToLogsOnError"}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": volumes,
                            "serviceAccountName": job["spec"].get("serviceAccountName") or "alpajob-trainer"}
    if scheduler:
        spec["schedulerName"] = scheduler
    priority = (job["spec"].get("scheduling") or {}).get("priorityClassName")
    if priority:
        spec["priorityClassName"] = priority
    if node:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}
    if hostname:
        spec["hostname"] = hostname
        spec["subdomain"] = names.hosts_service
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _env(pairs: Mapping[str, object]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in pairs.items()]


def head_pod(job: Mapping[str, Any], names: ChildNames, gang: str | None) -> dict[str, Any]:
    """Attempt ``a``'s head: the Ray head and the driver, which resumes from the last
    complete checkpoint; the pod succeeds when training is done."""
    spec = job["spec"]
    training = spec.get("training") or {}
    checkpoint = spec.get("checkpoint") or {}
    command = ["alpajob", "driver", f"{CONFIG_DIR}/manifest.yaml", "--plan", f"{PLAN_DIR}/plan.json",
               "--head-port", str(RAY_PORT), "--steps", str(training.get("steps", 1000)),
               "--metrics-port", str(METRICS_PORT), "--max-restarts", "0",
               "--status-configmap", f"{job['metadata']['namespace']}/{names.progress}"]
    if checkpoint.get("volume"):
        command += ["--checkpoint-dir", f"{CHECKPOINT_DIR}/{checkpoint.get('path') or names.job}",
                    "--checkpoint-every", str(checkpoint.get("intervalSteps", 500))]
    container = {"name": "driver", "image": _image(job), "command": command,
                 "ports": [{"name": "gcs", "containerPort": RAY_PORT},
                           {"name": "metrics", "containerPort": METRICS_PORT}],
                 "env": _env({"ALPAJOB_ATTEMPT": names.attempt}),
                 "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}
    return _pod(job, names, names.head, "head", gang, container, {}, None, None)


def mesh_pod(job: Mapping[str, Any], names: ChildNames, mesh: int, host: int, hosts: int,
             node: str, gpus: int, cpu: bool, gang: str | None) -> dict[str, Any]:
    """Host ``host`` of mesh ``mesh``: a Ray worker offering that host's resource, on
    ``node``, with the mesh's JAX process-group coordinates."""
    namespace = job["metadata"]["namespace"]
    hostname = f"m{mesh}-h{host}"
    env = {
        "ALPAJOB_RAY_ADDRESS": f"{names.service}.{namespace}.svc:{RAY_PORT}",
        "ALPAJOB_MESH": mesh,
        "ALPAJOB_HOST": host,
        "ALPAJOB_PROCESS_ID": host,
        "ALPAJOB_PROCESS_COUNT": hosts,
        "ALPAJOB_COORDINATOR": f"m{mesh}-h0.{names.hosts_service}.{namespace}.svc:{COORDINATOR_PORT}",
        "ALPAJOB_PLAN": f"{PLAN_DIR}/plan.json",
        "ALPAJOB_ATTEMPT": names.attempt,
    }
    if cpu:
        env["ALPAJOB_DEVICES"] = gpus
    resources: dict[str, Any] = {"requests": {"cpu": "4", "memory": "16Gi"}}
    if not cpu:
        resources["limits"] = {GPU_RESOURCE: str(gpus)}
    container = {"name": "worker", "image": _image(job), "command": ["alpajob", "mesh-worker"],
                 "env": _env(env), "resources": resources,
                 "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}]}
    labels = {LABEL_MESH: str(mesh), LABEL_HOST: str(host)}
    return _pod(job, names, names.mesh_pod(mesh, host), "mesh", gang, container, labels, node, hostname)


def pod_group(job: Mapping[str, Any], names: ChildNames, gang: str, members: int, gpus: int) -> dict[str, Any]:
    """The attempt's PodGroup: admitted only when every pod of it can be placed."""
    meta = _meta(job, names.pod_group, "gang", names.attempt)
    resources = {GPU_RESOURCE: str(gpus)} if gpus else {}
    if gang == "volcano":
        spec: dict[str, Any] = {"minMember": members, "minResources": resources}
        queue = (job["spec"].get("scheduling") or {}).get("queue")
        if queue:
            spec["queue"] = queue
    else:
        spec = {"minMember": members, "minResources": resources, "scheduleTimeoutSeconds": 600}
    return {"apiVersion": GANG[gang]["apiVersion"], "kind": "PodGroup", "metadata": meta, "spec": spec}
