"""Expert dimensions and the ZeRO-2 + expert-parallel baseline (DeepSpeed-MoE)."""

import pytest

from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import load_calibration, make_logical_mesh
from alpajob.planner.graph.experts import expert_count, expert_dims
from alpajob.planner.graph.opgraph import TensorRole
from alpajob.planner.intra_op.solve import ShardingMode, solve_intra_op
from alpajob.planner.plan.baselines import Baseline, has_experts
from alpajob.planner.plan.make import SearchOptions, make_plan
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model

CLUSTER = cluster_from_preset("a100-40gb", 1, 8)
CAL = load_calibration("a100-40gb")


@pytest.fixture(scope="module")
def moe_graph():
    # 4 experts: a (2, 4) logical mesh splits them over its second axis.
    return graph_of(resolve_model("moe", "tiny"), 32)


@pytest.fixture(scope="module")
def gpt_graph():
    return graph_of(resolve_model("gpt", "tiny"), 32)


def _param_names(graph, dims):
    names = dict(zip(graph.params, graph.param_names, strict=True))
    return sorted(names[p] for p in graph.params if p in dims)


def test_expert_parameters_are_found_from_the_structure(moe_graph, gpt_graph):
    dims = expert_dims(moe_graph)
    # Exactly the stacked expert weights and biases of the MoE layer, along dim 0.
    assert _param_names(moe_graph, dims) == [
        "layers/1/moe/bi", "layers/1/moe/bo", "layers/1/moe/wi", "layers/1/moe/wo"]
    assert all(dims[p] == 0 for p in moe_graph.params if p in dims)
    assert expert_count(moe_graph) == 4
    # Their optimizer state, and the dispatched tokens [e, g, c, h], follow.
    roles = {moe_graph.tensor(t).role for t in dims}
    assert TensorRole.OPT_STATE in roles and TensorRole.ACTIVATION in roles
    assert any(moe_graph.tensor(t).shape[:1] == (4,) and len(moe_graph.tensor(t).shape) == 4
               for t in dims)
    # The gate [h, e] is a plain matmul weight, not an expert.
    gate = moe_graph.params[moe_graph.param_names.index("layers/1/moe/gate")]
    assert gate not in dims
    # A dense model has none.
    assert expert_dims(gpt_graph) == {} and expert_count(gpt_graph) is None
    assert has_experts(moe_graph) and not has_experts(gpt_graph)


def _solve(graph, mode, shape=(2, 4)):
    mesh = make_logical_mesh(CLUSTER, (1, 8), shape, CAL)
    ops = range(len(graph.ops))
    return mesh, solve_intra_op(graph, ops, mesh, CLUSTER.device, CAL, mode=mode)


def test_expert_zero2_splits_experts_and_replicates_the_rest(moe_graph):
    mesh, ep = _solve(moe_graph, ShardingMode.EXPERT_ZERO2)
    _, zero2 = _solve(moe_graph, ShardingMode.ZERO2)
    dims = expert_dims(moe_graph)
    for p in moe_graph.params:
        spec = ep.specs[p]
        if p in dims:  # 4 experts over the axis of 4
            assert spec[0] == (1,), (p, spec)
            assert all(d == () for d in spec[1:])
        else:
            assert all(d == () for d in spec), (p, spec)
    # Each device holds a quarter of the experts: less weight memory than ZeRO-2,
    # the same arithmetic, and tokens pay all-to-alls to reach their experts.
    assert ep.weight_bytes < zero2.weight_bytes
    assert ep.compute_seconds == pytest.approx(zero2.compute_seconds, rel=0.05)
    assert ep.comm_seconds > zero2.comm_seconds
    # Weight-update sharding still applies (ZeRO-2's optimizer-state split).
    assert ep.weight_update_sharded


def test_expert_zero2_on_a_dense_model_is_zero2(gpt_graph):
    _, ep = _solve(gpt_graph, ShardingMode.EXPERT_ZERO2)
    _, zero2 = _solve(gpt_graph, ShardingMode.ZERO2)
    assert ep.objective == pytest.approx(zero2.objective)
    assert ep.specs == zero2.specs


def test_data_parallel_does_not_gather_the_logits(gpt_graph):
    """Regression: an elementwise op of the backward (``one_hot * broadcast(g)``) once
    followed its replicated broadcast operand in DATA mode and all-gathered the
    [batch, seq, vocab] logits gradient: an elementwise op with a batch-split operand
    must stay split (broadcasts of a scalar may stay replicated: they are free)."""
    mesh, data = _solve(gpt_graph, ShardingMode.DATA, (1, 8))
    checked = 0
    for op in gpt_graph.ops:
        if op.primitive not in ("mul", "add", "sub", "div") or len(op.inputs) != 2:
            continue
        if any(data.specs[t][:1] == ((1,),) for t in op.inputs):
            assert data.specs[op.outputs[0]][:1] == ((1,),), (op.id, op.primitive)
            checked += 1
    assert checked > 50


@pytest.mark.slow
def test_baseline_in_the_plan_document(moe_graph, gpt_graph):
    cluster = cluster_from_preset("cpu", 2, 4)
    moe = make_plan(moe_graph, cluster, SearchOptions(baselines=True)).plan
    assert Baseline.EXPERT_ZERO2.value in moe.baselines
    ep = moe.baselines[Baseline.EXPERT_ZERO2.value]
    assert ep is None or ep >= moe.predicted_step_seconds * (1 - 1e-9)
    dense = make_plan(gpt_graph, cluster_from_preset("cpu", 1, 8),
                      SearchOptions(baselines=True)).plan
    assert Baseline.EXPERT_ZERO2.value not in dense.baselines
