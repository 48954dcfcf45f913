"""The stage DP (Alpa eq. 3/4) against exhaustive search, and submesh placement."""

from __future__ import annotations

import numpy as np
import pytest

from alpajob.planner.inter_op.stage_dp import (
    DPResult,
    StageChoice,
    assign_submeshes,
    stage_dp,
    stage_dp_brute_force,
    stage_dp_pools,
    submesh_choices,
)


def _random_case(rng: np.random.Generator, max_layers: int = 5, max_choices: int = 3):
    num_layers = int(rng.integers(1, max_layers + 1))
    num_choices = int(rng.integers(1, max_choices + 1))
    devices = sorted(int(n) for n in rng.choice([1, 2, 4], size=num_choices, replace=False))
    if rng.random() < 0.7:  # a device count some stage split can use exactly
        num_devices = int(sum(rng.choice(devices, size=int(rng.integers(1, num_layers + 1)))))
    else:
        num_devices = int(rng.integers(1, 7))
    cost = rng.uniform(0.1, 4.0, size=(num_layers, num_layers, num_choices))
    if rng.random() < 0.3:
        cost = np.round(cost * 2) / 2  # many equal costs: ties between caps and plans
    cost[rng.random(cost.shape) < 0.15] = np.inf
    cost[np.tril_indices(num_layers, -1)] = np.inf
    max_succ = rng.integers(-1, num_layers + 1, size=cost.shape)
    max_succ[rng.random(cost.shape) < 0.5] = num_layers  # memory often not binding
    return cost, max_succ, devices, num_devices


def _check_plan(result: DPResult, cost, max_succ, devices, num_devices, micro_batches) -> None:
    num_layers = cost.shape[0]
    stages = result.stages
    assert stages[0].start_layer == 0 and stages[-1].end_layer_exclusive == num_layers
    for before, after in zip(stages[:-1], stages[1:], strict=True):
        assert before.end_layer == after.start_layer
    assert sum(devices[s.submesh_index] for s in stages) == num_devices
    for q, s in enumerate(stages):
        key = (s.start_layer, s.end_layer - 1, s.submesh_index)
        assert len(stages) - 1 - q <= max_succ[key]
        assert result.stage_costs[q] == cost[key]
    assert result.t_max == max(result.stage_costs)
    expected = sum(result.stage_costs) + (micro_batches - 1) * result.t_max
    assert result.total_seconds == pytest.approx(expected)


@pytest.mark.parametrize("force_stages", [False, True])
def test_stage_dp_matches_brute_force(force_stages):
    rng = np.random.default_rng(11 if force_stages else 3)
    solved = 0
    for _ in range(200):
        cost, max_succ, devices, num_devices = _random_case(rng)
        micro_batches = int(rng.choice([1, 2, 4, 8]))
        num_stages = int(rng.integers(1, cost.shape[0] + 1)) if force_stages else None
        args = (cost, max_succ, devices, num_devices, micro_batches)
        # Forced stage counts run with the default cap gap (1e-6), the others with none.
        got = stage_dp(*args, num_stages=num_stages, epsilon_tmax=1e-6 if force_stages else 0.0)
        want = stage_dp_brute_force(*args, num_stages=num_stages)
        assert (got is None) == (want is None)
        if want is None:
            continue
        solved += 1
        assert got is not None
        assert got.total_seconds == pytest.approx(want.total_seconds, rel=1e-12)
        _check_plan(got, cost, max_succ, devices, num_devices, micro_batches)
        if num_stages is not None:
            assert len(got.stages) == num_stages
    assert solved >= 60


def test_stage_dp_matches_brute_force_on_medium_cases():
    rng = np.random.default_rng(5)
    for _ in range(6):
        cost, max_succ, devices, num_devices = _random_case(rng, max_layers=7, max_choices=3)
        args = (cost, max_succ, devices, num_devices, int(rng.choice([2, 4, 16])))
        got, want = stage_dp(*args), stage_dp_brute_force(*args)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got.total_seconds == pytest.approx(want.total_seconds, rel=1e-9)


def _mixed_case(rng: np.random.Generator):
    """Two pools: a fast one and a slow one, each with its own submesh choices (the
    same layers cost ``speed`` times more on the slow pool's choices)."""
    num_layers = int(rng.integers(1, 6))
    per_pool = [sorted(int(n) for n in rng.choice([1, 2, 4], size=int(rng.integers(1, 3)), replace=False))
                for _ in range(2)]
    devices = [n for choices in per_pool for n in choices]
    pools = [p for p, choices in enumerate(per_pool) for _ in choices]
    sizes = [int(sum(rng.choice(choices, size=int(rng.integers(1, 3))))) for choices in per_pool]
    base = rng.uniform(0.1, 4.0, size=(num_layers, num_layers, len(devices)))
    speed = np.array([1.0 if p == 0 else float(rng.uniform(1.2, 3.0)) for p in pools])
    cost = base / np.asarray(devices) * speed
    cost[rng.random(cost.shape) < 0.1] = np.inf
    cost[np.tril_indices(num_layers, -1)] = np.inf
    max_succ = rng.integers(-1, num_layers + 1, size=cost.shape)
    max_succ[rng.random(cost.shape) < 0.6] = num_layers
    return cost, max_succ, devices, pools, sizes


@pytest.mark.parametrize("targets", ["whole-or-none", "both-whole"])
def test_the_dp_over_two_pools_matches_brute_force(targets):
    """Each pool's devices are a dimension of the DP's state: the plan found is the
    best of every split into stages, every submesh of either pool per stage, and
    every use of the pools the targets allow."""
    rng = np.random.default_rng(17 if targets == "both-whole" else 23)
    solved = mixed = 0
    for _ in range(150):
        cost, max_succ, devices, pools, sizes = _mixed_case(rng)
        b = int(rng.choice([1, 2, 4, 8]))
        wanted = [tuple(sizes)] if targets == "both-whole" else [(sizes[0], 0), (0, sizes[1]), tuple(sizes)]
        got = stage_dp_pools(cost, max_succ, devices, pools, sizes, b,
                             targets=None if targets == "whole-or-none" else wanted, epsilon_tmax=0.0)
        want = stage_dp_brute_force(cost, max_succ, devices, sum(sizes), b, submesh_pools=pools,
                                    targets=wanted)
        assert (got is None) == (want is None)
        if got is None or want is None:
            continue
        solved += 1
        assert got.total_seconds == pytest.approx(want.total_seconds, rel=1e-12)
        used = [0, 0]
        for stage in got.stages:
            used[pools[stage.submesh_index]] += devices[stage.submesh_index]
        assert tuple(used) in wanted
        mixed += all(used)
    assert solved >= 50 and mixed >= 10


def test_one_pool_through_the_pools_entry_is_alpas_dp():
    rng = np.random.default_rng(29)
    for _ in range(60):
        cost, max_succ, devices, num_devices = _random_case(rng)
        b = int(rng.choice([1, 4]))
        one = stage_dp(cost, max_succ, devices, num_devices, b)
        pooled = stage_dp_pools(cost, max_succ, devices, [0] * len(devices), [num_devices], b)
        assert (one is None) == (pooled is None)
        if one is not None and pooled is not None:
            assert pooled.stages == one.stages and pooled.total_seconds == one.total_seconds


def test_the_slow_pool_gets_fewer_layers():
    """Four equal layers, two pools of one device: the second pool is three times
    slower. Two stages, one per pool, are best when the slow one takes one layer
    (3 + 3 = 6 per micro-batch, bottleneck 3), not two (2 + 6)."""
    cost = np.full((4, 4, 2), np.inf)
    for i in range(4):
        for j in range(i, 4):
            cost[i, j] = [(j - i + 1) * 1.0, (j - i + 1) * 3.0]
    result = stage_dp_pools(cost, np.full(cost.shape, 4), [1, 1], [0, 1], [1, 1], 8, targets=[(1, 1)])
    assert result is not None
    layers = {s.submesh_index: s.end_layer - s.start_layer for s in result.stages}
    assert layers == {0: 3, 1: 1}  # either order: the same step
    assert result.total_seconds == 3 + 3 + 7 * 3


def test_stage_dp_worked_example_from_the_docstring():
    cost = np.array([[[1.0], [2.0]], [[np.inf], [1.0]]])
    result = stage_dp(cost, np.full(cost.shape, 5), [1], 2, 4)
    assert result is not None
    assert result.stages == (StageChoice(0, 1, 0), StageChoice(1, 2, 0))
    assert result.total_seconds == 5.0


def test_memory_limits_push_work_to_later_stages():
    # Two layers, two 1-device stages or one 2-device stage. The 2-device stage is
    # slow; the first stage can only hold its own micro-batch (no stage after it).
    cost = np.full((2, 2, 2), np.inf)
    cost[0, 0, 0] = cost[1, 1, 0] = 1.0
    cost[0, 1, 1] = 5.0
    max_succ = np.full(cost.shape, 1)
    assert stage_dp(cost, max_succ, [1, 2], 2, 8).total_seconds == 2 + 7 * 1
    max_succ[0, 0, 0] = 0
    assert stage_dp(cost, max_succ, [1, 2], 2, 8).total_seconds == 5 + 7 * 5
    max_succ[0, 1, 1] = -1
    assert stage_dp(cost, max_succ, [1, 2], 2, 8) is None


def test_stage_dp_rejects_malformed_input():
    cost = np.ones((2, 2, 1))
    with pytest.raises(ValueError, match="max_n_succ_stages"):
        stage_dp(cost, np.ones((2, 2, 2)), [1], 1, 1)
    with pytest.raises(ValueError, match="submesh_devices"):
        stage_dp(cost, np.ones((2, 2, 1)), [1, 2], 1, 1)
    with pytest.raises(ValueError, match="num_micro_batches"):
        stage_dp(cost, np.ones((2, 2, 1)), [1], 1, 0)


def _gpt_like_costs(num_layers: int = 48):
    """A 48-layer, 7-choice, 64-device instance shaped like GPT on 8 x 8 GPUs."""
    devices = np.array([1, 2, 4, 8, 16, 32, 64])
    work = np.ones(num_layers)
    work[0], work[-1] = 1.3, 1.6
    prefix = np.r_[0.0, np.cumsum(work)]
    lo, hi = np.triu_indices(num_layers)
    span = (prefix[hi + 1] - prefix[lo])[:, None]
    count = (hi - lo + 1)[:, None]
    efficiency = 1 / (1 + 0.08 * np.log2(devices)) * np.where(devices > 8, 0.85, 1.0)
    cost = np.full((num_layers, num_layers, devices.size), np.inf)
    cost[lo, hi] = span / (devices * efficiency) + 0.002 * count * np.log2(devices + 1) + 0.01
    free = 80e9 - 1.6e9 * 16 * count / devices
    max_succ = np.full(cost.shape, -1)
    max_succ[lo, hi] = np.where(free > 0, np.floor(free / (0.9e9 * count / devices)) - 1, -1)
    return cost, np.minimum(max_succ, 1000), devices


def test_stage_dp_runs_at_gpt_scale():
    # L = 48, S = 7, 64 devices; no timing assert here (timings are in the report).
    cost, max_succ, devices = _gpt_like_costs()
    for micro_batches in (1, 16, 128):
        result = stage_dp(cost, max_succ, devices, 64, micro_batches)
        assert result is not None
        _check_plan(result, cost, max_succ, devices, 64, micro_batches)


def test_submesh_choices():
    assert submesh_choices(1, 1) == [(1, 1)]
    assert submesh_choices(2, 4) == [(1, 1), (1, 2), (1, 4), (2, 4)]
    assert submesh_choices(3, 8)[-2:] == [(2, 8), (3, 8)]
    with pytest.raises(ValueError, match="power of two"):
        submesh_choices(2, 6)


def test_assign_submeshes_tiles_without_overlap():
    assert assign_submeshes([(1, 2), (1, 4), (1, 2)], 1, 8) == [
        [(0, 4), (0, 5)],
        [(0, 0), (0, 1), (0, 2), (0, 3)],
        [(0, 6), (0, 7)],
    ]
    rng = np.random.default_rng(2)
    for _ in range(200):
        nodes, per_node = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4, 8]))
        choices = submesh_choices(nodes, per_node)
        shapes, left = [], nodes * per_node
        while left:
            fitting = [s for s in choices if s[0] * s[1] <= left]
            shape = fitting[int(rng.integers(len(fitting)))]
            shapes.append(shape)
            left -= shape[0] * shape[1]
        placed = assign_submeshes(shapes, nodes, per_node)
        slots = [slot for stage in placed for slot in stage]
        assert sorted(slots) == [(n, d) for n in range(nodes) for d in range(per_node)]
        for shape, stage in zip(shapes, placed, strict=True):
            assert len(stage) == shape[0] * shape[1]
            assert len({node for node, _ in stage}) == shape[0]


def test_assign_submeshes_refuses_overflow_and_unknown_shapes():
    with pytest.raises(ValueError, match="need 10 devices"):
        assign_submeshes([(1, 8), (1, 2)], 1, 8)
    with pytest.raises(ValueError, match="not one of the choices"):
        assign_submeshes([(2, 2)], 2, 4)


def test_pruned_cap_search_equals_trying_every_cap():
    # The branch and bound over caps must find what Alpa's full ascending scan finds.
    from alpajob.planner.inter_op.stage_dp import _candidates, _capped_dp, _Pools

    rng = np.random.default_rng(42)
    devices = np.array([1, 2, 4, 8])
    for _ in range(8):
        num_layers, num_devices = int(rng.integers(6, 11)), int(rng.choice([8, 16]))
        cost = rng.uniform(0.1, 5.0, (num_layers, num_layers, devices.size))
        cost[np.tril_indices(num_layers, -1)] = np.inf
        max_succ = rng.integers(-1, num_layers, cost.shape)
        micro_batches = int(rng.choice([2, 4, 32]))
        pools = _Pools.one(devices.size, num_devices)
        cand = _candidates(cost, max_succ, devices, pools)
        max_stages = min(num_layers, num_devices, int(cand.max_succ.max()) + 1)
        scan = np.inf
        for cap in np.unique(cand.cost):
            solved = _capped_dp(cand, cap, num_layers, pools, max_stages, None)
            if solved is not None:
                value, chosen = solved
                scan = min(scan, value + (micro_batches - 1) * cand.cost[chosen].max())
        result = stage_dp(cost, max_succ, devices, num_devices, micro_batches, epsilon_tmax=0.0)
        if result is None:
            assert scan == np.inf
        else:
            assert result.total_seconds == pytest.approx(scan, rel=1e-12)
            assert result.tmax_tried < np.unique(cand.cost).size


def test_alpa_stage_construction_case_is_optimal():
    """Alpa's ``test_dynamic_programming`` case: 8 layers, one host of 8 devices, 16
    micro-batches, Alpa's submesh choices (1, 2, 4 and 8 devices) and one random cost
    per (layers, submesh, sharding config) from ``np.random.seed(42)``, memory never
    binding. Alpa checks its two DP implementations agree; ours is checked against
    every possible plan (the best config of each stage is its cheapest)."""
    np.random.seed(42)
    configs = 1 + sum(1 for i in range(1, 9) if 8 % i == 0)
    cost = np.random.rand(8, 8, 4, configs).min(axis=3)
    cost[np.tril_indices(8, -1)] = np.inf
    max_succ = np.full(cost.shape, 4096)
    devices = [n * m for n, m in submesh_choices(1, 8)]
    args = (cost, max_succ, devices, 8, 16)
    got, want = stage_dp(*args, epsilon_tmax=0.0), stage_dp_brute_force(*args)
    assert got is not None and want is not None
    assert got.total_seconds == pytest.approx(want.total_seconds, rel=1e-12)
    _check_plan(got, cost, max_succ, devices, 8, 16)
