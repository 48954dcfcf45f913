"""Stage costing: chained layer ILPs, solution reuse, rematerialisation."""

import dataclasses

import pytest

from alpajob.api.spec import Method, Schedule
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import load_calibration, make_logical_mesh
from alpajob.planner.graph.opgraph import with_batch_size
from alpajob.planner.inter_op.clustering import cluster_layers
from alpajob.planner.inter_op.stage_costs import MEMORY_LEVELS, LayerCoster, SolveCounter
from alpajob.planner.intra_op.sharding import resharding_seconds
from alpajob.planner.intra_op.solve import ShardingMode, solve_intra_op
from alpajob.planner.plan.make import SearchOptions, make_plan
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model


@pytest.fixture(scope="module")
def gpt():
    graph = graph_of(resolve_model("gpt", {"layers": 6}, dtype="float32"), 16)
    return graph, cluster_layers(graph, 6)


@pytest.fixture(scope="module")
def cpu8():
    return cluster_from_preset("cpu", 1, 8)


def _coster(graph, layers, cluster, mode=ShardingMode.AUTO):
    return LayerCoster(graph=graph, layers=layers, cluster=cluster,
                       calibration=load_calibration(cluster.preset), mode=mode,
                       num_micro_batches=1, time_limit_s=10.0, counter=SolveCounter())


def test_identical_layers_share_solves(gpt, cpu8):
    graph, layers = gpt
    coster = _coster(graph, layers, cpu8)
    assert coster.num_classes <= 4 < coster.num_layers + 1
    coster.arrays((1, 8), (2, 4), 0)
    # Chained layers reach a fixed point: far fewer solves than layers.
    assert coster.counter.solves <= coster.num_classes + 2
    assert coster.counter.solves < coster.num_layers


def test_input_hints_are_charged(gpt, cpu8):
    graph, layers = gpt
    ops = sorted(layers[2])
    mesh = make_logical_mesh(cpu8, (1, 8), (2, 4))
    cal = load_calibration("cpu")
    free = solve_intra_op(graph, ops, mesh, cpu8.device, cal)
    activation = next(t for t in free.boundary_inputs
                      if graph.tensors[t].batch_dim is not None and len(graph.tensors[t].shape) == 3)
    chosen = free.specs[activation]
    info = graph.tensors[activation]
    candidates = [((0,), (), ()), ((1,), (), ()), ((0, 1), (), ()), ((), (), (1,)), ((), (), (0,))]
    other = max((spec for spec in candidates if spec != chosen),
                key=lambda spec: resharding_seconds(info.shape, info.dtype, spec, chosen, mesh))
    cost = resharding_seconds(info.shape, info.dtype, other, chosen, mesh)
    assert cost > 0
    hinted = solve_intra_op(graph, ops, mesh, cpu8.device, cal, input_hints={activation: other})
    # Either the hinted layout is adopted, or the layer pays to reshard away from it.
    assert hinted.objective >= free.objective - 1e-12
    assert hinted.objective <= free.objective + cost + 1e-9
    if hinted.specs[activation] != other:
        assert hinted.objective > free.objective


def test_remat_is_chosen_only_when_needed(gpt, cpu8):
    """GPipe holds every micro-batch's activations until the backward: 4 of them on
    one stage. Rematerialised, it holds only each micro-batch's stage input, plus one
    micro-batch's residuals while the backward recomputes it (one layer's at a time)."""
    graph, _ = gpt
    options = SearchOptions(method=Method.SHARD, num_micro_batches=4, schedule=Schedule.GPIPE)
    plain = make_plan(graph, cpu8, options).plan
    assert not plain.stages[0].rematerialize
    stage = plain.stages[0]
    # A device with room for the weights and two and a half micro-batches'
    # activations, not four: the planner must rematerialise (or shard more weights).
    lean_budget = stage.weight_bytes + 2.5 * stage.activation_bytes
    device = dataclasses.replace(cpu8.device, memory_bytes=int(lean_budget / 0.9))
    tight = dataclasses.replace(cpu8, device=device)
    plan = make_plan(graph, tight, options).plan
    assert plan.stages[0].rematerialize or plan.stages[0].weight_bytes < stage.weight_bytes
    assert plan.stages[0].peak_memory_bytes <= device.memory_bytes * 0.9
    assert plan.predicted_step_seconds > plain.predicted_step_seconds


def test_memory_levels_order():
    assert MEMORY_LEVELS[0].memory_weight == 0 and not MEMORY_LEVELS[0].remat
    assert any(level.remat for level in MEMORY_LEVELS)


def test_rescaled_graph_costs_less_per_micro_batch(gpt, cpu8):
    graph, layers = gpt
    full = _coster(graph, layers, cpu8)
    half = _coster(with_batch_size(graph, graph.batch_size // 2), layers, cpu8)
    a = full.evaluate_stage(0, len(layers) - 1, (1, 8), (1, 8), 0, 1)
    b = half.evaluate_stage(0, len(layers) - 1, (1, 8), (1, 8), 0, 1)
    assert b.seconds < a.seconds and b.activation_bytes < a.activation_bytes
    # The weights do not depend on the batch. (Under AUTO the ILP may shard them
    # differently at the two batch sizes, so compare plain data parallelism.)
    full_dp = _coster(graph, layers, cpu8, ShardingMode.DATA)
    half_dp = _coster(with_batch_size(graph, graph.batch_size // 2), layers, cpu8, ShardingMode.DATA)
    a = full_dp.evaluate_stage(0, len(layers) - 1, (1, 8), (1, 8), 0, 1)
    b = half_dp.evaluate_stage(0, len(layers) - 1, (1, 8), (1, 8), 0, 1)
    assert b.activation_bytes < a.activation_bytes
    assert b.weight_bytes == pytest.approx(a.weight_bytes)


def test_tied_embedding_crosses_once_per_step(gpt, cpu8):
    """GPT's token embedding is read by the first layer (the lookup) and the last (the
    LM head). Its uses and partial gradients are not activations: no cut carries them
    per micro-batch, and a stage holding the LM head but not the embedding receives the
    embedding's values once per step, as does the home stage the head's partial
    gradient, whatever the number of cuts between."""
    from alpajob.planner.graph.subset import gradient_flow, parameter_derived

    graph, layers = gpt
    coster = _coster(graph, layers, cpu8)
    n = coster.num_layers
    table = graph.params[graph.param_names.index("embed/tokens")]
    step_wise = set(gradient_flow(graph)) | parameter_derived(graph)
    shared = [(t, s, d) for t, s, d in coster.crossing_tensors(n - 1) if t in step_wise]
    assert shared, "the LM head's partial gradient of the tied embedding crosses the last cut"
    for cut in range(1, n):
        per_batch = sum(graph.tensors[t].nbytes for t, s, d in coster.crossing_tensors(cut)
                        if t not in step_wise)
        assert coster.boundary_bytes()[cut] == pytest.approx(per_batch)
    step = coster.step_transfer_table()
    vocab_bytes = graph.tensors[table].nbytes
    # Layers 0..k (the embedding's home) get the head's gradient back once per step.
    home = step[0, n - 2]
    assert home >= coster.transfer_seconds(vocab_bytes) * 0.99
    assert step[0, n - 1] == 0.0  # one stage: nothing crosses
    # Splitting at any cut costs the home the same per step, not once per cut.
    assert step[0, 0] == pytest.approx(step[0, n - 2])
    seconds_one, update_one, *_ = coster.range_table((1, 8), (2, 4), 0)
    whole = coster.evaluate_stage(0, n - 2, (1, 8), (2, 4), 0, 1)
    assert whole.update == pytest.approx(update_one[0, n - 2])
