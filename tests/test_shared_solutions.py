"""Layer ILP solutions shared between the plan searches of one graph
(planner/inter_op/shared_solutions.py): a search after another on the same GPUs plans
what it plans alone, and solves fewer ILPs; solutions of other GPUs, another graph
or other layers are never used."""

from __future__ import annotations

import pytest

from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.inter_op.shared_solutions import SharedSolutions
from alpajob.planner.plan.make import SearchOptions, make_plan
from alpajob.planner.plan.pools import plan_pools
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model

OPTIONS = SearchOptions(max_micro_batches=4)


@pytest.fixture(scope="module")
def graph():
    return graph_of(resolve_model("gpt", "tiny"), 32)


def test_a_search_after_one_on_the_same_gpus_plans_the_same_and_solves_only_what_is_new(graph):
    one_node, two_nodes = cluster_from_preset("a100-40gb", 1, 4), cluster_from_preset("a100-40gb", 2, 4)
    alone = [make_plan(graph, cluster, OPTIONS).plan for cluster in (one_node, two_nodes)]
    shared = SharedSolutions(graph)
    first = make_plan(graph, one_node, OPTIONS, shared=shared).plan
    held = len(shared)
    second = make_plan(graph, two_nodes, OPTIONS, shared=shared).plan
    assert [first.content_hash(), second.content_hash()] == [p.content_hash() for p in alone]
    assert first.predicted_step_seconds == alone[0].predicted_step_seconds
    assert second.predicted_step_seconds == alone[1].predicted_step_seconds
    assert first.solver.ilp_solves == alone[0].solver.ilp_solves == held
    # One node's ILPs came from the first search: only the two-node meshes' are new.
    assert 0 < second.solver.ilp_solves < alone[1].solver.ilp_solves
    assert len(shared) == held + second.solver.ilp_solves


def test_solutions_of_other_gpus_are_not_used(graph):
    shared = SharedSolutions(graph)
    make_plan(graph, cluster_from_preset("a100-40gb", 1, 4), OPTIONS, shared=shared)
    h100 = cluster_from_preset("h100-80gb", 1, 4)
    alone = make_plan(graph, h100, OPTIONS).plan
    after = make_plan(graph, h100, OPTIONS, shared=shared).plan
    assert after.content_hash() == alone.content_hash()
    assert after.solver.ilp_solves == alone.solver.ilp_solves


def test_a_plan_across_types_after_plans_of_its_types_solves_fewer_ilps(graph):
    pools = [cluster_from_preset("h100-80gb", 1, 2), cluster_from_preset("a100-80gb", 1, 2)]
    fixed = SearchOptions(num_micro_batches=4)
    alone = plan_pools(graph, pools, fixed).plan
    shared = SharedSolutions(graph)
    for pool in pools:
        make_plan(graph, pool, fixed, shared=shared)
    mixed = plan_pools(graph, pools, fixed, shared=shared).plan
    assert mixed.content_hash() == alone.content_hash()
    assert mixed.solver.ilp_solves < alone.solver.ilp_solves


def test_solutions_of_another_graph_or_other_layers_are_refused(graph):
    """Known by the graph's fingerprint: the same model traced again is the same graph
    (a what-if worker has its own copy); another batch size is another graph."""
    shared = SharedSolutions(graph)
    cluster = cluster_from_preset("a100-40gb", 1, 2)
    four = SearchOptions(num_micro_batches=4)
    make_plan(graph, cluster, four, shared=shared)
    again = make_plan(graph_of(resolve_model("gpt", "tiny"), 32), cluster, four, shared=shared).plan
    assert again.solver.ilp_solves == 0
    other = graph_of(resolve_model("gpt", "tiny"), 16)
    with pytest.raises(ValueError, match="another graph or other layers"):
        make_plan(other, cluster, OPTIONS, shared=shared)
    with pytest.raises(ValueError, match="another graph or other layers"):
        make_plan(graph, cluster, SearchOptions(num_micro_batches=4, num_layers=1), shared=shared)
