"""A pod as the operator builds it, finished with its size and the user's overrides.

:func:`finish` takes a pod of :mod:`.children` (its one container, the job's wiring:
command, env, mounts, labels, Pod Security "restricted") and adds, in one pass:

1. the default **resources** of :mod:`.sizing`, each key replaced by
   ``spec.podTemplate.<role>.resources`` where set (a GPU mesh pod's
   ``nvidia.com/gpu`` limit stays unless the user sets it);
2. a memory-backed **/dev/shm** for Ray pods (``emptyDir`` of medium Memory, sized by
   the plan or ``shmSize``);
3. the pod's **securityContext**: ``fsGroup`` 1000 (the image's user's group: a volume
   made by root becomes writable by uid 1000) with ``fsGroupChangePolicy:
   OnRootMismatch``, and the user's choices; the container keeps running as that user;
4. the rest of the **overrides**: labels and annotations (the operator's own keys
   win), env after the contract's, volumes and mounts, node selector, tolerations,
   affinity (a mesh pod's node pin is added to every required node term),
   priorityClassName, image pull policy and secrets, termination grace period; a
   mesh pod that requests GPUs also tolerates the ``nvidia.com/gpu:NoSchedule``
   taint of GPU node pools (:data:`~.pool.GPU_TOLERATION`);
5. the annotation :data:`TEMPLATE_ANNOTATION`: a hash of the role's overrides, so a
   pod made before ``spec.podTemplate`` changed can be told apart.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kubernetes.utils import parse_quantity

from alpajob.api.names import GPU_RESOURCE, GROUP, HOSTNAME_LABEL
from alpajob.api.pod_template import PodOverrides
from alpajob.operator.pool import GPU_TOLERATION, tolerates
from alpajob.operator.sizing import MI, PodSize

#: Annotation on every pod: the hash of its role's ``spec.podTemplate`` overrides.
TEMPLATE_ANNOTATION = f"{GROUP}/pod-template-hash"
#: The group that owns the pods' volumes by default (the trainer image's user's).
FS_GROUP = 1000
SHM_VOLUME = "dshm"


def template_hash(overrides: PodOverrides) -> str:
    text = json.dumps(overrides.model_dump(mode="json", by_alias=True, exclude_defaults=True), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def object_store_bytes(overrides: PodOverrides, size: PodSize) -> int | None:
    """Ray's object store in a pod: four fifths of its /dev/shm (``shmSize``, else the
    plan's), the rest for Ray's own files there; None for a pod without Ray."""
    if size.shm is None:
        return None
    shm = parse_quantity(overrides.shm_size) if overrides.shm_size is not None else size.shm
    return max(int(shm * 4 // 5), OBJECT_STORE_MINIMUM)


#: Ray refuses an object store under 75 MiB.
OBJECT_STORE_MINIMUM = 75 * MI


def _bytes(quantity: int | str) -> str:
    return str(quantity)


def finish(pod: dict[str, Any], overrides: PodOverrides, size: PodSize, node: str | None = None) -> dict[str, Any]:
    """``pod`` with its size and ``overrides`` (module docstring); ``node``: the node a
    mesh pod must run on. Returns a new dict."""
    pod = copy.deepcopy(pod)
    meta, spec = pod["metadata"], pod["spec"]
    [container] = spec["containers"]
    _resources(container, overrides, size)
    _shm(spec, container, overrides, size)
    _security(spec, container, overrides)
    if overrides.metadata is not None:
        meta["labels"] = {**overrides.metadata.labels, **meta.get("labels", {})}
        meta["annotations"] = {**overrides.metadata.annotations, **meta.get("annotations", {})}
    meta.setdefault("annotations", {})[TEMPLATE_ANNOTATION] = template_hash(overrides)
    container["env"] = [*container.get("env", []),
                        *(e.model_dump(mode="json", by_alias=True, exclude_none=True) for e in overrides.env)]
    spec["volumes"] = [*spec.get("volumes", []), *copy.deepcopy(overrides.volumes)]
    container["volumeMounts"] = [*container.get("volumeMounts", []),
                                 *(m.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
                                   for m in overrides.volume_mounts)]
    if overrides.node_selector:
        spec["nodeSelector"] = dict(overrides.node_selector)
    tolerations = list(overrides.tolerations)
    gpu_taint = {"key": GPU_TOLERATION.key, "effect": GPU_TOLERATION.effect}
    if node is not None and container["resources"].get("limits", {}).get(GPU_RESOURCE) not in (None, 0, "0") \
            and not any(tolerates(t, gpu_taint) for t in tolerations):
        tolerations.append(GPU_TOLERATION)  # the pool counts nodes tainted for GPU pods (pool.GPU_TOLERATION)
    if tolerations:
        spec["tolerations"] = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tolerations]
    affinity = copy.deepcopy(overrides.affinity) if overrides.affinity else None
    if node is not None:
        affinity = _pinned(affinity or {}, node)
    if affinity:
        spec["affinity"] = affinity
    if overrides.priority_class_name:
        spec["priorityClassName"] = overrides.priority_class_name
    if overrides.image_pull_policy:
        for each in [container, *spec.get("initContainers", [])]:
            each["imagePullPolicy"] = overrides.image_pull_policy
    if overrides.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in overrides.image_pull_secrets]
    if overrides.termination_grace_period_seconds is not None:
        spec["terminationGracePeriodSeconds"] = overrides.termination_grace_period_seconds
    return pod


def _resources(container: dict[str, Any], overrides: PodOverrides, size: PodSize) -> None:
    resources = container.setdefault("resources", {})
    requests = {"cpu": size.cpu, "memory": size.memory, **resources.get("requests", {})}
    limits = dict(resources.get("limits", {}))
    if overrides.resources is not None:
        requests.update({k: _bytes(v) for k, v in overrides.resources.requests.items()})
        limits.update({k: _bytes(v) for k, v in overrides.resources.limits.items()})
    container["resources"] = {"requests": requests, **({"limits": limits} if limits else {})}


def _shm(spec: dict[str, Any], container: dict[str, Any], overrides: PodOverrides, size: PodSize) -> None:
    """Ray's object store in memory: without it the container's /dev/shm is 64 MiB and
    Ray falls back to disk ("This will harm performance")."""
    if size.shm is None:
        return
    limit = _bytes(overrides.shm_size) if overrides.shm_size is not None else f"{size.shm // MI}Mi"
    spec.setdefault("volumes", []).append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": limit}})
    container.setdefault("volumeMounts", []).append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})


def _security(spec: dict[str, Any], container: dict[str, Any], overrides: PodOverrides) -> None:
    pod = spec.setdefault("securityContext", {})
    pod.update(fsGroup=FS_GROUP, fsGroupChangePolicy="OnRootMismatch")
    chosen = overrides.security_context
    if chosen is None:
        return
    fields = chosen.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
    pod.update(fields)
    for key in ("runAsUser", "runAsGroup"):  # the container's own settings would win over the pod's
        if key in fields:
            container.setdefault("securityContext", {})[key] = fields[key]


def _pinned(affinity: dict[str, Any], node: str) -> dict[str, Any]:
    """``affinity`` that also requires ``node``: the pin ANDed into every required node
    selector term (terms are ORed; expressions inside one are ANDed)."""
    pin = {"key": HOSTNAME_LABEL, "operator": "In", "values": [node]}
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [{**term, "matchExpressions": [*term.get("matchExpressions", []), pin]}
                                     for term in terms]
    return affinity
