"""The GPU node pool: which nodes a job may use, the cluster the planner plans for,
and which node runs which mesh host.

The pool is the nodes the scheduler would give a mesh pod: every Node that
matches ``spec.cluster.nodeSelector``, is Ready, is not cordoned, carries no
``NoSchedule`` or ``NoExecute`` taint that the mesh pods do not tolerate
(``spec.podTemplate.mesh.tolerations``, plus :data:`GPU_TOLERATION`, which the
operator gives every GPU mesh pod), and offers ``nvidia.com/gpu`` (a CPU pool,
``spec.cluster.gpu: cpu``, needs no GPUs: it is for trying the operator without
GPUs). A node that matches the selector but is left out is named with the reason
(:attr:`NodePool.left_out`), so a short pool says why. The planner is given
``min(spec.cluster.nodes, pool size)`` nodes with the smallest allocatable GPU count
among them (capped at ``spec.cluster.gpusPerNode``), and the device preset of
``spec.cluster.gpu`` or else of the nodes' ``nvidia.com/gpu.product`` label.

A toleration matches a taint as in Kubernetes: the same effect (or none named), and
either ``operator: Exists`` with the taint's key (or no key: every taint) or
``Equal`` (the default) with its key and value. ``PreferNoSchedule`` taints keep no
pod away, so they never leave a node out.

A plan names node *slots* (``device_slots``: node index, GPU index), never Kubernetes
nodes (like JAX's abstract mesh); :func:`assign_nodes` maps slot ``k`` to the ``k``-th
pool node in name order, so a mesh of ``n`` nodes gets ``n`` distinct nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alpajob.api.catalog import GPU_PRODUCT_PRESETS
from alpajob.api.errors import AlpaJobError
from alpajob.api.names import GPU_PRODUCT_LABEL, GPU_RESOURCE
from alpajob.api.plan import StagePlan
from alpajob.api.pod_template import Toleration

#: The toleration of every mesh pod that requests GPUs: GPU node pools are commonly
#: tainted ``nvidia.com/gpu:NoSchedule`` to keep other pods off, and the
#: ExtendedResourceToleration admission plugin, where enabled, adds just this to a
#: pod that requests ``nvidia.com/gpu``; the operator adds it itself, so the pool it
#: plans for is the one the scheduler gives on every cluster.
GPU_TOLERATION = Toleration(key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")

#: A toleration of every taint: the nodes whose pods still run (Ready, not cordoned).
EVERY_TAINT = Toleration(operator="Exists")

#: Taint effects that keep a pod without a matching toleration off a node.
KEEPING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


class PoolError(AlpaJobError):
    """The node pool cannot run the job (the message names the field to change)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PoolNode:
    """One usable node: its name, allocatable GPUs and GPU product label."""

    name: str
    gpus: int
    product: str | None


@dataclass(frozen=True)
class PoolCluster:
    """What the planner is told: ``nodes x gpus_per_node`` devices of ``preset``."""

    preset: str
    nodes: int
    gpus_per_node: int


@dataclass(frozen=True)
class NodePool:
    """The usable nodes (sorted by name), and the matching nodes left out, each with
    the reason (``cordoned``, ``not Ready``, ``tainted key=value:NoSchedule``, ``no
    nvidia.com/gpu``)."""

    nodes: tuple[PoolNode, ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()


def _ready(node: Mapping[str, Any]) -> bool:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def tolerates(toleration: Toleration, taint: Mapping[str, Any]) -> bool:
    """Does ``toleration`` match ``taint`` (module docstring: Kubernetes' rule)?"""
    if toleration.effect is not None and toleration.effect != taint.get("effect"):
        return False
    if toleration.operator == "Exists":
        return toleration.key in (None, "") or toleration.key == taint.get("key")
    return toleration.key == taint.get("key") and (toleration.value or "") == (taint.get("value") or "")


def _keeping_taint(node: Mapping[str, Any], tolerations: Sequence[Toleration]) -> str | None:
    """The first taint of ``node`` that keeps a pod with ``tolerations`` off, as text."""
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in KEEPING_EFFECTS and not any(tolerates(t, taint) for t in tolerations):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"{taint.get('key')}{value}:{taint.get('effect')}"
    return None


def read_pool(nodes: Sequence[Mapping[str, Any]], selector: Mapping[str, str],
              tolerations: Sequence[Toleration] = (), cpu: bool = False) -> NodePool:
    """The pool among ``nodes`` (Node objects) for mesh pods with ``tolerations``
    (module docstring); ``cpu``: a CPU pool, which needs no GPUs."""
    usable, left_out = [], []
    tolerated = [*tolerations, *(() if cpu else (GPU_TOLERATION,))]
    for node in nodes:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        gpus = int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0) or 0)
        if (node.get("spec") or {}).get("unschedulable"):
            why: str | None = "cordoned"
        elif not _ready(node):
            why = "not Ready"
        elif (taint := _keeping_taint(node, tolerated)) is not None:
            why = f"tainted {taint}, which spec.podTemplate.mesh.tolerations does not tolerate"
        elif gpus < 1 and not cpu:
            why = f"no {GPU_RESOURCE}"
        else:
            why = None
        if why is None:
            usable.append(PoolNode(meta["name"], gpus, labels.get(GPU_PRODUCT_LABEL)))
        else:
            left_out.append((str(meta.get("name")), why))
    return NodePool(tuple(sorted(usable, key=lambda n: n.name)), tuple(sorted(left_out)))


def pool_cluster(cluster: Mapping[str, Any], pool: Sequence[PoolNode]) -> PoolCluster:
    """The cluster to plan for on ``pool`` (``cluster`` is ``spec.cluster``)."""
    selector = cluster.get("nodeSelector") or {}
    wanted_nodes = int(cluster.get("nodes", 1))
    per_node = int(cluster.get("gpusPerNode", 8))
    preset = cluster.get("gpu")
    if not pool:
        raise PoolError(
            "spec.cluster.nodeSelector",
            f"no Ready, schedulable node with {GPU_RESOURCE} matches {dict(selector)}; "
            "fix the selector or add nodes to the pool",
        )
    if preset is None:
        products = {n.product for n in pool}
        known: set[str | None] = {GPU_PRODUCT_PRESETS.get(p or "") for p in products}
        if len(known) != 1 or None in known:
            raise PoolError(
                "spec.cluster.gpu",
                f"not set, and the pool's {GPU_PRODUCT_LABEL} labels {sorted(str(p) for p in products)} "
                f"do not name one known preset; set spec.cluster.gpu to one of "
                f"{sorted(p.value for p in set(GPU_PRODUCT_PRESETS.values()))}",
            )
        preset = known.pop()
    chosen = pool[: min(wanted_nodes, len(pool))]
    gpus = per_node if preset == "cpu" else min(per_node, min(n.gpus for n in chosen))
    return PoolCluster(str(preset), len(chosen), gpus)


def assign_nodes(stages: Sequence[StagePlan], pool: Sequence[PoolNode]) -> dict[tuple[int, int], str]:
    """``(mesh, host) -> node name`` for a plan's stages (their ``device_slots``)."""
    out = {}
    for stage in stages:
        node_indices = sorted({int(slot[0]) for slot in stage.device_slots})
        for host, index in enumerate(node_indices):
            if index >= len(pool):
                raise PoolError(
                    "spec.cluster.nodes",
                    f"the plan uses node {index + 1} but the pool has {len(pool)} nodes now; "
                    "the job will be planned again for the smaller pool",
                )
            out[stage.index, host] = pool[index].name
    return out
