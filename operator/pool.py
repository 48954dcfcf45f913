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

**Several GPU types** (``spec.cluster.pools``). The pool is then every usable node
whose ``nvidia.com/gpu.product`` is of one of the pools' presets
(:func:`pool_products`), and :func:`pool_clusters` splits it by preset: each pool's
cluster is ``min(its nodes, the nodes of its type)`` nodes (the first in name order)
with their smallest GPU count (capped at its ``gpusPerNode``); a type with no usable
node is left out, so a job whose second type is missing is planned on the first
alone (``whenFewerNodes: Wait`` waits instead).

A plan names node *slots* (``device_slots``: node index, GPU index), never Kubernetes
nodes (like JAX's abstract mesh); :func:`slot_nodes` lists the node of each slot
index: the pool's nodes in name order, or across types each plan pool's nodes of its
type from its ``first_node`` on; :func:`assign_nodes` maps a stage's slots to them, so
a mesh of ``n`` nodes gets ``n`` distinct nodes, of its stage's type.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alpajob.api.catalog import GPU_PRODUCT_PRESETS
from alpajob.api.errors import AlpaJobError
from alpajob.api.names import GPU_PRODUCT_LABEL, GPU_RESOURCE
from alpajob.api.plan import Plan, StagePlan
from alpajob.api.pod_template import Toleration
from alpajob.api.wording import counted

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
              tolerations: Sequence[Toleration] = (), cpu: bool = False,
              products: Collection[str] | None = None) -> NodePool:
    """The pool among ``nodes`` (Node objects) for mesh pods with ``tolerations``
    (module docstring); ``cpu``: a CPU pool, which needs no GPUs; ``products``: only
    nodes labelled with one of these ``nvidia.com/gpu.product`` values (several types)."""
    usable, left_out = [], []
    tolerated = [*tolerations, *(() if cpu else (GPU_TOLERATION,))]
    for node in nodes:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        if products is not None and labels.get(GPU_PRODUCT_LABEL) not in products:
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


def pool_products(cluster: Mapping[str, Any]) -> frozenset[str] | None:
    """The ``nvidia.com/gpu.product`` values of ``spec.cluster.pools``' presets (None:
    one type, chosen by ``nodeSelector``)."""
    pools = cluster.get("pools")
    if pools is None:
        return None
    presets = {str(p.get("gpu")) for p in pools}
    return frozenset(product for product, preset in GPU_PRODUCT_PRESETS.items() if preset.value in presets)


def _of_type(pool: Sequence[PoolNode], preset: str) -> list[PoolNode]:
    known = GPU_PRODUCT_PRESETS.get
    return [n for n in pool if (p := known(n.product or "")) is not None and p.value == preset]


def pool_clusters(cluster: Mapping[str, Any], pool: Sequence[PoolNode]) -> tuple[PoolCluster, ...]:
    """What to plan for on ``pool``: one cluster (:func:`pool_cluster`), or one per type
    of ``spec.cluster.pools`` with usable nodes, in the spec's order (module docstring)."""
    pools = cluster.get("pools")
    if pools is None:
        return (pool_cluster(cluster, pool),)
    out = []
    for entry in pools:
        preset = str(entry.get("gpu"))
        mine = _of_type(pool, preset)[: int(entry.get("nodes", 1))]
        if mine:
            gpus = min(int(entry.get("gpusPerNode", 8)), min(n.gpus for n in mine))
            out.append(PoolCluster(preset, len(mine), gpus))
    if not out:
        products = sorted(pool_products(cluster) or ())
        raise PoolError("spec.cluster.pools", (
            f"no Ready, schedulable node with {GPU_RESOURCE} is labelled {GPU_PRODUCT_LABEL} of "
            f"{', '.join(str(p.get('gpu')) for p in pools)} ({', '.join(products)}); add nodes of these types"))
    return tuple(out)


def wanted_nodes(cluster: Mapping[str, Any], pool: Sequence[PoolNode]) -> tuple[int, int]:
    """The nodes ``spec.cluster`` asks for and how many of them the pool has (across
    types: each type's count up to its pool's ``nodes``)."""
    pools = cluster.get("pools")
    if pools is None:
        return int(cluster.get("nodes", 1)), len(pool)
    wanted = [int(p.get("nodes", 1)) for p in pools]
    return sum(wanted), sum(min(w, len(_of_type(pool, str(p.get("gpu"))))) for w, p in zip(wanted, pools, strict=True))


def slot_nodes(plan: Plan, cluster: Mapping[str, Any], pool: Sequence[PoolNode]) -> list[PoolNode | None]:
    """The node of each node index of ``plan``'s slots (module docstring); None where
    a type has fewer usable nodes now than the plan took of it."""
    if cluster.get("pools") is None:
        return list(pool)
    out: list[PoolNode | None] = []
    for part in plan.pools or [plan.cluster]:
        mine = _of_type(pool, str(part["preset"]))[: int(part["num_nodes"])]
        out += [*mine, *[None] * (int(part["num_nodes"]) - len(mine))]
    return out


def assign_nodes(stages: Sequence[StagePlan], nodes: Sequence[PoolNode | None]) -> dict[tuple[int, int], PoolNode]:
    """``(mesh, host) -> node`` for a plan's stages (their ``device_slots``) on the
    nodes of :func:`slot_nodes`."""
    out = {}
    for stage in stages:
        node_indices = sorted({int(slot[0]) for slot in stage.device_slots})
        for host, index in enumerate(node_indices):
            node = nodes[index] if index < len(nodes) else None
            if node is None:
                have = sum(n is not None for n in nodes)
                raise PoolError(
                    "spec.cluster.nodes",
                    f"the plan uses node {index + 1} but the pool has {counted(have, 'node')} now; "
                    "the job will be planned again for the smaller pool",
                )
            out[stage.index, host] = node
    return out
