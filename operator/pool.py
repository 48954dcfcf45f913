"""The GPU node pool: which nodes a job may use, the cluster the planner plans for,
and which node runs which mesh host.

The pool is every Node that matches ``spec.cluster.nodeSelector``, is Ready and
schedulable, and offers ``nvidia.com/gpu`` (a CPU pool, ``spec.cluster.gpu: cpu``,
needs no GPUs: it is for trying the operator without GPUs). The planner is given
``min(spec.cluster.nodes, pool size)`` nodes with the smallest allocatable GPU count
among them (capped at ``spec.cluster.gpusPerNode``), and the device preset of
``spec.cluster.gpu`` or else of the nodes' ``nvidia.com/gpu.product`` label.

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


def _ready(node: Mapping[str, Any]) -> bool:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def pool_nodes(nodes: Sequence[Mapping[str, Any]], selector: Mapping[str, str], cpu: bool = False) -> list[PoolNode]:
    """The usable nodes among ``nodes`` (Node objects), sorted by name."""
    out = []
    for node in nodes:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        if (node.get("spec") or {}).get("unschedulable") or not _ready(node):
            continue
        gpus = int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0) or 0)
        if gpus < 1 and not cpu:
            continue
        out.append(PoolNode(meta["name"], gpus, labels.get(GPU_PRODUCT_LABEL)))
    return sorted(out, key=lambda n: n.name)


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
