"""The operator's side of a job across GPU types (``spec.cluster.pools``): which nodes
are each type's, what the planner is told, and which node each stage's pods go to.
The whole path through the test API server is in ``test_operator_e2e.py``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from pools_plan import JOB, two_pool_plan  # noqa: E402

from alpajob.api.names import GPU_PRODUCT_LABEL, GPU_RESOURCE  # noqa: E402
from alpajob.api.resource import parse_job  # noqa: E402
from alpajob.operator.pool import (  # noqa: E402
    PoolCluster,
    PoolError,
    PoolNode,
    assign_nodes,
    pool_clusters,
    pool_products,
    read_pool,
    slot_nodes,
    wanted_nodes,
)

H100, A100, V100 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", "Tesla-V100-SXM2-16GB"
#: One H100 node and two A100 nodes wanted, two GPUs of each node.
POOLS: dict[str, Any] = {"pools": [{"gpu": "h100-80gb", "nodes": 1, "gpusPerNode": 2},
                                   {"gpu": "a100-80gb", "nodes": 2, "gpusPerNode": 2}]}


def _node(name: str, product: str, gpus: int = 8, cordoned: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {GPU_PRODUCT_LABEL: product}},
            "spec": {"unschedulable": True} if cordoned else {},
            "status": {"allocatable": {GPU_RESOURCE: str(gpus)}, "conditions": [{"type": "Ready", "status": "True"}]}}


def test_the_pool_of_a_job_across_types_is_the_nodes_of_its_types_split_by_type() -> None:
    nodes = [_node("h-1", H100), _node("h-2", H100), _node("a-1", A100, gpus=1), _node("a-2", A100, cordoned=True),
             _node("v-1", V100)]
    pool = read_pool(nodes, {}, products=pool_products(POOLS))
    assert [n.name for n in pool.nodes] == ["a-1", "h-1", "h-2"]  # the V100 node is no type of the job's
    assert dict(pool.left_out) == {"a-2": "cordoned"}
    # each type: its first nodes in name order up to its pool's count, their smallest GPU count
    assert pool_clusters(POOLS, pool.nodes) == (PoolCluster("h100-80gb", 1, 2), PoolCluster("a100-80gb", 1, 1))
    assert wanted_nodes(POOLS, pool.nodes) == (3, 2)
    # a type with no usable node is left out: the other type is planned alone
    only_h100 = [n for n in pool.nodes if n.product == H100]
    assert pool_clusters(POOLS, only_h100) == (PoolCluster("h100-80gb", 1, 2),)
    with pytest.raises(PoolError) as error:
        pool_clusters(POOLS, [])
    assert error.value.field == "spec.cluster.pools" and A100 in str(error.value)
    # one type, as before: the selector's nodes
    assert pool_products({"gpu": "h100-80gb"}) is None and wanted_nodes({"nodes": 4}, only_h100) == (4, 2)


def test_each_stage_of_a_plan_across_types_is_placed_on_nodes_of_its_type() -> None:
    """The plan's first stage is on an H100 node, its second on an A100 node (slots count
    nodes across the pools: node 1 is the A100 pool's first): each mesh host goes to a
    node of its stage's type, whatever the nodes' name order; a type that lost its node
    since the plan is a :class:`PoolError` (the operator plans again)."""
    job = copy.deepcopy(JOB)
    job["spec"]["cluster"] = {"pools": [{"gpu": "h100-80gb", "gpusPerNode": 2}, {"gpu": "a100-80gb", "gpusPerNode": 2}]}
    plan = two_pool_plan(parse_job(job))
    cluster = job["spec"]["cluster"]
    pool = [PoolNode("a-node", 8, A100), PoolNode("b-node", 8, H100), PoolNode("c-node", 8, A100)]
    nodes = slot_nodes(plan, cluster, pool)
    assert [n.name if n else None for n in nodes] == ["b-node", "a-node"]
    placed = assign_nodes(plan.stages, nodes)
    assert {key: node.product for key, node in placed.items()} == {(0, 0): H100, (1, 0): A100}
    with pytest.raises(PoolError, match="the plan uses node 2 but the pool has 1 node now"):
        assign_nodes(plan.stages, slot_nodes(plan, cluster, [n for n in pool if n.product == H100]))
