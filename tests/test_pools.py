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


MIXED_JOB = """\
apiVersion: alpajob.io/v1alpha1
kind: AlpaJob
metadata:
  name: mixed-gpt
spec:
  model: {zoo: gpt, config: 350m}
  training: {globalBatchSize: 64, steps: 10, dtype: float32}
  cluster:
    pools:
      - {gpu: h100-80gb, nodes: 1, gpusPerNode: 1}
      - {gpu: a100-80gb, nodes: 1, gpusPerNode: 1}
"""


def test_a_manifest_naming_pools_is_planned_across_them(tmp_path, capsys):
    """``spec.cluster.pools``: ``alpajob plan`` plans across the pools (the table has a
    column of each stage's GPU), writes a Plan document whose stages name their pool, and a
    rerun reads it from the cache; the webhook refuses the job, which the operator
    cannot place yet, with one line naming the field."""
    from alpajob.api.plan import plan_from_json
    from alpajob.api.resource import parse_job
    from alpajob.cli.main import main
    from alpajob.operator.admission import validate_alpajob

    path = tmp_path / "job.yaml"
    path.write_text(MIXED_JOB)
    out = tmp_path / "plan.json"
    argv = ["plan", str(path), "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1x1 h100-80gb + 1x1 a100-80gb" in printed and "┃ gpu" in printed
    plan = plan_from_json(out.read_text())
    assert sorted(s.pool for s in plan.stages) == [0, 1] and [p["preset"] for p in plan.pools] == [
        "h100-80gb", "a100-80gb"]
    assert main(argv) == 0
    assert "plan: cached" in capsys.readouterr().err
    import yaml

    problems = validate_alpajob(parse_job(yaml.safe_load(MIXED_JOB)).model_dump(mode="json", by_alias=True,
                                                                                 exclude_none=True))
    assert problems == []  # the operator places it (tests/test_operator_pools.py)


@pytest.mark.parametrize(("cluster", "expected"), [
    ("{pools: [{gpu: h100-80gb}]}", "spec.cluster.pools"),
    ("{gpu: h100-80gb, pools: [{gpu: h100-80gb}, {gpu: a100-40gb}]}", "drop spec.cluster.gpu beside it"),
    ("{nodes: 4, pools: [{gpu: h100-80gb}, {gpu: a100-40gb}]}", "drop spec.cluster.nodes beside it"),
    ("{pools: [{gpu: h100-80gb}, {gpu: h100-80gb}]}", "names h100-80gb twice"),
    ("{pools: [{gpu: cpu}, {gpu: h100-80gb}]}", "a pool is of GPUs"),
    ("{pools: [{gpu: h100-80gb, gpusPerNode: 3}, {gpu: a100-40gb}]}", "must be a power of two"),
    ("{poolLinkGbps: 100}", "poolLinkGbps is the link between spec.cluster.pools"),
    ("{pools: [{gpu: h100-80gb}, {gpu: a100-40gb}], poolLinkGbps: -1}", "spec.cluster.poolLinkGbps"),
])
def test_a_bad_pool_list_is_one_line_naming_the_field(tmp_path, capsys, cluster, expected):
    from alpajob.cli.main import main

    path = tmp_path / "job.yaml"
    path.write_text(MIXED_JOB.split("  cluster:")[0] + f"  cluster: {cluster}\n")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1 and expected in err, err


def test_one_cluster_flags_are_refused_beside_pools(tmp_path, capsys):
    from alpajob.cli.main import main

    path = tmp_path / "job.yaml"
    path.write_text(MIXED_JOB)
    assert main(["plan", str(path), "--gpu", "h100-80gb"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--gpu: names one cluster, and spec.cluster.pools names several" in err, err


def test_pools_of_different_node_sizes_offer_only_their_own_devices():
    """One H100 on its node and two A100s on theirs: the plan offers 3 devices, not a
    node of 2 for each; the A100 stage's mesh is the run's devices 1 and 2, a run of
    3 devices is enough, and the picture draws 3 devices."""
    import jax
    from pools_plan import JOB, two_pool_plan

    from alpajob.api.plan import plan_from_json
    from alpajob.api.resource import parse_job
    from alpajob.cli.picture import plan_svg
    from alpajob.planner.plan.timeline import predicted_timeline
    from alpajob.trainer_image.local_run import check_plan
    from alpajob.trainer_image.planning import job_graph
    from alpajob.trainer_image.runtime.meshes import DeviceError, stage_mesh

    job = parse_job(JOB)
    plan = plan_from_json(two_pool_plan(job, per_node=(1, 2)).to_json())
    assert plan.node_devices() == [1, 2] and plan.devices_offered() == 3
    assert plan.cluster_label() == "1x1 h100-80gb + 1x2 a100-80gb"
    devices = jax.devices()[:3]
    assert [plan.device_index(*slot) for slot in plan.stages[1].device_slots] == [1, 2]
    assert list(stage_mesh(plan.stages[1], plan, devices).devices.flat) == devices[1:]
    check_plan(plan, job_graph(job), devices, "plan")
    with pytest.raises(DeviceError, match=r"needs 3 devices \(1x1 h100-80gb \+ 1x2 a100-80gb\)"):
        check_plan(plan, job_graph(job), devices[:2], "plan")
    with pytest.raises(ValueError, match="devices per node"):
        plan.device_index(0, 1)
    assert plan_svg(plan, predicted_timeline(plan)).count('class="device"') == 3


def test_pipeshard_across_pools_is_a_pipeline_and_says_so():
    """``method: pipeshard`` across pools: at least two stages, whichever pools win,
    and the Plan document names the method it was planned by."""
    graph = graph_of(resolve_model("gpt", "tiny", dtype="float32"), 16, optimizer="sgd")
    pools = [cluster_from_preset("h100-80gb", 1, 2), cluster_from_preset("a100-80gb", 1, 2)]
    planned = plan_pools(graph, pools, SearchOptions(num_micro_batches=2, method=Method.PIPESHARD))
    assert len(planned.plan.stages) >= 2 and planned.plan.method == "pipeshard"


def test_the_planner_pod_plans_the_types_the_operator_found(tmp_path, capsys, monkeypatch):
    """In the planner pod, ``ALPAJOB_POOLS`` (each type's usable nodes, the operator's
    count) replaces the spec's counts: with one type left the job is planned on it
    alone, as a job of that type; a type the spec does not name is one line."""
    from alpajob.api.plan import plan_from_json
    from alpajob.cli.main import main

    path, out = tmp_path / "job.yaml", tmp_path / "plan.json"
    path.write_text(MIXED_JOB)
    monkeypatch.setenv("ALPAJOB_POOLS", '[{"gpu": "a100-80gb", "nodes": 1, "gpusPerNode": 1}]')
    assert main(["plan", str(path), "--no-plan-cache", "--output", str(out)]) == 0
    plan = plan_from_json(out.read_text())
    assert plan.pools == [] and plan.cluster["preset"] == "a100-80gb" and plan.devices_offered() == 1
    capsys.readouterr()
    monkeypatch.setenv("ALPAJOB_POOLS", '[{"gpu": "v100-16gb"}, {"gpu": "a100-80gb"}]')
    assert main(["plan", str(path), "--no-plan-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "ALPAJOB_POOLS: names v100-16gb, which spec.cluster.pools does not" in err, err


def test_alpajob_run_of_a_job_across_types_plans_for_this_machine_s_gpus():
    """``alpajob run`` plans for the devices at hand: on GPUs of one of the job's types,
    that type's preset (an H100 machine: h100-80gb), on another GPU the first pool's
    (device kinds as JAX names them)."""
    import types

    import yaml

    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import local_cluster

    job = parse_job(yaml.safe_load(MIXED_JOB))

    def on(kind: str, platform: str = "gpu") -> str:
        return local_cluster(job, [types.SimpleNamespace(platform=platform, device_kind=kind)] * 2).preset

    assert on("NVIDIA A100-SXM4-80GB") == "a100-80gb" and on("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert on("NVIDIA L4") == "h100-80gb"
