"""Building the sharding ILP of one op subset: strategy nodes, edges, memory.

Input: a subset of an :class:`OpGraph` (a layer or a stage; forward, backward and
update ops) on a logical mesh. Output: an :class:`IntraOpModel`, cost tables that
:mod:`alpajob.planner.intra_op.ilp` solves (Alpa eq. 1).

Nodes (one one-hot variable ``s_v`` each):

1. every boundary input (a tensor the subset reads but does not produce: a
   parameter, optimizer state, batch, or another layer's activation), with the
   tilings of :func:`~alpajob.planner.intra_op.sharding.tiling_specs`;
2. every root op (``dot_general``, ``conv_general_dilated``, unknown ops) with the
   strategies of :func:`~alpajob.planner.intra_op.strategies.op_strategies`.

Every other op follows one operand (the same-shaped, largest, still free, latest
one; in the update phase preferably the parameter) and joins that operand's node: for
each strategy of the node its spec is mapped through the op
(:func:`~alpajob.planner.intra_op.follow.follow_strategy`; the nodes are
:class:`~alpajob.planner.intra_op.nodes.ModelNodes`). A transformer layer of a few
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

Reuse: op strategies, spec sets and resharding matrices come memoised per op
structure from a :class:`~alpajob.planner.intra_op.op_tables.TableCache`. A
:class:`SolveContext` keeps, for one graph, its index, a table cache per mesh and
the recent models; input hints are applied to a copy of a model, so one build
serves every memory weight and every set of hints. Models are shared: read-only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import Calibration, LogicalMesh
from alpajob.planner.graph.opgraph import OpGraph, Phase
from alpajob.planner.graph.subset import GraphIndex, Subset, analyse_subset
from alpajob.planner.intra_op.edge_costs import EdgeBuilder, EdgeTables
from alpajob.planner.intra_op.ilp import INF, Edge, Problem
from alpajob.planner.intra_op.nodes import ModelNodes
from alpajob.planner.intra_op.op_tables import (
    OpStructures,
    PerStrategy,
    TableCache,
    data_spec,
    distinct,
)
from alpajob.planner.intra_op.reassociate import Pair, find_pairs, refund
from alpajob.planner.intra_op.sharding import (
    ShardSpec,
    resharding_seconds,
    tensor_bytes,
)
from alpajob.planner.intra_op.strategies import Strategy

__all__ = ["IntraOpModel", "NodeTables", "PerStrategy", "ShardingMode", "SolveContext",
           "TIE_BREAK_SECONDS_PER_BYTE", "build_model", "built_as", "data_spec", "distinct"]

#: Seconds per byte added to every objective so that, among equally fast shardings,
#: the ILP keeps the one with less memory (a replicated batch input costs as much
#: time as a split one, but more memory). 1 GiB adds about a nanosecond.
TIE_BREAK_SECONDS_PER_BYTE = 1e-18


class ShardingMode(StrEnum):
    """Which shardings the intra-op pass may choose."""

    AUTO = "auto"  # the free ILP, then weight-update sharding
    DATA = "data"  # batch dims split over all axes, parameters replicated
    ZERO2 = "zero2"  # DATA, then weight-update sharding over all axes
    #: ZERO2, but tensors with an expert dimension split it (DeepSpeed-MoE's expert
    #: parallelism; see :mod:`~alpajob.planner.graph.experts`)
    EXPERT_ZERO2 = "expert-zero2"


def built_as(mode: ShardingMode) -> ShardingMode:
    """The mode whose model ``mode``'s solves use: ZERO2 restricts the shardings as
    DATA does (it differs after the solve, by sharding the weight update), so the two
    share their models."""
    return ShardingMode.DATA if mode is ShardingMode.ZERO2 else mode


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
    #: Sums whose two partial-sum operands XLA reduces once (:mod:`reassociate`).
    reassociated: tuple[Pair, ...] = field(default=())
    #: The backward's tensors and when they are live (:func:`~.subset.backward_lifetimes`).
    lifetimes: tuple[tuple[int, int, int], ...] = field(default=())
    #: Choices already read back op by op (:func:`~.solve.solve_intra_op`), which reads
    #: nothing the input hints change: shared by this model's copies with hints.
    read_back: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)

    def problem(
        self,
        num_micro_batches: int,
        activation_multiplier: int,
        memory_weight: float,
        budget: float | None,
    ) -> Problem:
        """The ILP in objective units: seconds per micro-batch, per-step costs / B.
        Computed on every node's (and every edge's) tables at once, laid end to end
        (:class:`_EndToEnd`), then cut back into each one's: the same values, element
        by element, as node by node."""
        flat = self._end_to_end
        mem = flat.weight + activation_multiplier * flat.activation
        cost = flat.compute + flat.comm + flat.update / num_micro_batches
        cost = cost + (memory_weight + TIE_BREAK_SECONDS_PER_BYTE) * mem
        costs = np.split(np.where(flat.allowed, cost, INF), flat.node_cuts) if self.nodes else []
        memory = np.split(mem, flat.node_cuts) if self.nodes else []
        matrices = np.split(
            np.where(flat.edge_allowed, flat.edge_comm + flat.edge_update / num_micro_batches, INF),
            flat.edge_cuts) if self.edges else []
        edges = tuple(
            Edge(e.u, e.v, e.u_class, e.v_class, matrix.reshape(e.comm.shape))
            for e, matrix in zip(self.edges, matrices, strict=True)
        )
        return Problem(tuple(costs), tuple(memory), edges, budget)

    @functools.cached_property
    def _end_to_end(self) -> _EndToEnd:
        return _EndToEnd.of(self.nodes, self.edges)

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


@dataclass(frozen=True)
class _EndToEnd:
    """A model's node vectors and edge matrices (flattened), each kind laid end to
    end, and where each node's (edge's) part ends but the last (``np.split``'s cuts)."""

    weight: np.ndarray
    activation: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    update: np.ndarray
    allowed: np.ndarray
    node_cuts: np.ndarray
    edge_comm: np.ndarray
    edge_update: np.ndarray
    edge_allowed: np.ndarray
    edge_cuts: np.ndarray

    @staticmethod
    def of(nodes: Sequence[NodeTables], edges: Sequence[EdgeTables]) -> _EndToEnd:
        def joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        def cuts(sizes: list[int]) -> np.ndarray:
            return np.cumsum(sizes)[:-1] if sizes else np.zeros(0, dtype=np.int64)

        return _EndToEnd(
            weight=joined([n.weight_bytes for n in nodes], float),
            activation=joined([n.activation_bytes for n in nodes], float),
            compute=joined([n.compute for n in nodes], float),
            comm=joined([n.comm for n in nodes], float),
            update=joined([n.update for n in nodes], float),
            allowed=joined([n.allowed for n in nodes], bool),
            node_cuts=cuts([len(n.allowed) for n in nodes]),
            edge_comm=joined([e.comm.ravel() for e in edges], float),
            edge_update=joined([e.update.ravel() for e in edges], float),
            edge_allowed=joined([e.allowed.ravel() for e in edges], bool),
            edge_cuts=cuts([e.comm.size for e in edges]),
        )


class SolveContext:
    """What every build on one graph can share: its :class:`GraphIndex`, its ops'
    structure ids (:class:`OpStructures`), a :class:`TableCache` per (mesh, device,
    calibration) reading them, and the last ``max_models`` models built (keyed by
    ops, mesh, device, calibration and the mode they are :func:`built_as`; input
    hints are applied to a copy, so one model serves every memory weight and every
    set of hints). Results are identical with and without a context; a context only saves
    recomputation. Build one per graph and pass it to every solve on that graph.
    ``like``, the context of another graph (the same model at another micro-batch
    size), lends its op tables: those of ops whose structure both graphs share
    (:meth:`~.op_tables.TableCache.rebound`) are computed once for both.

    Memory: a model of a 2,000-op layer takes 2 to 3 MB, so the default bound of 64
    models (enough for every layer class on every logical shape of a submesh) stays
    under ~200 MB; a table cache per mesh adds a few MB. ``max_models=0`` caches no
    model. Not thread-safe.
    """

    def __init__(self, graph: OpGraph, max_models: int = 64,
                 like: SolveContext | None = None) -> None:
        if max_models < 0:
            raise ValueError(f"max_models must be >= 0, got {max_models}")
        self.graph = graph
        self.index = GraphIndex.build(graph)
        self.max_models = max_models
        self._tables: dict[tuple[LogicalMesh, DeviceSpec, Calibration], TableCache] = {}
        self._like = like
        self._structures: OpStructures = (
            like._structures.rebound(graph) if like else OpStructures(graph))
        self._models: OrderedDict[tuple, IntraOpModel] = OrderedDict()

    def tables(
        self, mesh: LogicalMesh, device: DeviceSpec, calibration: Calibration
    ) -> TableCache:
        """The table cache of this graph on ``mesh`` (created on first use)."""
        key = (mesh, device, calibration)
        cache = self._tables.get(key)
        if cache is None:
            if self._like is not None:
                cache = self._like.tables(mesh, device, calibration).rebound(
                    self.graph, self._structures)
            else:
                cache = TableCache(self.graph, mesh, device, calibration, self._structures)
            self._tables[key] = cache
        return cache

    def model(
        self,
        op_ids: Sequence[int],
        mesh: LogicalMesh,
        device: DeviceSpec,
        calibration: Calibration,
        mode: ShardingMode,
    ) -> IntraOpModel:
        """The model of ``op_ids`` without input hints, built or reused."""
        mode = built_as(mode)
        key = (tuple(sorted(set(op_ids))), mesh, device, calibration, mode)
        model = self._models.get(key)
        if model is not None:
            self._models.move_to_end(key)
            return model
        subset = analyse_subset(self.graph, op_ids, self.index)
        model = _build(self.graph, subset, self.tables(mesh, device, calibration), mode)
        if self.max_models:
            self._models[key] = model
            while len(self._models) > self.max_models:
                self._models.popitem(last=False)
        return model


def build_model(
    graph: OpGraph,
    op_ids: Sequence[int],
    mesh: LogicalMesh,
    device: DeviceSpec,
    calibration: Calibration,
    mode: ShardingMode,
    input_hints: Mapping[int, ShardSpec] | None = None,
    *,
    context: SolveContext | None = None,
    fixed_inputs: Mapping[int, ShardSpec] | None = None,
) -> IntraOpModel:
    """The cost tables of ``op_ids`` on ``mesh`` (see module docstring).

    ``input_hints`` maps boundary inputs to the spec they arrive in (the layout the
    previous layer produced): choosing another spec for such an input is charged its
    resharding, per micro-batch. Hints on tensors that are not boundary inputs are
    ignored. ``context`` (of this graph) reuses indexes, tables and models of earlier
    builds; the model is the same with or without it.
    """
    mode = ShardingMode(mode)
    if context is None:
        context = SolveContext(graph, max_models=0)
    elif context.graph is not graph:
        raise ValueError(
            f"the SolveContext was made for graph {context.graph.name!r}, not for this "
            f"{graph.name!r} object; make one per graph with SolveContext(graph)"
        )
    model = context.model(op_ids, mesh, device, calibration, mode)
    if input_hints:
        model = _with_hints(model, input_hints)
    return _with_fixed(model, fixed_inputs) if fixed_inputs else model


def _with_fixed(model: IntraOpModel, fixed: Mapping[int, ShardSpec]) -> IntraOpModel:
    """``model`` with each fixed boundary input's other specs forbidden (a copy)."""
    nodes = list(model.nodes)
    for t, spec in fixed.items():
        if t not in model.boundary_inputs:
            raise ValueError(f"tensor {t} is not a boundary input of these ops: only "
                             f"those can be fixed")
        specs = model.tensor_specs[t]
        if spec not in specs.values:
            raise ValueError(f"tensor {t} cannot take spec {spec} on this mesh; its specs "
                             f"are {sorted(set(specs.values))}")
        v = model.tensor_node[t]
        row = specs.take([0.0 if s == spec else INF for s in specs.values])
        nodes[v] = dataclasses.replace(nodes[v], comm=nodes[v].comm + row)
    return dataclasses.replace(model, nodes=tuple(nodes))


def _with_hints(model: IntraOpModel, input_hints: Mapping[int, ShardSpec]) -> IntraOpModel:
    """``model`` with each hinted boundary input's node charged, per micro-batch, the
    resharding from its hint to each of its specs (a copy; ``model`` is unchanged)."""
    graph, mesh = model.graph, model.mesh
    boundary = set(model.boundary_inputs)
    nodes = list(model.nodes)
    for t, hint in input_hints.items():
        if t not in boundary:
            continue
        tensor = graph.tensor(t)
        specs = model.tensor_specs[t]
        v = model.tensor_node[t]
        row = specs.take(
            [resharding_seconds(tensor.shape, tensor.dtype, hint, spec, mesh)
             for spec in specs.values]
        )
        nodes[v] = dataclasses.replace(nodes[v], comm=nodes[v].comm + row)
    return dataclasses.replace(model, nodes=tuple(nodes))


def _build(graph: OpGraph, subset: Subset, tables: TableCache, mode: ShardingMode) -> IntraOpModel:
    """The model of ``subset`` without input hints."""
    nodes = ModelNodes(graph, tables, subset, restricted=mode is not ShardingMode.AUTO,
                       experts=tables.expert_dims if mode is ShardingMode.EXPERT_ZERO2 else {})
    builder = EdgeBuilder()
    sizes = [len(n) for n in nodes.names]
    compute, comm, update = _charge_ops(graph, subset, nodes, tables, builder, sizes)
    allowed = [np.ones(k, dtype=bool) for k in sizes]
    _constrain_params(graph, subset, nodes, tables, builder, update, allowed)
    pairs = find_pairs(graph, subset.op_ids, nodes)
    for pair in pairs:
        u, v, seconds, u_class, v_class = refund(pair, nodes)
        second = graph.ops[pair.roots[1]]
        per_step = second.phase is Phase.UPDATE or second.outputs[0] in subset.grad_param
        builder.contribute(u, v, seconds, np.ones(seconds.shape, dtype=bool), u_class, v_class,
                           per_step)
    weight_bytes = [np.zeros(k) for k in sizes]
    activation_bytes = [np.zeros(k) for k in sizes]
    for bucket, tensors in ((weight_bytes, subset.weights),
                            (activation_bytes, subset.residuals)):
        for t in tensors:
            tensor = graph.tensor(t)
            nbytes = tensor_bytes(tensor.shape, tensor.dtype)
            bucket[nodes.tensor_node[t]] += tables.shard_bytes(nbytes, nodes.tensor_set[t])[
                nodes.tensor_specs[t].index
            ]
    edges = builder.edges()
    for array in (*compute, *comm, *update, *weight_bytes, *activation_bytes, *allowed,
                  *(a for e in edges for a in (e.u_class, e.v_class, e.comm, e.update,
                                               e.allowed))):
        array.setflags(write=False)  # the model may be cached and shared
    return IntraOpModel(
        graph=graph,
        mesh=tables.mesh,
        op_ids=subset.op_ids,
        nodes=tuple(
            NodeTables(
                nodes.labels[v], nodes.roots[v][0], nodes.roots[v][1], nodes.names[v],
                compute[v], comm[v], update[v], weight_bytes[v], activation_bytes[v],
                allowed[v],
            )
            for v in range(len(nodes.labels))
        ),
        edges=tuple(edges),
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
        reassociated=tuple(pairs),
        lifetimes=subset.lifetimes,
    )


def _charge_ops(
    graph: OpGraph,
    subset: Subset,
    nodes: ModelNodes,
    tables: TableCache,
    builder: EdgeBuilder,
    sizes: Sequence[int],
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Each op's compute and collectives, and the resharding of each of its inputs:
    into its node's (compute, comm, update) vectors, returned, or onto an edge when
    the input comes from another node."""
    compute = [np.zeros(k) for k in sizes]
    comm = [np.zeros(k) for k in sizes]
    update = [np.zeros(k) for k in sizes]
    for op_id in subset.op_ids:
        op = graph.ops[op_id]
        v = nodes.op_node[op_id]
        table = nodes.op_table[op_id]
        index = nodes.op_strategies[op_id].index
        per_step = op.phase is Phase.UPDATE
        sync = bool(op.outputs) and op.outputs[0] in subset.grad_param
        # Adding zeros changes no sum: skipped (most followers have no collective).
        if table.any_compute:
            (update if per_step else compute)[v] += table.compute[index]
        if table.any_comm:
            (update if per_step or sync else comm)[v] += table.comm[index]
        for t, need in zip(op.inputs, table.inputs, strict=True):
            u = nodes.tensor_node[t]
            src, src_index = nodes.tensor_set[t], nodes.tensor_specs[t].index
            if u == v and need.identity and need.spec_set == src and src_index is index:
                continue  # the operand a follower copies, needed in the spec it has
            need_index = index if need.identity else need.local[index]
            if u == v:
                (update if per_step else comm)[v] += tables.reshard_row(
                    t, src, src_index, need.spec_set, need_index
                )
            else:
                seconds, allowed = tables.reshard(t, src, need.spec_set)
                builder.contribute(u, v, seconds, allowed, src_index, need_index, per_step)
    return compute, comm, update


def _constrain_params(
    graph: OpGraph,
    subset: Subset,
    nodes: ModelNodes,
    tables: TableCache,
    builder: EdgeBuilder,
    update: list[np.ndarray],
    allowed: list[np.ndarray],
) -> None:
    """A parameter and its new value share a spec; a gradient whose update lies
    outside the subset pays its resharding to the parameter's spec."""
    specs, sets = nodes.tensor_specs, nodes.tensor_set
    for k, p in enumerate(graph.params):
        if p not in nodes.tensor_node:
            continue
        new = graph.new_params[k] if k < len(graph.new_params) else -1
        if new in subset.produced:
            u, v = nodes.tensor_node[p], nodes.tensor_node[new]
            zero, equal = tables.reshard(p, sets[p], sets[new], equality=True)
            if u == v:
                allowed[u] &= equal[specs[p].index, specs[new].index]
            else:
                builder.contribute(u, v, zero, equal, specs[p].index, specs[new].index, True)
        grad = graph.grads[k] if k < len(graph.grads) else -1
        if grad in subset.lonely_grads:
            u, v = nodes.tensor_node[grad], nodes.tensor_node[p]
            if u == v:
                update[u] += tables.reshard_row(
                    grad, sets[grad], specs[grad].index, sets[p], specs[p].index
                )
            else:
                seconds, fine = tables.reshard(grad, sets[grad], sets[p])
                builder.contribute(u, v, seconds, fine, specs[grad].index, specs[p].index, True)
