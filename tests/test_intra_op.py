"""The intra-op sharding ILP (Alpa eq. 1): brute force, closed forms, known optima.

Graphs are built by hand (plain data, no JAX) with :class:`GraphBuilder`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from alpajob.api.errors import InfeasibleError
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import (
    LogicalMesh,
    MeshAxis,
    all_reduce_seconds,
    load_calibration,
    make_logical_mesh,
    op_seconds,
)
from alpajob.planner.graph.opgraph import DTYPE_BYTES, Op, OpGraph, Phase, Tensor, TensorRole
from alpajob.planner.graph.subset import GraphIndex, analyse_subset
from alpajob.planner.intra_op import ilp
from alpajob.planner.intra_op.follow import follow_strategy
from alpajob.planner.intra_op.op_tables import TableCache, data_spec
from alpajob.planner.intra_op.sharding import resharding_seconds, tiling_specs
from alpajob.planner.intra_op.solve import (
    ShardingMode,
    SolveContext,
    SolveStatus,
    brute_force_intra_op,
    solve_intra_op,
)
from alpajob.planner.intra_op.strategies import op_kind, op_strategies

CLUSTER = cluster_from_preset("v100-16gb", 1)
DEVICE = CLUSTER.device
CAL = load_calibration("v100-16gb")


class GraphBuilder:
    """Hand-built :class:`OpGraph` s: tensors and ops appended in program order."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []
        self.params: list[int] = []
        self.opt_state: list[int] = []
        self.batch: list[int] = []

    def tensor(
        self,
        shape: Sequence[int],
        role: TensorRole = TensorRole.ACTIVATION,
        dtype: str = "float32",
        batch_dim: int | None = None,
    ) -> int:
        self.tensors.append(Tensor(len(self.tensors), tuple(shape), dtype, role, batch_dim))
        return len(self.tensors) - 1

    def param(self, shape: Sequence[int], dtype: str = "float32") -> int:
        t = self.tensor(shape, TensorRole.PARAM, dtype)
        self.params.append(t)
        return t

    def state(self, shape: Sequence[int]) -> int:
        t = self.tensor(shape, TensorRole.OPT_STATE, "float32")
        self.opt_state.append(t)
        return t

    def input(self, shape: Sequence[int], dtype: str = "float32", batch_dim: int = 0) -> int:
        t = self.tensor(shape, TensorRole.BATCH, dtype, batch_dim)
        self.batch.append(t)
        return t

    def op(
        self,
        primitive: str,
        inputs: Sequence[int],
        shape: Sequence[int],
        phase: Phase = Phase.FORWARD,
        params: tuple = (),
        batch_dim: int | None = None,
        flops: float | None = None,
    ) -> int:
        dtype = self.tensors[inputs[0]].dtype if inputs else "float32"
        out = self.tensor(shape, TensorRole.ACTIVATION, dtype, batch_dim)
        size = math.prod(shape)
        nbytes = sum(self._nbytes(t) for t in (*inputs, out))
        self.ops.append(
            Op(
                len(self.ops),
                primitive,
                tuple(inputs),
                (out,),
                float(size if flops is None else flops),
                float(nbytes),
                phase,
                len(self.ops) if phase is Phase.FORWARD else 0,
                tuple(sorted(params)),
            )
        )
        return out

    def _nbytes(self, t: int) -> int:
        tensor = self.tensors[t]
        return math.prod(tensor.shape) * DTYPE_BYTES[tensor.dtype]

    def dot(
        self,
        lhs: int,
        rhs: int,
        contract: tuple[tuple[int, ...], tuple[int, ...]],
        phase: Phase = Phase.FORWARD,
        batch_dim: int | None = None,
    ) -> int:
        a, b = self.tensors[lhs].shape, self.tensors[rhs].shape
        lf = [a[d] for d in range(len(a)) if d not in contract[0]]
        rf = [b[d] for d in range(len(b)) if d not in contract[1]]
        depth = math.prod(a[d] for d in contract[0])
        shape = lf + rf
        return self.op(
            "dot_general",
            (lhs, rhs),
            shape,
            phase,
            (("batch", ((), ())), ("contracting", contract)),
            batch_dim,
            flops=2.0 * math.prod(shape) * depth,
        )

    def build(self, loss: int, grads: Sequence[int] = (), new_params: Sequence[int] = ()) -> OpGraph:
        return OpGraph(
            name="hand",
            ops=tuple(self.ops),
            tensors=tuple(self.tensors),
            params=tuple(self.params),
            opt_state=tuple(self.opt_state),
            batch=tuple(self.batch),
            loss=loss,
            grads=tuple(grads),
            new_params=tuple(new_params),
            batch_size=self.batch_size,
        )


def mlp_training_graph(
    batch: int, d: int, h: int, dtype: str = "float32", with_state: bool = False
) -> OpGraph:
    """Two-layer MLP: forward, backward (dW = x^T dh) and an SGD/momentum update."""
    g = GraphBuilder(batch)
    x = g.input((batch, d), dtype)
    w1 = g.param((d, h), dtype)
    w2 = g.param((h, d), dtype)
    m1 = g.state((d, h)) if with_state else None
    m2 = g.state((h, d)) if with_state else None
    hid = g.dot(x, w1, ((1,), (0,)), batch_dim=0)
    act = g.op("tanh", (hid,), (batch, h), batch_dim=0)
    y = g.dot(act, w2, ((1,), (0,)), batch_dim=0)
    sq = g.op("mul", (y, y), (batch, d), batch_dim=0)
    per_example = g.op("reduce_sum", (sq,), (batch,), params=(("axes", (1,)),), batch_dim=0)
    loss = g.op("reduce_sum", (per_example,), (), params=(("axes", (0,)),))
    bwd = Phase.BACKWARD
    dy = g.op("mul", (y,), (batch, d), bwd, batch_dim=0)
    dw2 = g.dot(act, dy, ((0,), (0,)), bwd)
    dact = g.dot(dy, w2, ((1,), (1,)), bwd, batch_dim=0)
    dhid = g.op("mul", (dact, act), (batch, h), bwd, batch_dim=0)
    dw1 = g.dot(x, dhid, ((0,), (0,)), bwd)
    new = []
    for w, dw, m in ((w1, dw1, m1), (w2, dw2, m2)):
        shape = g.tensors[w].shape
        if m is not None:
            decayed = g.op("mul", (m,), shape, Phase.UPDATE)
            moment = g.op("add", (decayed, dw), shape, Phase.UPDATE)
            step = g.op("mul", (moment,), shape, Phase.UPDATE)
        else:
            step = g.op("mul", (dw,), shape, Phase.UPDATE)
        new.append(g.op("sub", (w, step), shape, Phase.UPDATE))
    return g.build(loss, grads=(dw1, dw2), new_params=new)


def toy_mesh(shape: tuple[int, int]) -> LogicalMesh:
    return LogicalMesh(
        submesh=(1, shape[0] * shape[1]),
        shape=shape,
        axes=(MeshAxis(shape[0], 2e-5, 2e-10), MeshAxis(shape[1], 1e-5, 1e-10)),
        all_to_all_penalty=2.0,
    )


def all_ops(graph: OpGraph) -> list[int]:
    return list(range(len(graph.ops)))


# ---------------------------------------------------------------- random graphs


def random_forward_graph(rng: np.random.Generator, max_dots: int) -> OpGraph:
    """A chain/DAG of dots, elementwise ops, bias adds, a transpose and reductions."""
    batch = int(rng.choice([4, 8, 16]))
    rank3 = rng.random() < 0.3
    seq = int(rng.choice([2, 4])) if rank3 else 0
    g = GraphBuilder(batch)
    lead = (batch, seq) if rank3 else (batch,)
    width = int(rng.choice([4, 6, 8, 12]))
    cur = g.input((*lead, width))
    history = [cur]
    for _ in range(int(rng.integers(1, max_dots + 1))):
        out_width = int(rng.choice([4, 6, 8, 16]))
        w = g.param((width, out_width))
        cur = g.dot(cur, w, ((len(lead),), (0,)), batch_dim=0)
        width = out_width
        shape = (*lead, width)
        if rng.random() < 0.5:
            cur = g.op(str(rng.choice(["tanh", "exp", "neg"])), (cur,), shape, batch_dim=0)
        if rng.random() < 0.3:
            bias = g.param((width,))
            dims = (("broadcast_dimensions", (len(lead),)), ("shape", shape))
            wide = g.op("broadcast_in_dim", (bias,), shape, params=dims, batch_dim=0)
            cur = g.op("add", (cur, wide), shape, batch_dim=0)
        same = [t for t in history if g.tensors[t].shape == shape]
        if same and rng.random() < 0.5:
            cur = g.op("add", (cur, same[int(rng.integers(len(same)))]), shape, batch_dim=0)
        history.append(cur)
    shape = g.tensors[cur].shape
    if rng.random() < 0.3 and not rank3:
        cur = g.op("transpose", (cur,), shape[::-1], params=(("permutation", (1, 0)),),
                   batch_dim=1)
        cur = g.op("reduce_max", (cur,), (batch,), params=(("axes", (0,)),), batch_dim=0)
    else:
        axes = tuple(range(1, len(shape)))
        cur = g.op("reduce_sum", (cur,), (batch,), params=(("axes", axes),), batch_dim=0)
    loss = g.op("reduce_sum", (cur,), (), params=(("axes", (0,)),))
    return g.build(loss)


def random_training_graph(rng: np.random.Generator) -> OpGraph:
    """One dense layer with its backward dot and a momentum update (param consistency)."""
    batch = int(rng.choice([4, 8]))
    d, e = int(rng.choice([4, 8, 6])), int(rng.choice([4, 8]))
    g = GraphBuilder(batch)
    x = g.input((batch, d))
    w = g.param((d, e))
    m = g.state((d, e))
    y = g.dot(x, w, ((1,), (0,)), batch_dim=0)
    sq = g.op("mul", (y, y), (batch, e), batch_dim=0)
    loss = g.op("reduce_sum", (sq,), (), params=(("axes", (0, 1)),))
    dy = g.op("add", (y, y), (batch, e), Phase.BACKWARD, batch_dim=0)
    dw = g.dot(x, dy, ((0,), (0,)), Phase.BACKWARD)
    decayed = g.op("mul", (m,), (d, e), Phase.UPDATE)
    moment = g.op("add", (decayed, dw), (d, e), Phase.UPDATE)
    new_w = g.op("sub", (w, moment), (d, e), Phase.UPDATE)
    return g.build(loss, grads=(dw,), new_params=(new_w,))


def _required_bytes(graph: OpGraph, mesh: LogicalMesh, **kwargs) -> float:
    with pytest.raises(InfeasibleError) as info:
        solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=1.0,
                       **kwargs)
    return info.value.required_bytes


def test_ilp_matches_brute_force_on_random_graphs():
    rng = np.random.default_rng(7)
    checked = graphs = 0
    for case in range(60):
        if graphs == 24:
            break
        shape = (2, 2) if case % 2 == 0 else (1, 4)
        mesh = toy_mesh(shape)
        if case % 5 == 4:
            graph = random_training_graph(rng)
        else:
            graph = random_forward_graph(rng, max_dots=2 if shape == (2, 2) else 3)
        kwargs = dict(
            num_micro_batches=int(rng.choice([1, 2, 4])),
            activation_multiplier=int(rng.choice([1, 2])),
            memory_weight=float(rng.choice([0.0, 1e-9])),
        )
        try:
            unconstrained = brute_force_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, **kwargs)
        except ValueError:  # too many combinations to enumerate: draw another graph
            continue
        graphs += 1
        required = _required_bytes(graph, mesh, **kwargs)
        budgets = [None, required * float(rng.uniform(1.0, 1.6))]
        for budget in budgets:
            expected = unconstrained if budget is None else brute_force_intra_op(
                graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=budget, **kwargs
            )
            for presolve in (True, False):
                result = solve_intra_op(
                    graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=budget,
                    presolve=presolve, **kwargs,
                )
                assert result.objective == pytest.approx(expected, rel=1e-6, abs=1e-12), (
                    case, budget, presolve
                )
                memory = result.memory_bytes(kwargs["activation_multiplier"])
                if budget is not None:
                    assert memory <= budget * (1 + 1e-9)
                if not result.weight_update_sharded:
                    # The op-by-op read-back agrees with the ILP's aggregated tables.
                    realised = (
                        result.compute_seconds
                        + result.comm_seconds
                        + result.update_seconds / kwargs["num_micro_batches"]
                        + (kwargs["memory_weight"] + 1e-18) * memory
                    )
                    assert realised == pytest.approx(result.objective, rel=1e-9, abs=1e-15)
            checked += 1
    assert graphs >= 20 and checked == 2 * graphs


def test_infeasible_budget_matches_brute_force():
    rng = np.random.default_rng(3)
    graph = random_training_graph(rng)
    mesh = toy_mesh((2, 2))
    with pytest.raises(InfeasibleError) as ilp:
        solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=10.0)
    with pytest.raises(InfeasibleError) as brute:
        brute_force_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=10.0)
    assert ilp.value.required_bytes == pytest.approx(brute.value.required_bytes)
    assert ilp.value.available_bytes == 10.0
    assert "GiB per device" in str(ilp.value)


def test_cbc_solver_path_matches_brute_force():
    rng = np.random.default_rng(5)
    graph = random_forward_graph(rng, max_dots=2)
    mesh = toy_mesh((2, 2))
    expected = brute_force_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL)
    result = solve_intra_op(
        graph, all_ops(graph), mesh, DEVICE, CAL, solver="cbc", presolve=False
    )
    assert result.stats.solver == "cbc"
    assert result.stats.num_variables > 0
    assert result.objective == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="solver"):
        solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, solver="gurobi")


def test_presolve_skips_the_solver_on_a_chain():
    graph = random_forward_graph(np.random.default_rng(1), max_dots=1)
    result = solve_intra_op(graph, all_ops(graph), toy_mesh((2, 2)), DEVICE, CAL)
    assert result.stats.status is SolveStatus.PRESOLVED
    assert result.stats.num_variables == 0
    assert result.stats.num_nodes >= 2


# ---------------------------------------------------------------- closed forms


def _base(op: Op, graph: OpGraph) -> float:
    dtype = graph.tensors[op.inputs[0]].dtype
    return op_seconds(op.primitive, op.flops, op.bytes_accessed, dtype, DEVICE, CAL)


def test_data_parallel_mlp_closed_form():
    n = 8
    graph = mlp_training_graph(batch=1024, d=64, h=64)
    mesh = make_logical_mesh(CLUSTER, (1, n), (1, n), CAL)
    result = solve_intra_op(
        graph, all_ops(graph), mesh, DEVICE, CAL, mode=ShardingMode.DATA, num_micro_batches=4
    )
    sync = sum(
        all_reduce_seconds(mesh, (1,), graph.tensors[p].nbytes) for p in graph.params
    )
    update_compute = sum(_base(op, graph) for op in graph.ops if op.phase is Phase.UPDATE)
    compute = sum(_base(op, graph) for op in graph.ops if op.phase is not Phase.UPDATE) / n
    assert result.update_seconds == pytest.approx(sync + update_compute)
    assert result.compute_seconds == pytest.approx(compute)
    # The only per-micro-batch communication is the all-reduce of the scalar loss.
    assert result.comm_seconds == pytest.approx(all_reduce_seconds(mesh, (1,), 4.0))
    assert result.objective == pytest.approx(
        result.compute_seconds + result.comm_seconds + result.update_seconds / 4
    )
    x = graph.batch[0]
    assert result.specs[x] == ((1,), ())
    assert all(result.specs[p] == ((), ()) for p in graph.params)
    assert result.weight_update_sharded == ()
    weights = 2 * sum(graph.tensors[p].nbytes for p in graph.params)  # params + grads
    assert result.weight_bytes == pytest.approx(weights)


def test_megatron_split_wins_with_big_weights_and_small_batch():
    graph = mlp_training_graph(batch=8, d=8192, h=32768, dtype="float16")
    mesh = make_logical_mesh(CLUSTER, (1, 8), (1, 8), CAL)
    auto = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL)
    w1, w2 = graph.params
    assert auto.specs[w1] == ((), (1,))  # column split
    assert auto.specs[w2] == ((1,), ())  # row split
    data = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, mode=ShardingMode.DATA)
    assert auto.objective < 0.5 * data.objective
    assert auto.weight_bytes < data.weight_bytes / 4


def test_data_parallel_wins_with_small_weights_and_big_batch():
    graph = mlp_training_graph(batch=4096, d=128, h=128)
    mesh = make_logical_mesh(CLUSTER, (1, 8), (1, 8), CAL)
    auto = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL)
    assert all(auto.specs[p] == ((), ()) for p in graph.params)
    assert auto.specs[graph.batch[0]] == ((1,), ())
    data = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, mode=ShardingMode.DATA)
    assert auto.objective <= data.objective * (1 + 1e-9)


def test_partition_specs_of_a_result():
    graph = mlp_training_graph(batch=8, d=8192, h=32768, dtype="float16")
    mesh = make_logical_mesh(CLUSTER, (1, 8), (1, 8), CAL)
    specs = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL).partition_specs()
    assert specs[graph.params[0]] == (None, "y")


# ---------------------------------------------------------------- memory budget


def test_memory_budget_below_minimum_raises():
    graph = mlp_training_graph(batch=4096, d=128, h=128, with_state=True)
    mesh = make_logical_mesh(CLUSTER, (1, 8), (2, 4), CAL)
    with pytest.raises(InfeasibleError) as info:
        solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=1024.0)
    err = info.value
    assert err.available_bytes == 1024.0
    assert err.required_bytes > 1024.0
    assert "GiB per device" in str(err) and "budget" in str(err)
    # The least memory is what the memory-minimising ILP finds, and it is feasible.
    fits = solve_intra_op(
        graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=err.required_bytes * 1.0001
    )
    assert fits.memory_bytes() <= err.required_bytes * 1.0001


def test_memory_budget_forces_more_sharding():
    graph = mlp_training_graph(batch=4096, d=128, h=128, with_state=True)
    mesh = make_logical_mesh(CLUSTER, (1, 8), (2, 4), CAL)
    free = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, mode=ShardingMode.DATA)
    least = _required_bytes(graph, mesh)
    budget = (least + free.memory_bytes()) / 2
    tight = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, memory_budget_bytes=budget)
    assert tight.memory_bytes() <= budget
    assert tight.memory_bytes() < free.memory_bytes()
    auto = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL)
    assert tight.objective >= auto.objective * (1 - 1e-9)
    # An activation multiplier counts the residuals that many times.
    doubled = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, activation_multiplier=2)
    assert doubled.memory_bytes(2) == pytest.approx(
        doubled.weight_bytes + 2 * doubled.activation_bytes
    )
    assert doubled.activation_bytes > 0


def test_memory_weight_trades_time_for_memory():
    graph = mlp_training_graph(batch=4096, d=128, h=128, with_state=True)
    mesh = make_logical_mesh(CLUSTER, (1, 8), (2, 4), CAL)
    fast = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL)
    lean = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, memory_weight=1e-3)
    assert lean.memory_bytes() < fast.memory_bytes()


# ---------------------------------------------------------------- weight-update sharding


def test_weight_update_sharding_reduces_weight_bytes():
    graph = mlp_training_graph(batch=4096, d=1024, h=1024, with_state=True)
    mesh = make_logical_mesh(CLUSTER, (1, 8), (1, 8), CAL)
    results = {
        mode: solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, mode=mode,
                             num_micro_batches=2)
        for mode in ShardingMode
    }
    data = results[ShardingMode.DATA]
    zero2 = results[ShardingMode.ZERO2]
    auto = results[ShardingMode.AUTO]
    assert data.weight_update_sharded == ()
    assert set(zero2.weight_update_sharded) == set(graph.params)
    state_bytes = sum(graph.tensors[m].nbytes for m in graph.opt_state)
    assert zero2.weight_bytes == pytest.approx(data.weight_bytes - state_bytes * 7 / 8)
    assert zero2.update_seconds < data.update_seconds
    assert zero2.compute_seconds == pytest.approx(data.compute_seconds)
    for m in graph.opt_state:
        assert 1 in [k for dim in zero2.specs[m] for k in dim]
    assert auto.weight_bytes < data.weight_bytes


# ---------------------------------------------------------------- strategies


def test_dot_strategies_include_megatron_and_data_parallel():
    g = GraphBuilder(8)
    x = g.input((8, 16))
    w = g.param((16, 32))
    g.dot(x, w, ((1,), (0,)), batch_dim=0)
    graph = g.build(2)
    strategies = op_strategies(graph.ops[0], graph, toy_mesh((1, 4)), DEVICE, CAL)
    by_name = {s.name: s for s in strategies}
    assert by_name["y->r0"].input_specs == (((), ()), ((), (1,)))  # column split
    assert by_name["y->k0"].collectives[0].kind.value == "all_reduce"  # row split
    assert by_name["y->l0"].output_specs == (((1,), ()),)  # data parallel
    assert any(s.name.startswith("y->k0,rs") for s in strategies)
    rep = by_name["replicated"]
    assert rep.compute_seconds == pytest.approx(4 * by_name["y->l0"].compute_seconds)


def test_dot_operand_traffic_is_charged_per_shard_on_every_device():
    """``matmul_operand_traffic`` adds each device's lhs and rhs shard bytes, at
    memory bandwidth, to a dot's compute: a split matmul still packs its own shards,
    so compute no longer divides by the device count. Unset (0), nothing changes."""
    import dataclasses

    g = GraphBuilder(8)
    x = g.input((8, 16))
    w = g.param((16, 32))
    g.dot(x, w, ((1,), (0,)), batch_dim=0)
    graph = g.build(2)
    mesh = toy_mesh((1, 4))
    assert CAL.matmul_operand_traffic == 0.0
    plain = {s.name: s for s in op_strategies(graph.ops[0], graph, mesh, DEVICE, CAL)}
    traffic = dataclasses.replace(CAL, matmul_operand_traffic=0.5)
    priced = {s.name: s for s in op_strategies(graph.ops[0], graph, mesh, DEVICE, traffic)}
    assert priced.keys() == plain.keys()
    per_byte = 0.5 / (DEVICE.memory_bandwidth * CAL.memory_efficiency)
    lhs, rhs = 8 * 16 * 4, 16 * 32 * 4
    for name, shards in (("replicated", lhs + rhs), ("y->l0", lhs / 4 + rhs),
                         ("y->r0", lhs + rhs / 4), ("y->k0", lhs / 4 + rhs / 4)):
        assert priced[name].compute_seconds == pytest.approx(
            plain[name].compute_seconds + per_byte * shards)
        assert priced[name].comm_seconds == plain[name].comm_seconds


def test_follow_reshape_maps_clean_splits_and_replicates_others():
    g = GraphBuilder(4)
    x = g.input((4, 6, 8))
    g.op("reshape", (x,), (24, 8), params=(("new_sizes", (24, 8)),), batch_dim=0)
    graph = g.build(1)
    op, mesh = graph.ops[0], toy_mesh((2, 2))
    clean = follow_strategy(op, graph, 0, ((0,), (), (1,)), mesh, DEVICE, CAL)
    assert clean.output_specs == (((0,), (1,)),)
    assert clean.input_specs == (((0,), (), (1,)),)
    messy = follow_strategy(op, graph, 0, ((), (0,), ()), mesh, DEVICE, CAL)
    assert messy.input_specs == (((), (), ()),)  # S split must be gathered first
    assert messy.output_specs == (((), ()),)


def test_follow_reduce_all_reduces_split_dims():
    g = GraphBuilder(8)
    x = g.input((8, 16))
    g.op("reduce_sum", (x,), (8,), params=(("axes", (1,)),), batch_dim=0)
    graph = g.build(1)
    mesh = toy_mesh((2, 2))
    strategy = follow_strategy(graph.ops[0], graph, 0, ((0,), (1,)), mesh, DEVICE, CAL)
    assert strategy.output_specs == (((0,),),)
    assert strategy.collectives[0].axes == (1,)
    assert strategy.comm_seconds == pytest.approx(all_reduce_seconds(mesh, (1,), 8 * 4 / 2))


def test_unknown_op_gets_replicated_and_batch_split():
    g = GraphBuilder(8)
    x = g.input((8, 16))
    g.op("cumsum", (x,), (8, 16), params=(("axis", 1),), batch_dim=0)  # a follower
    g.op("sort", (x,), (8, 16), params=(("dimension", 1),), batch_dim=0)
    g.op("sort", (x,), (8, 16), params=(("dimension", 0),), batch_dim=0)
    graph = g.build(1)
    mesh = toy_mesh((2, 2))
    names = [s.name for s in op_strategies(graph.ops[1], graph, mesh, DEVICE, CAL)]
    assert names == ["replicated", "x->batch", "y->batch", "xy->batch"]
    along_batch = op_strategies(graph.ops[2], graph, mesh, DEVICE, CAL)
    assert [s.name for s in along_batch] == ["replicated"]
    scan = follow_strategy(graph.ops[0], graph, 0, ((0,), (1,)), mesh, DEVICE, CAL)
    assert scan.input_specs == (((0,), ()),)


def test_bad_arguments_are_refused():
    graph = mlp_training_graph(batch=8, d=8, h=8)
    mesh = toy_mesh((1, 4))
    with pytest.raises(ValueError, match="op_ids"):
        solve_intra_op(graph, [], mesh, DEVICE, CAL)
    with pytest.raises(ValueError, match="not in graph"):
        solve_intra_op(graph, [999], mesh, DEVICE, CAL)
    with pytest.raises(ValueError, match="num_micro_batches"):
        solve_intra_op(graph, [0], mesh, DEVICE, CAL, num_micro_batches=0)


# ---------------------------------------------------------------- a traced model


def test_traced_gpt_layer_in_every_mode():
    pytest.importorskip("jax")
    step = pytest.importorskip("alpajob.trainer_image.step")
    clustering = pytest.importorskip("alpajob.planner.inter_op.clustering")
    registry = pytest.importorskip("alpajob.trainer_image.zoo.registry")
    graph = step.graph_of(registry.resolve_model("gpt", "tiny"), 8)
    layer = sorted(clustering.cluster_layers(graph, 2)[0])
    for shape in ((2, 2), (1, 4)):
        mesh = make_logical_mesh(CLUSTER, (1, 4), shape, CAL)
        results = {
            mode: solve_intra_op(graph, layer, mesh, DEVICE, CAL, mode=mode, num_micro_batches=2)
            for mode in ShardingMode
        }
        auto = results[ShardingMode.AUTO]
        assert auto.objective <= results[ShardingMode.DATA].objective * (1 + 1e-9)
        assert results[ShardingMode.ZERO2].weight_bytes <= results[ShardingMode.DATA].weight_bytes
        for t in (*auto.boundary_inputs, *auto.boundary_outputs):
            assert t in auto.specs
        assert auto.stats.num_nodes < len(layer) / 3  # followers merged
        # Presolve is exact: the whole model handed to the solver gives the same optimum.
        full = solve_intra_op(graph, layer, mesh, DEVICE, CAL, num_micro_batches=2,
                              presolve=False)
        assert full.objective == pytest.approx(auto.objective, rel=1e-6)


# ---------------------------------------------------------------- shared precomputation


def _assert_same(a, b) -> None:
    """Two results of the same solve agree exactly (timings aside)."""
    for name in ("objective", "compute_seconds", "comm_seconds", "update_seconds",
                 "weight_bytes", "activation_bytes", "specs", "boundary_inputs",
                 "boundary_outputs", "weight_update_sharded", "mesh"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("num_ops", "num_nodes", "num_edges", "nodes_after_presolve",
                 "num_variables", "num_constraints", "status"):
        assert getattr(a.stats, name) == getattr(b.stats, name), name


def _hints(graph: OpGraph, op_ids: Sequence[int], mesh: LogicalMesh) -> dict:
    """Every boundary input with a batch dim arrives data-parallel."""
    inputs = analyse_subset(graph, op_ids).boundary_inputs
    return {t: data_spec(graph.tensor(t), mesh) for t in inputs
            if graph.tensor(t).batch_dim is not None}


def test_a_shared_context_gives_the_results_of_fresh_solves():
    rng = np.random.default_rng(11)
    for case in range(8):
        graph = (random_training_graph(rng) if case % 2 else
                 random_forward_graph(rng, max_dots=3))
        context = SolveContext(graph, max_models=2)
        for shape in ((2, 2), (1, 4)):
            mesh = toy_mesh(shape)
            hints = _hints(graph, all_ops(graph), mesh)
            for mode in ShardingMode:
                for kwargs in ({}, {"input_hints": hints}, {"memory_weight": 1e-9}, {}):
                    fresh = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, mode=mode,
                                           num_micro_batches=2, **kwargs)
                    shared = solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL,
                                            mode=mode, num_micro_batches=2, context=context,
                                            **kwargs)
                    _assert_same(fresh, shared)


def test_a_shared_context_on_traced_gpt_layers():
    pytest.importorskip("jax")
    step = pytest.importorskip("alpajob.trainer_image.step")
    clustering = pytest.importorskip("alpajob.planner.inter_op.clustering")
    registry = pytest.importorskip("alpajob.trainer_image.zoo.registry")
    graph = step.graph_of(registry.resolve_model("gpt", "tiny"), 8)
    context = SolveContext(graph)
    for layer in clustering.cluster_layers(graph, 2):
        for shape in ((2, 2), (1, 4)):
            mesh = make_logical_mesh(CLUSTER, (1, 4), shape, CAL)
            for kwargs in ({}, {"input_hints": _hints(graph, layer, mesh)}, {}):
                fresh = solve_intra_op(graph, layer, mesh, DEVICE, CAL, num_micro_batches=4,
                                       **kwargs)
                shared = solve_intra_op(graph, layer, mesh, DEVICE, CAL, num_micro_batches=4,
                                        context=context, **kwargs)
                _assert_same(fresh, shared)
    # A model is built once per (ops, mesh, mode) and then reused.
    layer = clustering.cluster_layers(graph, 2)[0]
    mesh = make_logical_mesh(CLUSTER, (1, 4), (2, 2), CAL)
    model = context.model(layer, mesh, DEVICE, CAL, ShardingMode.AUTO)
    assert context.model(list(reversed(layer)), mesh, DEVICE, CAL, ShardingMode.AUTO) is model


def test_the_ilp_of_a_model_is_its_tables_node_by_node_and_a_choice_is_read_once():
    """``IntraOpModel.problem`` computes every node's and edge's costs at once: the
    same arrays, bit for bit, as the formula node by node; a choice read back on a
    model is read once, for its copies with input hints too."""
    from alpajob.planner.intra_op.model import TIE_BREAK_SECONDS_PER_BYTE, build_model
    from alpajob.planner.intra_op.solve import _realise

    rng = np.random.default_rng(5)
    for case in range(6):
        graph = random_training_graph(rng) if case % 2 else random_forward_graph(rng, max_dots=3)
        mesh = toy_mesh((2, 2))
        context = SolveContext(graph)
        model = build_model(graph, all_ops(graph), mesh, DEVICE, CAL, ShardingMode.AUTO, context=context)
        for micro, multiplier, weight in ((1, 1, 0.0), (4, 3, 1e-9)):
            problem = model.problem(micro, multiplier, weight, None)
            assert len(problem.costs) == len(model.nodes) and len(problem.edges) == len(model.edges)
            for node, cost, memory in zip(model.nodes, problem.costs, problem.memory, strict=True):
                mem = node.weight_bytes + multiplier * node.activation_bytes
                want = node.compute + node.comm + node.update / micro
                want = np.where(node.allowed, want + (weight + TIE_BREAK_SECONDS_PER_BYTE) * mem, math.inf)
                assert np.array_equal(cost, want) and np.array_equal(memory, mem)
            for edge, got in zip(model.edges, problem.edges, strict=True):
                want = np.where(edge.allowed, edge.comm + edge.update / micro, math.inf)
                assert got.matrix.shape == want.shape and np.array_equal(got.matrix, want)
        choice = tuple(0 if node.allowed[0] else int(np.argmax(node.allowed)) for node in model.nodes)
        hinted = build_model(graph, all_ops(graph), mesh, DEVICE, CAL, ShardingMode.AUTO,
                             _hints(graph, all_ops(graph), mesh), context=context)
        assert hinted is not model and _realise(hinted, list(choice)) is _realise(model, choice)


def test_graph_index_answers_like_a_scan_of_the_graph():
    rng = np.random.default_rng(2)
    for _ in range(6):
        graph = random_training_graph(rng)
        index = GraphIndex.build(graph)
        ops = all_ops(graph)
        for subset in (ops, ops[: len(ops) // 2], ops[len(ops) // 2:], ops[1::2]):
            with_index = analyse_subset(graph, subset, index)
            scanned = analyse_subset(graph, subset)
            assert vars(with_index).keys() == vars(scanned).keys()
            for name, value in vars(scanned).items():
                assert getattr(with_index, name) == value, name
            outside = {t for op in graph.ops if op.id not in subset for t in op.inputs}
            read = index.read_outside(subset)
            assert {t for t in range(len(graph.tensors)) if read[t]} == outside


def test_a_context_or_index_of_another_graph_is_refused():
    graph = mlp_training_graph(batch=8, d=8, h=8)
    other = mlp_training_graph(batch=8, d=8, h=8)  # equal, but another object
    mesh = toy_mesh((1, 4))
    with pytest.raises(ValueError, match="SolveContext"):
        solve_intra_op(graph, all_ops(graph), mesh, DEVICE, CAL, context=SolveContext(other))
    with pytest.raises(ValueError, match="GraphIndex"):
        analyse_subset(graph, all_ops(graph), GraphIndex.build(other))


def test_table_cache_matches_the_functions_it_memoises():
    graph = mlp_training_graph(batch=16, d=8, h=16, with_state=True)
    mesh = toy_mesh((2, 2))
    tables = TableCache(graph, mesh, DEVICE, CAL)
    for tensor in graph.tensors:
        specs = tiling_specs(tensor.shape, mesh)
        set_id = tables.tilings(tensor.shape)
        assert tables.specs(set_id) == specs
        seconds, allowed = tables.reshard(tensor.id, set_id, set_id)
        assert allowed.all()
        for a, src in enumerate(specs):
            for b, dst in enumerate(specs):
                expected = resharding_seconds(tensor.shape, tensor.dtype, src, dst, mesh)
                assert seconds[a, b] == expected
    for op in graph.ops:
        if not op_kind(op.primitive).is_follower:
            table = tables.root(op.id)
            assert table.strategies == op_strategies(op, graph, mesh, DEVICE, CAL)
            continue
        followed = tables.tilings(graph.tensor(op.inputs[0]).shape)
        table = tables.follower(op.id, 0, followed)
        assert table.strategies == tuple(
            follow_strategy(op, graph, 0, spec, mesh, DEVICE, CAL)
            for spec in tables.specs(followed)
        )
        for position, labels in enumerate(table.inputs):
            values = tables.specs(labels.spec_set)
            assert [values[i] for i in labels.local] == [
                s.input_specs[position] for s in table.strategies
            ]


def test_table_caches_of_every_mesh_share_one_graph_s_op_structures():
    """Op structures are mesh-independent: a :class:`SolveContext` gives the table
    caches of all its meshes one :class:`OpStructures`, so each op is described once;
    a cache made alone agrees on every id; another graph's structures are refused."""
    graph = mlp_training_graph(batch=16, d=8, h=16, with_state=True)
    context = SolveContext(graph)
    a = context.tables(toy_mesh((2, 2)), DEVICE, CAL)
    b = context.tables(toy_mesh((1, 4)), DEVICE, CAL)
    assert a is not b and a.structures is b.structures
    structures = a.structures
    alone = TableCache(graph, toy_mesh((2, 2)), DEVICE, CAL)
    assert [alone.structures.of(op.id) for op in graph.ops] == [
        structures.of(op.id) for op in graph.ops]
    other = mlp_training_graph(batch=8, d=8, h=16, with_state=True)
    with pytest.raises(ValueError, match="another graph"):
        TableCache(other, toy_mesh((2, 2)), DEVICE, CAL, structures)


def test_a_context_lent_by_another_micro_batch_size_gives_the_results_of_fresh_solves():
    """The same model at another micro-batch size (``with_batch_size``) may borrow a
    context's op tables (``SolveContext(..., like=...)``): ops without a batch
    dimension (the optimizer's update) keep their structure and reuse their tables,
    ops with one get tables of their own, and every solve is a fresh one's."""
    from alpajob.planner.graph.opgraph import with_batch_size

    rng = np.random.default_rng(5)
    for case in range(6):
        graph = random_training_graph(rng) if case % 2 else mlp_training_graph(
            batch=16, d=8, h=16, with_state=True)
        root = SolveContext(graph, max_models=0)
        for shape in ((2, 2), (1, 4)):  # the lender's own solves fill its tables first
            solve_intra_op(graph, all_ops(graph), toy_mesh(shape), DEVICE, CAL, context=root)
        for batch in (graph.batch_size // 2, graph.batch_size // 4):
            small = with_batch_size(graph, batch)
            context = SolveContext(small, like=root)
            for shape in ((2, 2), (1, 4)):
                mesh = toy_mesh(shape)
                for mode in ShardingMode:
                    fresh = solve_intra_op(small, all_ops(small), mesh, DEVICE, CAL, mode=mode,
                                           num_micro_batches=2)
                    lent = solve_intra_op(small, all_ops(small), mesh, DEVICE, CAL, mode=mode,
                                          num_micro_batches=2, context=context)
                    _assert_same(fresh, lent)
    # One table per structure across both graphs: an op without a batch dim has the
    # id of its twin in the lending graph, an op with one has an id of its own.
    graph = mlp_training_graph(batch=16, d=8, h=16, with_state=True)
    small = with_batch_size(graph, 4)
    root = SolveContext(graph, max_models=0)
    lent = SolveContext(small, like=root).tables(toy_mesh((2, 2)), DEVICE, CAL)
    own = root.tables(toy_mesh((2, 2)), DEVICE, CAL)
    assert lent.graph is small and lent._followers is own._followers
    for op in graph.ops:
        tensors = [graph.tensor(t) for t in (*op.inputs, *op.outputs)]
        same = all(t.batch_dim is None for t in tensors)
        assert (lent.structures.of(op.id) == own.structures.of(op.id)) is same, op.primitive
    alone = TableCache(small, toy_mesh((2, 2)), DEVICE, CAL)
    for tensor in graph.tensors:  # sizes by tensor id are the borrower's own
        own.reshard(tensor.id, own.tilings(tensor.shape), own.tilings(tensor.shape))
        shape = small.tensor(tensor.id).shape
        mine, theirs = lent.tilings(shape), alone.tilings(shape)
        assert lent.specs(mine) == alone.specs(theirs)
        for got, expected in zip(lent.reshard(tensor.id, mine, mine),
                                 alone.reshard(tensor.id, theirs, theirs), strict=True):
            assert np.array_equal(got, expected)
    with pytest.raises(ValueError, match="rebind"):
        own.rebound(small, SolveContext(small)._structures)


@pytest.mark.parametrize("seed", range(5))
def test_merged_classes_are_numpy_s_unique_rows(seed: int):
    """:func:`ilp.merge_classes` partitions strategies as ``np.unique(axis=0)`` of
    their label rows does, in the same (lexicographic) order of merged classes."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    columns = [rng.integers(0, int(rng.integers(1, 9)), size=n) for _ in range(int(rng.integers(2, 4)))]
    rep, inverse = ilp.merge_classes(columns)
    expected_rep, expected_inverse = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
    np.testing.assert_array_equal(rep, expected_rep)
    np.testing.assert_array_equal(inverse, expected_inverse.reshape(-1))


def _reference_arrays(work: ilp._Work, budget: float | None) -> tuple:
    """The ILP arrays built row by row (what :func:`ilp._arrays` vectorises)."""
    live = [v for v, alive in enumerate(work.alive) if alive]
    cost, rows, vals, lower, upper = [], [], [], [], []
    s_columns, s_offset, column = {}, {}, 0
    for v in live:
        allowed = np.flatnonzero(np.isfinite(work.costs[v]))
        s_columns[v], s_offset[v] = allowed, column
        cost.append(work.costs[v][allowed])
        rows.append(column + np.arange(len(allowed)))
        vals.append(np.ones(len(allowed)))
        lower.append(1.0)
        upper.append(1.0)
        column += len(allowed)
    num_s = column
    for (u, v), edge in work.edges.items():
        u_cls, v_cls = edge.u_class[s_columns[u]], edge.v_class[s_columns[v]]
        usable = np.isfinite(edge.matrix)
        usable &= np.isin(np.arange(usable.shape[0]), u_cls)[:, None]
        usable &= np.isin(np.arange(usable.shape[1]), v_cls)[None, :]
        a_idx, b_idx = np.nonzero(usable)
        e_cols = column + np.arange(len(a_idx))
        cost.append(edge.matrix[a_idx, b_idx])
        column += len(a_idx)
        for side, cls, pair_cls in ((u, u_cls, a_idx), (v, v_cls, b_idx)):
            for c in np.unique(cls):
                s_cols = s_offset[side] + np.flatnonzero(cls == c)
                e_in = e_cols[pair_cls == c]
                rows.append(np.concatenate([e_in, s_cols]))
                vals.append(np.concatenate([np.ones(len(e_in)), -np.ones(len(s_cols))]))
                lower.append(0.0)
                upper.append(0.0)
    if budget is not None:
        rows.append(np.arange(num_s))
        vals.append(np.concatenate([work.memory[v][s_columns[v]] for v in live]))
        lower.append(-math.inf)
        upper.append(budget - work.const_memory)
    starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    return (np.concatenate(cost), np.array(lower), np.array(upper), starts,
            np.concatenate(rows), np.concatenate(vals))


def test_ilp_arrays_match_a_row_by_row_build():
    rng = np.random.default_rng(4)
    for case in range(40):
        n = int(rng.integers(2, 7))
        sizes = rng.integers(1, 6, n)
        costs = tuple(np.where(rng.random(k) < 0.2, np.inf, rng.random(k)) for k in sizes)
        memory = tuple(rng.random(k) for k in sizes)
        edges = []
        for u in range(n):
            for v in range(u + 1, n):
                if rng.random() < 0.5:
                    u_class = rng.integers(0, 3, sizes[u])
                    v_class = rng.integers(0, 3, sizes[v])
                    shape = (int(u_class.max()) + 1, int(v_class.max()) + 1)
                    matrix = np.where(rng.random(shape) < 0.1, np.inf, rng.random(shape))
                    edges.append(ilp.Edge(u, v, u_class, v_class, matrix))
        work = ilp._Work(
            costs=[c.copy() for c in costs], memory=list(memory), edges={},
            adjacency=[set() for _ in range(n)], alive=[True] * n,
        )
        for edge in edges:
            work.add_edge(edge)
        budget = None if case % 2 else float(rng.random() * n)
        milp, _, _ = ilp._arrays(work, budget)
        expected = _reference_arrays(work, budget)
        got = (milp.cost, milp.row_lower, milp.row_upper, milp.starts, milp.index, milp.value)
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_array_equal(mine, theirs)
