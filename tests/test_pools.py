"""Planning across pools of different GPUs (planner/inter_op/pools.py): the slower type
gets fewer layers, the plan is never slower than either pool's own plan, a receive
from another pool is costed on the link between pools, and what cannot be mixed is
refused with the field."""

from __future__ import annotations

import pytest

from alpajob.api.errors import ClusterError, ManifestError
from alpajob.api.spec import Method
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.inter_op.pools import PoolSearch, pool_link
from alpajob.planner.inter_op.search import dp_candidate
from alpajob.planner.intra_op.solve import ShardingMode
from alpajob.planner.plan.make import SearchOptions
from alpajob.planner.plan.pools import plan_pools, pool_contexts
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model

EIGHT = SearchOptions(num_micro_batches=8)


@pytest.fixture(scope="module")
def graph():
    return graph_of(resolve_model("gpt", "350m"), 64)


@pytest.fixture(scope="module")
def h100_a100():
    return [cluster_from_preset("h100-80gb", 1, 1), cluster_from_preset("a100-80gb", 1, 1)]


def test_the_slower_type_gets_fewer_layers_and_the_step_beats_each_pool_alone(graph, h100_a100):
    planned = plan_pools(graph, h100_a100, EIGHT)
    plan = planned.candidate
    assert plan.devices_used(2) == (1, 1), planned.stage_lines()
    layers = {pool: stage.last - stage.first + 1 for pool, stage in zip(plan.pools, plan.stages, strict=True)}
    assert layers[1] < layers[0]  # the A100 takes fewer layers than the H100
    seconds = [stage.seconds for stage in plan.stages]
    assert max(seconds) / min(seconds) < 1.3  # their latencies, not their layer counts, are even
    for context in pool_contexts(graph, h100_a100, EIGHT):
        alone = dp_candidate(context, 8)
        assert alone is not None and plan.step_seconds < alone.step_seconds


def test_a_receive_from_another_pool_is_costed_on_the_link_between_pools(graph, h100_a100):
    contexts = pool_contexts(graph, h100_a100, EIGHT)
    slow = 5e9  # bytes/s between the pools (40 Gb/s): slower than either pool's own links
    search = PoolSearch(contexts, pool_link(h100_a100, slow))
    planned = search.candidate(8)
    assert planned is not None and planned.devices_used(2) == (1, 1)
    (first, second), pools = planned.stages, planned.pools
    coster = contexts[pools[1]].coster(8, ShardingMode.AUTO)
    sent = coster.boundary_bytes()[second.first]
    latency = max(c.inter_node_latency for c in h100_a100)
    assert second.transfer == pytest.approx(latency + sent / slow)
    assert first.transfer == 0.0
    # Far slower still, and the plan stays in one pool.
    stuck = PoolSearch(pool_contexts(graph, h100_a100, EIGHT), pool_link(h100_a100, 1e5)).candidate(8)
    assert stuck is not None and 0 in stuck.devices_used(2)


def test_what_cannot_be_mixed_is_refused_with_the_field(graph, h100_a100):
    with pytest.raises(ClusterError, match="spec.cluster.pools"):
        plan_pools(graph, [h100_a100[0], cluster_from_preset("cpu", 1, 2)], EIGHT)
    with pytest.raises(ManifestError, match="spec.parallelism.method"):
        plan_pools(graph, h100_a100, SearchOptions(method=Method.SHARD))
    with pytest.raises(ValueError, match="at least two pools"):
        PoolSearch(pool_contexts(graph, h100_a100[:1], EIGHT), pool_link(h100_a100))


def test_a_plan_across_pools_is_a_plan_document_and_trains_as_the_serial_run(tmp_path):
    """A two-stage plan with one stage on each pool (2 H100s, 2 A100s): the Plan
    document names each stage's pool and numbers the pools' nodes one after the
    other; on 4 of this machine's CPU devices it trains GPT-tiny three steps with the
    losses and parameters of the serial run."""
    import numpy as np
    from pools_plan import JOB, two_pool_plan

    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.plan import plan_from_json
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run

    job = parse_job(JOB)
    plan = plan_from_json(two_pool_plan(job).to_json())
    assert [s.pool for s in plan.stages] == [0, 1]
    assert [p["preset"] for p in plan.pools] == ["h100-80gb", "a100-80gb"]
    assert plan.stages[0].device_slots == [(0, 0), (0, 1)] and plan.stages[1].device_slots == [(1, 0), (1, 1)]
    assert plan.resharding and all(t.predicted_seconds > 0 for t in plan.resharding)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    parallel = run(job, TrainOptions(steps=3, plan_file=str(path)))
    serial = run(job, TrainOptions(steps=3, serial=True, planning=PlanOptions(ilp_time_limit=5.0)))
    np.testing.assert_allclose(parallel.losses, serial.losses, rtol=1e-5)
    assert parallel.losses[0] != parallel.losses[-1]
    for name, value in serial.params.items():
        np.testing.assert_allclose(parallel.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
