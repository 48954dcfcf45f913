"""Stage slicing of the baselines (pure functions)."""

import itertools

import pytest

from alpajob.planner.plan.baselines import even_ranges, operator_ranges


def _check_cover(ranges, n):
    assert ranges[0][0] == 0 and ranges[-1][1] == n - 1
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert start == end + 1
    assert all(a <= b for a, b in ranges)


@pytest.mark.parametrize(("n", "p"), [(5, 2), (48, 8), (7, 7), (10, 3), (1, 1)])
def test_even_ranges(n, p):
    ranges = even_ranges(n, p)
    assert len(ranges) == p
    _check_cover(ranges, n)
    sizes = [b - a + 1 for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_even_ranges_example():
    assert even_ranges(5, 2) == [(0, 1), (2, 4)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_operator_ranges_balance_op_counts(p):
    counts = [100, 10, 10, 10, 10, 10, 10, 40]
    ranges = operator_ranges(counts, p)
    assert len(ranges) == p
    _check_cover(ranges, len(counts))
    if p == 2:
        # 200 ops: the cut lands where the running count is nearest 100 (after layer 0).
        assert ranges == [(0, 0), (1, 7)]


def test_a_cluster_of_three_nodes_is_planned_and_every_megatron_grid_tiles_its_nodes():
    """24 GPUs (3 nodes of 8): Megatron's two stages of 12 GPUs would not tile the nodes
    (and once failed the whole plan: a logical mesh of 12 on a submesh of 8); every grid
    the baseline keeps runs on part of a node that divides it, or on whole nodes."""
    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.plan.baselines import megatron_grids
    from alpajob.planner.plan.make import SearchOptions, make_plan
    from alpajob.trainer_image.step import graph_of
    from alpajob.trainer_image.zoo import resolve_model

    graph = graph_of(resolve_model("gpt", "tiny", dtype="float32"), 48, optimizer="sgd")
    planned = make_plan(graph, cluster_from_preset("a100-40gb", 3, 8), SearchOptions(num_micro_batches=2,
                                                                                      baselines=True))
    assert planned.plan.devices_offered() == 24 and planned.plan.predicted_step_seconds > 0
    grids = megatron_grids(planned.context)
    assert grids and all(
        (n == 1 and 8 % m == 0 or m == 8) and a * b == n * m
        for stages in grids for (n, m), (a, b) in [(stages[0].submesh, stages[0].shape)])
