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


def two_pool_plan(job: Any) -> Plan:
    graph = job_graph(job)
    pools = [cluster_from_preset("h100-80gb", 1, 2), cluster_from_preset("a100-80gb", 1, 2)]
    contexts = pool_contexts(graph, pools, SearchOptions(num_micro_batches=4))
    last = len(contexts[0].layers) - 1
    two = PoolSearch(contexts, pool_link(pools)).evaluate(
        [(0, StageOption((1, 2), (1, 2), 0), 0, 0), (1, StageOption((1, 2), (2, 1), 0), 1, last)], 4)
    assert two is not None
    return pools_document(graph, contexts, pool_link(pools), two)
