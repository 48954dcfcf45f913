"""A plan across two GPU types for GPT-tiny, for the runtimes' tests: one stage on 2
H100s (layer 0), one on 2 A100s (the rest), four micro-batches, as the planner's
pools code costs and documents it (the planner itself would keep so small a model
on one type)."""

from __future__ import annotations

from typing import Any

from alpajob.api.plan import Plan
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.inter_op.pools import PoolSearch, pool_link
from alpajob.planner.inter_op.search import StageOption
from alpajob.planner.plan.make import SearchOptions
from alpajob.planner.plan.pools import pool_contexts, pools_document
from alpajob.trainer_image.planning import job_graph

#: GPT-tiny, SGD, a batch of 16: the runtimes' tests' job (the cluster is this machine's).
JOB: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "pools-gpt"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"},
             "training": {"globalBatchSize": 16, "dtype": "float32", "optimizer": "sgd", "learningRate": 0.05},
             "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8}}}


def two_pool_plan(job: Any, per_node: tuple[int, int] = (2, 2)) -> Plan:
    """Stage 0 on the H100 node's ``per_node[0]`` devices, stage 1 on the A100 node's
    ``per_node[1]`` (as a (1, n) mesh, or (2, 1) on 2)."""
    graph = job_graph(job)
    pools = [cluster_from_preset("h100-80gb", 1, per_node[0]),
             cluster_from_preset("a100-80gb", 1, per_node[1])]
    contexts = pool_contexts(graph, pools, SearchOptions(num_micro_batches=4))
    last = len(contexts[0].layers) - 1
    first, second = ((1, n) for n in per_node)
    two = PoolSearch(contexts, pool_link(pools)).evaluate(
        [(0, StageOption(first, first, 0), 0, 0),
         (1, StageOption(second, (2, 1) if second == (1, 2) else second, 0), 1, last)], 4)
    assert two is not None
    return pools_document(graph, contexts, pool_link(pools), two)
