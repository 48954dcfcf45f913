"""Building the sharding ILP of one op subset: strategy nodes, edges, memory.

Input: a subset of an :class:`OpGraph` (a layer or a stage; forward, backward and
update ops) on a logical mesh. Output: an :class:`IntraOpModel`, cost tables that
:mod:`alpajob.planner.ilp` solves (Alpa eq. 1).

Nodes (one one-hot variable ``s_v`` each):

1. every boundary input (a tensor the subset reads but does not produce: a
   parameter, optimizer state, batch, or another layer's activation), with the
   tilings of :func:`~alpajob.planner.sharding.tiling_specs`;
2. every root op (``dot_general``, ``conv_general_dilated``, unknown ops) with the
   strategies of :func:`~alpajob.planner.strategies.op_strategies`.

Every other op follows one operand (the same-shaped, largest, still free, latest
one; in the update phase preferably the parameter) and joins that operand's node: for
each strategy of the node its spec is mapped through the op
(:func:`~alpajob.planner.follow.follow_strategy`). A transformer layer of a few
hundred ops becomes a few dozen nodes.

Costs per node strategy, in seconds, kept in two buckets:

- per micro-batch: compute and collectives of forward and backward ops, and the
  resharding of their inputs;
- per step: the update phase (compute, collectives, resharding) and the gradient
  synchronisation that gradient accumulation performs once per step: a collective
  on a tensor that flows, through linear ops only, into a parameter's gradient.

The objective divides the per-step bucket by the number of micro-batches (seconds
per step / B). Edges: for each tensor that crosses nodes, ``R[i, j]`` = resharding
from the producer's spec under ``i`` to the consumer's required spec under ``j``.

Constraints: a parameter and its updated value have equal specs (the update writes
in place), forbidden pairs are ``inf``; a parameter's gradient that no op of the
subset consumes is charged its resharding to the parameter's spec. Memory per device
(weights: parameters, gradients, optimizer state; residuals: forward values read by
backward ops, times ``activation_multiplier``) is linear in the ``s_v``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

import numpy as np

from alpajob.planner.cluster import DeviceSpec
from alpajob.planner.cost_model import Calibration, LogicalMesh
from alpajob.planner.edge_costs import EdgeBuilder, EdgeTables
from alpajob.planner.follow import follow_strategy
from alpajob.planner.graph import Op, OpGraph, Phase, Tensor, TensorRole
from alpajob.planner.ilp import INF, Edge, Problem
from alpajob.planner.sharding import (
    ShardSpec,
    replicated,
    resharding_seconds,
    shard_factor,
    tensor_bytes,
    tiling_specs,
)
from alpajob.planner.strategies import (
    OpKind,
    Strategy,
    op_base_seconds,
    op_kind,
    op_strategies,
)
from alpajob.planner.subset import Subset, analyse_subset

#: Seconds per byte added to every objective so that, among equally fast shardings,
#: the ILP keeps the one with less memory (a replicated batch input costs as much
#: time as a split one, but more memory). 1 GiB adds about a nanosecond.
TIE_BREAK_SECONDS_PER_BYTE = 1e-18


class ShardingMode(StrEnum):
    """Which shardings the intra-op pass may choose."""

    AUTO = "auto"  # the free ILP, then weight-update sharding
    DATA = "data"  # batch dims split over all axes, parameters replicated
    ZERO2 = "zero2"  # DATA, then weight-update sharding over all axes


T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class PerStrategy(Generic[T]):
    """One value per strategy of a node, stored as its distinct ``values`` and an
    ``index`` (``value of strategy i = values[index[i]]``).

    A tensor has a handful of distinct specs across the dozens of strategies of its
    node; working on the distinct ones keeps model building proportional to them.
    """

    values: tuple[T, ...]
    index: np.ndarray

    def __getitem__(self, strategy: int) -> T:
        return self.values[int(self.index[strategy])]

    def __len__(self) -> int:
        return len(self.index)

    def take(self, per_value: Sequence[float]) -> np.ndarray:
        """A per-strategy array from one number per distinct value."""
        return np.asarray(per_value, dtype=float)[self.index]


def distinct(items: Sequence[T], index: np.ndarray | None = None) -> PerStrategy[T]:
    """``items`` (one per strategy, or one per entry of ``index``) deduplicated."""
    ids: dict[T, int] = {}
    local = np.fromiter((ids.setdefault(item, len(ids)) for item in items), dtype=np.int64,
                        count=len(items))
    return PerStrategy(tuple(ids), local if index is None else local[index])


@dataclass(frozen=True, eq=False)
class NodeTables:
    """One ILP node: a root op or boundary input with its followers, per strategy."""

    label: str
    root_op: int | None
    root_tensor: int | None
    names: tuple[str, ...]
    compute: np.ndarray  # per micro-batch compute seconds (forward, backward)
    comm: np.ndarray  # per micro-batch communication seconds
    update: np.ndarray  # per step seconds (update phase, gradient sync)
    weight_bytes: np.ndarray
    activation_bytes: np.ndarray
    allowed: np.ndarray  # False where a constraint forbids the strategy


@dataclass(frozen=True, eq=False)
class IntraOpModel:
    """The cost tables of one subset on one mesh, and how to read a choice back."""

    graph: OpGraph
    mesh: LogicalMesh
    op_ids: tuple[int, ...]
    nodes: tuple[NodeTables, ...]
    edges: tuple[EdgeTables, ...]
    tensor_node: dict[int, int]
    tensor_specs: dict[int, PerStrategy[ShardSpec]]
    op_node: dict[int, int]
    op_strategies: dict[int, PerStrategy[Strategy]]
    boundary_inputs: tuple[int, ...]
    boundary_outputs: tuple[int, ...]
    grad_param: dict[int, int]
    weights: tuple[int, ...]
    residuals: tuple[int, ...]
    lonely_grads: tuple[int, ...] = field(default=())

    def problem(
        self,
        num_micro_batches: int,
        activation_multiplier: int,
        memory_weight: float,
        budget: float | None,
    ) -> Problem:
        """The ILP in objective units: seconds per micro-batch, per-step costs / B."""
        costs = []
        memory = []
        for node in self.nodes:
            mem = node.weight_bytes + activation_multiplier * node.activation_bytes
            cost = node.compute + node.comm + node.update / num_micro_batches
            cost = cost + (memory_weight + TIE_BREAK_SECONDS_PER_BYTE) * mem
            costs.append(np.where(node.allowed, cost, INF))
            memory.append(mem)
        edges = tuple(
            Edge(
                e.u,
                e.v,
                e.u_class,
                e.v_class,
                np.where(e.allowed, e.comm + e.update / num_micro_batches, INF),
            )
            for e in self.edges
        )
        return Problem(tuple(costs), tuple(memory), edges, budget)

    def memory_problem(self, activation_multiplier: int) -> Problem:
        """The same constraints, minimising per-device memory alone."""
        costs = []
        memory = []
        for node in self.nodes:
            mem = node.weight_bytes + activation_multiplier * node.activation_bytes
            costs.append(np.where(node.allowed, mem, INF))
            memory.append(mem)
        edges = tuple(
            Edge(e.u, e.v, e.u_class, e.v_class, np.where(e.allowed, 0.0, INF))
            for e in self.edges
        )
        return Problem(tuple(costs), tuple(memory), edges, None)


def data_spec(tensor: Tensor, mesh: LogicalMesh) -> ShardSpec:
    """The data-parallel spec: the batch dim split over every mesh axis (or the
    largest that divides it), everything else replicated."""
    spec = [()] * len(tensor.shape)
    if tensor.batch_dim is not None:
        active = mesh.active_axes
        options = [active] + sorted(((k,) for k in active), key=lambda a: -mesh.size_of(a))
        for axes in options:
            if axes and tensor.shape[tensor.batch_dim] % mesh.size_of(axes) == 0:
                spec[tensor.batch_dim] = tuple(axes)
                break
    return tuple(spec)


def _restrict(
    strategies: Sequence[Strategy], op: Op, graph: OpGraph, mesh: LogicalMesh
) -> list[Strategy]:
    """DATA mode: the strategies that read and write the data-parallel specs; else
    those that at least write them; else the replicated one."""
    outs = [data_spec(graph.tensor(t), mesh) for t in op.outputs]
    ins = [data_spec(graph.tensor(t), mesh) for t in op.inputs]
    writes = [s for s in strategies if list(s.output_specs) == outs]
    strict = [s for s in writes if list(s.input_specs) == ins]
    if strict or writes:
        return strict or writes
    reps = tuple(replicated(len(graph.tensor(t).shape)) for t in op.outputs)
    return [s for s in strategies if tuple(s.output_specs) == reps][:1] or list(strategies[:1])


def build_model(
    graph: OpGraph,
    op_ids: Sequence[int],
    mesh: LogicalMesh,
    device: DeviceSpec,
    calibration: Calibration,
    mode: ShardingMode,
    input_hints: Mapping[int, ShardSpec] | None = None,
) -> IntraOpModel:
    """The cost tables of ``op_ids`` on ``mesh`` (see module docstring).

    ``input_hints`` maps boundary inputs to the spec they arrive in (the layout the
    previous layer produced): choosing another spec for such an input is charged its
    resharding, per micro-batch. Hints on tensors that are not boundary inputs are
    ignored.
    """
    subset = analyse_subset(graph, op_ids)
    nodes = _Nodes(graph, mesh, device, calibration, mode, subset)
    builder = EdgeBuilder(graph, mesh)
    tables = _Tables([len(n) for n in nodes.names])
    _charge_ops(graph, subset, nodes, tables, builder)
    boundary = set(subset.boundary_inputs)
    for t, hint in (input_hints or {}).items():
        if t not in boundary:
            continue
        tensor = graph.tensor(t)
        specs = nodes.tensor_specs[t]
        tables.comm[nodes.tensor_node[t]] += specs.take(
            [resharding_seconds(tensor.shape, tensor.dtype, hint, spec, mesh)
             for spec in specs.values]
        )
    _constrain_params(graph, subset, nodes, tables, builder)
    for bucket, tensors in ((tables.weight_bytes, subset.weights),
                            (tables.activation_bytes, subset.residuals)):
        for t in tensors:
            tensor = graph.tensor(t)
            nbytes = tensor_bytes(tensor.shape, tensor.dtype)
            specs = nodes.tensor_specs[t]
            bucket[nodes.tensor_node[t]] += specs.take(
                [nbytes / shard_factor(spec, mesh) for spec in specs.values]
            )
    return IntraOpModel(
        graph=graph,
        mesh=mesh,
        op_ids=subset.op_ids,
        nodes=tuple(
            NodeTables(
                nodes.labels[v], nodes.roots[v][0], nodes.roots[v][1], nodes.names[v],
                tables.compute[v], tables.comm[v], tables.update[v],
                tables.weight_bytes[v], tables.activation_bytes[v], tables.allowed[v],
            )
            for v in range(len(nodes.labels))
        ),
        edges=tuple(builder.edges()),
        tensor_node=nodes.tensor_node,
        tensor_specs=nodes.tensor_specs,
        op_node=nodes.op_node,
        op_strategies=nodes.op_strategies,
        boundary_inputs=subset.boundary_inputs,
        boundary_outputs=subset.boundary_outputs,
        grad_param=subset.grad_param,
        weights=subset.weights,
        residuals=subset.residuals,
        lonely_grads=subset.lonely_grads,
    )


class _Nodes:
    """The ILP nodes: boundary inputs and root ops, each follower joined to its node.

    ``tensor_specs[t][i]`` is tensor ``t``'s spec under strategy ``i`` of its node
    ``tensor_node[t]``; ``op_strategies[o][i]`` op ``o``'s strategy likewise. A
    follower is evaluated once per distinct spec of the operand it follows.
    """

    def __init__(
        self,
        graph: OpGraph,
        mesh: LogicalMesh,
        device: DeviceSpec,
        calibration: Calibration,
        mode: ShardingMode,
        subset: Subset,
    ) -> None:
        self.labels: list[str] = []
        self.roots: list[tuple[int | None, int | None]] = []
        self.names: list[tuple[str, ...]] = []
        self.param_rooted: list[bool] = []
        self.tensor_node: dict[int, int] = {}
        self.tensor_specs: dict[int, PerStrategy[ShardSpec]] = {}
        self.op_node: dict[int, int] = {}
        self.op_strategies: dict[int, PerStrategy[Strategy]] = {}
        data = mode is not ShardingMode.AUTO
        for t in subset.boundary_inputs:
            tensor = graph.tensor(t)
            if data and tensor.role in (TensorRole.PARAM, TensorRole.OPT_STATE):
                specs: tuple[ShardSpec, ...] = (replicated(len(tensor.shape)),)
            elif data:
                specs = (data_spec(tensor, mesh),)
            else:
                specs = tiling_specs(tensor.shape, mesh)
            self.tensor_node[t] = self._new(
                f"input {t} ({tensor.role.value})", (None, t), tuple(str(s) for s in specs),
                tensor.role is TensorRole.PARAM,
            )
            self.tensor_specs[t] = PerStrategy(specs, np.arange(len(specs)))
        for op_id in subset.op_ids:
            op = graph.ops[op_id]
            kind = op_kind(op.primitive)
            if kind.is_follower and op.inputs and op.outputs:
                operand = self._pick_operand(op, kind, graph, subset.produced)
                node = self.tensor_node[op.inputs[operand]]
                base = op_base_seconds(op, graph, device, calibration)
                followed = self.tensor_specs[op.inputs[operand]]
                strategies = PerStrategy(
                    tuple(
                        follow_strategy(
                            op, graph, operand, spec, mesh, device, calibration,
                            base_seconds=base,
                        )
                        for spec in followed.values
                    ),
                    followed.index,
                )
            else:
                roots = op_strategies(op, graph, mesh, device, calibration)
                if data:
                    roots = tuple(_restrict(roots, op, graph, mesh))
                node = self._new(
                    f"op {op.id} {op.primitive}", (op.id, None),
                    tuple(s.name for s in roots), False,
                )
                strategies = PerStrategy(tuple(roots), np.arange(len(roots)))
            self.op_node[op.id] = node
            self.op_strategies[op.id] = strategies
            for position, t in enumerate(op.outputs):
                self.tensor_node[t] = node
                self.tensor_specs[t] = distinct(
                    [s.output_specs[position] for s in strategies.values], strategies.index
                )

    def _new(
        self, label: str, root: tuple[int | None, int | None], names: tuple[str, ...],
        param: bool,
    ) -> int:
        self.labels.append(label)
        self.roots.append(root)
        self.names.append(names)
        self.param_rooted.append(param)
        return len(self.labels) - 1

    def _pick_operand(
        self, op: Op, kind: OpKind, graph: OpGraph, produced: dict[int, int]
    ) -> int:
        """Which operand a follower copies: the first for layout ops and reductions; for
        elementwise ops (and concatenate) the same-shaped, largest operand whose node
        still has a choice, in the update phase preferably the parameter's (so that
        ``p - lr * u`` keeps ``p``'s spec), else the latest produced."""
        if kind not in (OpKind.ELEMENTWISE, OpKind.RESIZE) or (
            kind is OpKind.RESIZE and op.primitive != "concatenate"
        ):
            return 0
        out = graph.tensor(op.outputs[0])

        def key(position: int) -> tuple[bool, int, bool, bool, int]:
            tensor = graph.tensor(op.inputs[position])
            node = self.tensor_node[tensor.id]
            return (
                tensor.shape == out.shape,
                math.prod(tensor.shape),
                len(self.names[node]) > 1,
                op.phase is Phase.UPDATE and self.param_rooted[node],
                produced.get(tensor.id, -1),
            )

        return max(range(len(op.inputs)), key=key)


class _Tables:
    """Per-node cost and memory vectors under construction."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.compute = [np.zeros(k) for k in sizes]
        self.comm = [np.zeros(k) for k in sizes]
        self.update = [np.zeros(k) for k in sizes]
        self.weight_bytes = [np.zeros(k) for k in sizes]
        self.activation_bytes = [np.zeros(k) for k in sizes]
        self.allowed = [np.ones(k, dtype=bool) for k in sizes]


def _charge_ops(
    graph: OpGraph, subset: Subset, nodes: _Nodes, tables: _Tables, builder: EdgeBuilder
) -> None:
    """Each op's compute and collectives, and the resharding of each of its inputs:
    into its node's vectors, or onto an edge when the input comes from another node."""
    for op_id in subset.op_ids:
        op = graph.ops[op_id]
        v = nodes.op_node[op_id]
        strategies = nodes.op_strategies[op_id]
        per_step = op.phase is Phase.UPDATE
        sync = bool(op.outputs) and op.outputs[0] in subset.grad_param
        (tables.update if per_step else tables.compute)[v] += strategies.take(
            [s.compute_seconds for s in strategies.values]
        )
        (tables.update if per_step or sync else tables.comm)[v] += strategies.take(
            [s.comm_seconds for s in strategies.values]
        )
        for position, t in enumerate(op.inputs):
            u = nodes.tensor_node[t]
            need = distinct(
                [s.input_specs[position] for s in strategies.values], strategies.index
            )
            if u == v:
                row = builder.reshard_row(t, nodes.tensor_specs[t], need)
                (tables.update if per_step else tables.comm)[v] += row
            else:
                builder.contribute(u, v, t, nodes.tensor_specs[t], need, per_step)


def _constrain_params(
    graph: OpGraph, subset: Subset, nodes: _Nodes, tables: _Tables, builder: EdgeBuilder
) -> None:
    """A parameter and its new value share a spec; a gradient whose update lies
    outside the subset pays its resharding to the parameter's spec."""
    specs = nodes.tensor_specs
    for k, p in enumerate(graph.params):
        if p not in nodes.tensor_node:
            continue
        new = graph.new_params[k] if k < len(graph.new_params) else -1
        if new in subset.produced:
            u, v = nodes.tensor_node[p], nodes.tensor_node[new]
            if u == v:
                equal = np.array([[a == b for b in specs[new].values] for a in specs[p].values])
                tables.allowed[u] &= equal[specs[p].index, specs[new].index]
            else:
                builder.contribute(u, v, p, specs[p], specs[new], True, equality=True)
        grad = graph.grads[k] if k < len(graph.grads) else -1
        if grad in subset.lonely_grads:
            u, v = nodes.tensor_node[grad], nodes.tensor_node[p]
            if u == v:
                tables.update[u] += builder.reshard_row(grad, specs[grad], specs[p])
            else:
                builder.contribute(u, v, grad, specs[grad], specs[p], True)
