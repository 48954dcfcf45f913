"""The intra-operator pass: shard one op subset on one logical mesh (Alpa eq. 1).

::

    OpGraph subset ──build_model──► nodes (roots + followers), edges, memory
                   ──ilp.solve────► one strategy per node (exact presolve, then
                                    HiGHS through highspy, or CBC through pulp)
                   ──realise──────► spec of every tensor, time and memory breakdown
                   ──weight-update sharding (AUTO, ZERO2)──► IntraOpResult

Objective (seconds per step / B, B = ``num_micro_batches``)::

    sum over forward/backward ops of compute + collectives + input resharding
  + (update-phase costs + once-per-step gradient synchronisation) / B
  + (memory_weight + 1e-18) * per-device bytes    (the 1e-18 s/byte breaks ties
                                                     towards less memory)

Forward and backward ops run once per micro-batch; the optimizer update and the
all-reduce of accumulated gradients run once per step. Compute is the real roofline
time of each op under its strategy, so replicated work is charged on every device
(Alpa charges communication only).

Weight-update sharding (ZeRO-2 style, Alpa section 4.2/7): after solving, a
parameter whose gradient is all-reduced over mesh axes on which the parameter is
replicated is rewritten to reduce-scatter the gradient over those axes, run the
optimizer update on its shard (the update's compute and the optimizer state divide
by the axes' size) and all-gather the new parameter. On 8-way data parallelism with
Adam, the optimizer state per device drops 8x for an extra alpha per parameter.
ZERO2 rewrites every such parameter; AUTO only those where the rewrite does not
worsen the objective (on a tiny bias the extra latency outweighs the savings). The
ILP can also find the pattern itself (a reduce-scatter strategy for the gradient's
dot, a sharded update, an all-gather edge into the parameter).

Modes: ``AUTO`` solves freely; ``DATA`` pins every batch-carrying tensor to its batch
dim split over all axes and parameters to replicated (plain data parallelism);
``ZERO2`` is ``DATA`` plus weight-update sharding.

Many solves on one graph (a planner solves each layer class on every logical mesh,
memory weight and set of input hints) should share a :class:`SolveContext`: the
graph's index, op strategy tables per mesh and recent models are then computed
once; results are identical with and without it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from alpajob.api.errors import InfeasibleError, SolverError
from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import (
    Calibration,
    LogicalMesh,
    all_gather_seconds,
    all_reduce_seconds,
    reduce_scatter_seconds,
)
from alpajob.planner.graph.opgraph import OpGraph, Phase, TensorRole
from alpajob.planner.graph.subset import GraphIndex, busiest_bytes
from alpajob.planner.intra_op.collectives import Collective, CollectiveKind, PlannedCollective
from alpajob.planner.intra_op.ilp import brute_force, solve
from alpajob.planner.intra_op.milp import SolveStatus
from alpajob.planner.intra_op.model import (
    IntraOpModel,
    ShardingMode,
    SolveContext,
    build_model,
)
from alpajob.planner.intra_op.reassociate import merged_reduction
from alpajob.planner.intra_op.sharding import (
    ShardSpec,
    is_valid_spec,
    reshard_collectives,
    resharding_seconds,
    shard_factor,
    spec_axes,
    tensor_bytes,
    to_partition_spec,
)
from alpajob.planner.intra_op.strategies import Strategy

__all__ = [
    "IntraOpResult",
    "IntraOpStats",
    "ShardingMode",
    "SolveContext",
    "SolveStatus",
    "brute_force_intra_op",
    "solve_intra_op",
]

_GIB = float(1 << 30)


@dataclass(frozen=True)
class IntraOpStats:
    """Size of the ILP and how it was solved."""

    num_ops: int
    #: Strategy nodes after follower merging (boundary inputs and root ops).
    num_nodes: int
    #: Node pairs joined by at least one resharding or consistency edge.
    num_edges: int
    #: Nodes the exact presolve left for the ILP solver.
    nodes_after_presolve: int
    num_variables: int
    num_constraints: int
    build_seconds: float
    solve_seconds: float
    solver: str
    status: SolveStatus


@dataclass(frozen=True)
class IntraOpResult:
    """The sharding of one op subset on one logical mesh, and what it costs.

    Times are per device. ``compute_seconds`` and ``comm_seconds`` are per micro-batch
    (forward + backward); ``update_seconds`` per step (optimizer update and the
    once-per-step gradient synchronisation), after weight-update sharding.
    ``weight_bytes`` (parameters, gradients, optimizer state) and
    ``activation_bytes`` (residuals of one micro-batch) are per device.
    ``objective`` is the ILP optimum (before weight-update sharding), in seconds per
    micro-batch: ``compute + comm + update / B + (memory_weight + 1e-18) * memory``.
    ``specs`` holds every tensor the subset touches (optimizer state as rewritten by
    weight-update sharding); ``weight_update_sharded`` the rewritten parameters;
    ``collectives`` every collective the sharding performs (after the rewrite), for
    :func:`~alpajob.planner.intra_op.collectives.count_collectives`.
    """

    compute_seconds: float
    comm_seconds: float
    update_seconds: float
    weight_bytes: float
    activation_bytes: float
    objective: float
    specs: dict[int, ShardSpec] = field(hash=False)
    boundary_inputs: tuple[int, ...]
    boundary_outputs: tuple[int, ...]
    weight_update_sharded: tuple[int, ...]
    stats: IntraOpStats
    mesh: LogicalMesh
    collectives: tuple[PlannedCollective, ...] = field(default=(), hash=False)
    #: Per device: the most bytes the backward's own tensors hold at once, on top of
    #: the residuals (:func:`~alpajob.planner.graph.subset.backward_lifetimes`).
    working_bytes: float = 0.0

    def memory_bytes(self, activation_multiplier: int = 1) -> float:
        """Per-device bytes with ``activation_multiplier`` micro-batches in flight."""
        return self.weight_bytes + activation_multiplier * self.activation_bytes

    def partition_specs(self) -> dict[int, tuple[str | tuple[str, ...] | None, ...]]:
        """Every tensor's spec as ``jax.sharding.PartitionSpec`` entries."""
        return {t: to_partition_spec(s, self.mesh.axis_names) for t, s in self.specs.items()}


@dataclass(frozen=True)
class _Realised:
    """A choice read back op by op (independent of the ILP's aggregated tables)."""

    specs: dict[int, ShardSpec]
    compute: float
    comm: float
    update: float
    weight_bytes: float
    activation_bytes: float
    working_bytes: float
    syncs: dict[int, list[Collective]]
    #: Every collective, and for a gradient's synchronisation the parameter's index.
    collectives: list[tuple[PlannedCollective, int | None]]


def _without(strategy: Strategy, collective: Collective) -> Strategy:
    """``strategy`` without its last ``collective`` (folded into another's)."""
    kept = list(strategy.collectives)
    kept.pop(len(kept) - 1 - kept[::-1].index(collective))
    return dataclasses.replace(strategy, comm_seconds=strategy.comm_seconds - collective.seconds,
                               collectives=tuple(kept))


def _realise(model: IntraOpModel, choice: Sequence[int]) -> _Realised:
    """``choice`` read back on ``model`` (once per model and choice: a model's copies
    with other input hints, or another memory weight that chooses the same, reuse it)."""
    key = tuple(choice)
    found = model.read_back.get(key)
    if found is None:
        found = model.read_back[key] = _read_back(model, key)
    return found


def _read_back(model: IntraOpModel, choice: Sequence[int]) -> _Realised:
    graph, mesh = model.graph, model.mesh
    tensors = graph.tensors
    specs = {
        t: per.values[per.index[choice[model.tensor_node[t]]]]
        for t, per in model.tensor_specs.items()
    }
    compute = comm = update = 0.0
    syncs: dict[int, list[Collective]] = {}
    planned: list[tuple[PlannedCollective, int | None]] = []

    def chosen(op_id: int) -> Strategy:
        per = model.op_strategies[op_id]
        return per.values[per.index[choice[model.op_node[op_id]]]]

    folded = {}  # root op -> its reduction, run once on the sum (reassociate.py)
    for pair in model.reassociated:
        (a, b), (ta, tb) = pair.roots, pair.tensors
        merged = merged_reduction(chosen(a), chosen(b), specs[ta], specs[tb])
        if merged is not None:
            folded[b] = merged
    for op_id in model.op_ids:
        op = graph.ops[op_id]
        strategy = chosen(op_id)
        if op_id in folded:
            strategy = _without(strategy, folded[op_id])
        per_step = op.phase is Phase.UPDATE
        grad = bool(op.outputs) and op.outputs[0] in model.grad_param
        if per_step:
            update += strategy.compute_seconds
        else:
            compute += strategy.compute_seconds
        if per_step or grad:
            update += strategy.comm_seconds
        else:
            comm += strategy.comm_seconds
        param_k = model.grad_param[op.outputs[0]] if grad else None
        if param_k is not None:
            syncs.setdefault(param_k, []).extend(strategy.collectives)
        if strategy.collectives:
            elements = tensors[op.outputs[0]].size
            planned.extend(
                (PlannedCollective(c, op_id, None, per_step or grad, elements), param_k)
                for c in strategy.collectives
            )
        for t, need in zip(op.inputs, strategy.input_specs, strict=True):
            have = specs[t]
            if have == need:
                continue  # free: adding 0.0 changes no sum
            tensor = tensors[t]
            seconds = resharding_seconds(tensor.shape, tensor.dtype, have, need, mesh)
            if per_step:
                update += seconds
            else:
                comm += seconds
            planned.extend(
                (PlannedCollective(c, op_id, t, per_step, tensor.size), None)
                for c in reshard_collectives(tensor.shape, tensor.dtype, have, need, mesh)
            )
    for lonely in model.lonely_grads:
        param = graph.params[graph.grads.index(lonely)]
        if param not in specs:
            continue  # read only outside the subset, which chooses its layout: the model prices none here
        tensor = graph.tensor(lonely)
        update += resharding_seconds(tensor.shape, tensor.dtype, specs[lonely], specs[param], mesh)
        planned.extend(
            (PlannedCollective(c, None, lonely, True, tensor.size), None)
            for c in reshard_collectives(tensor.shape, tensor.dtype, specs[lonely],
                                         specs[param], mesh)
        )

    def size(t: int) -> float:
        spread = shard_factor(specs[t], mesh) if t in specs else 1
        return tensor_bytes(tensors[t].shape, tensors[t].dtype) / spread

    def total(ids: Sequence[int]) -> float:
        return sum(size(t) for t in ids)

    return _Realised(
        specs, compute, comm, update, total(model.weights), total(model.residuals),
        busiest_bytes(model.lifetimes, size), syncs, planned,
    )


def _wus_layout(
    shape: Sequence[int], spec: ShardSpec, axes: Sequence[int], mesh: LogicalMesh
) -> tuple[tuple[int, ...], int] | None:
    """Which of ``axes`` (all, else the largest single one) shard which dim further."""
    options = [tuple(axes)] + sorted(((k,) for k in axes), key=lambda a: -mesh.size_of(a))
    for option in dict.fromkeys(options):
        for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
            new = tuple(tuple(sorted(s + option)) if i == d else s for i, s in enumerate(spec))
            if is_valid_spec(new, shape, mesh):
                return option, d
    return None


def _weight_update_sharding(
    model: IntraOpModel,
    choice: Sequence[int],
    realised: _Realised,
    *,
    always: bool,
    num_micro_batches: int,
    memory_weight: float,
    index: GraphIndex | None,
) -> tuple[float, float, dict[int, ShardSpec], tuple[int, ...], dict[int, list[Collective]]]:
    """Rewrite gradient all-reduces over axes where the parameter is replicated.

    Per parameter: the all-reduce over the rewritten axes becomes a reduce-scatter,
    the update ops run on ``1 / factor`` of the values, the optimizer state is split
    further on the parameter's largest divisible dim, and the new parameter is
    all-gathered. ``always`` (ZERO2) applies it to every candidate; otherwise (AUTO)
    only where it does not worsen the objective (per-step seconds / B + memory weight
    x bytes): on tiny parameters the extra collective latency outweighs the savings.
    ``index`` (of the graph; built here when None) finds the update ops' writers.
    Returns (update seconds delta, weight bytes delta, new opt-state specs, params,
    the collectives that replace each rewritten parameter's all-reduces).
    """
    graph, mesh = model.graph, model.mesh
    specs = realised.specs
    inside = set(model.op_ids)
    weights = set(model.weights)
    writer = index.producer if index is not None else None  # tensor -> writer op
    seconds_total = bytes_total = 0.0
    new_specs: dict[int, ShardSpec] = {}
    rewritten = []
    replaced: dict[int, list[Collective]] = {}
    for k, param in enumerate(graph.params):
        if param not in specs or k not in realised.syncs:
            continue
        reduces = [c for c in realised.syncs[k] if c.kind is CollectiveKind.ALL_REDUCE]
        replicated_on = set(mesh.active_axes) - set(spec_axes(specs[param]))
        axes = sorted({a for c in reduces for a in c.axes} & replicated_on)
        tensor = graph.tensor(param)
        layout = _wus_layout(tensor.shape, specs[param], axes, mesh) if axes else None
        if layout is None:
            continue
        option, dim = layout
        factor = mesh.size_of(option)
        seconds = 0.0
        instead: list[Collective] = []
        for c in reduces:
            scattered = tuple(a for a in c.axes if a in option)
            rest = tuple(a for a in c.axes if a not in option)
            new = [Collective(CollectiveKind.REDUCE_SCATTER, scattered, c.nbytes,
                              reduce_scatter_seconds(mesh, scattered, c.nbytes))]
            if rest:
                share = c.nbytes / mesh.size_of(scattered)
                new.append(Collective(CollectiveKind.ALL_REDUCE, rest, share,
                                      all_reduce_seconds(mesh, rest, share)))
            seconds += sum(n.seconds for n in new) - c.seconds
            instead.extend(new)
        nbytes = tensor_bytes(tensor.shape, tensor.dtype)  # == tensor.nbytes, faster
        gathered = nbytes / shard_factor(specs[param], mesh)
        instead.append(Collective(CollectiveKind.ALL_GATHER, tuple(option), gathered,
                                  all_gather_seconds(mesh, option, gathered)))
        seconds += instead[-1].seconds
        # The elementwise update ops of this parameter (graph-wide: some may sit in
        # another subset) and the optimizer state they read.
        if writer is None:
            writer = GraphIndex.build(graph).producer
        new_param = graph.new_params[k] if k < len(graph.new_params) else -1
        stack, seen = [new_param], set()
        state_specs: dict[int, ShardSpec] = {}
        saved = 0.0
        while stack:
            t = stack.pop()
            op_id = int(writer[t]) if t >= 0 else -1
            if op_id < 0 or graph.ops[op_id].phase is not Phase.UPDATE or op_id in seen:
                continue
            seen.add(op_id)
            op = graph.ops[op_id]
            if graph.tensor(op.outputs[0]).shape != tensor.shape:
                continue
            stack.extend(op.inputs)
            if op_id in inside:
                strategy = model.op_strategies[op_id][choice[model.op_node[op_id]]]
                seconds -= strategy.compute_seconds * (1 - 1 / factor)
            for t_in in op.inputs:
                state = graph.tensor(t_in)
                if (
                    state.role is not TensorRole.OPT_STATE
                    or state.shape != tensor.shape
                    or t_in not in weights
                    or t_in in new_specs
                    or t_in in state_specs
                    or set(option) & set(spec_axes(specs[t_in]))
                ):
                    continue
                old = specs[t_in]
                new_spec = tuple(
                    tuple(sorted(s + option)) if i == dim else s for i, s in enumerate(old)
                )
                if is_valid_spec(new_spec, state.shape, mesh):
                    state_specs[t_in] = new_spec
                    state_bytes = tensor_bytes(state.shape, state.dtype)
                    saved -= state_bytes / shard_factor(old, mesh) * (1 - 1 / factor)
        if not always and seconds / num_micro_batches + memory_weight * saved > 0:
            continue
        seconds_total += seconds
        bytes_total += saved
        new_specs.update(state_specs)
        rewritten.append(param)
        replaced[k] = instead
    return seconds_total, bytes_total, new_specs, tuple(rewritten), replaced


def _validate(
    graph: OpGraph,
    op_ids: Sequence[int],
    num_micro_batches: int,
    activation_multiplier: int,
    memory_weight: float,
    time_limit_s: float,
) -> None:
    if not op_ids:
        raise ValueError("op_ids is empty: give the ops of a layer or stage")
    bad = [i for i in op_ids if not 0 <= i < len(graph.ops)]
    if bad:
        raise ValueError(f"op ids {bad[:5]} are not in graph {graph.name!r} ({len(graph.ops)} ops)")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if activation_multiplier < 0 or memory_weight < 0:
        raise ValueError("activation_multiplier and memory_weight must be >= 0")
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")


def _infeasible(
    model: IntraOpModel, activation_multiplier: int, budget: float, time_limit_s: float,
    solver: str,
) -> InfeasibleError:
    least = solve(model.memory_problem(activation_multiplier), time_limit_s=time_limit_s,
                  solver=solver)
    required = least.objective
    return InfeasibleError(
        f"ops {model.op_ids[0]}..{model.op_ids[-1]} of {model.graph.name!r} on a "
        f"{model.mesh.shape[0]}x{model.mesh.shape[1]} mesh do not fit: the least "
        f"memory any sharding needs is {required / _GIB:.2f} GiB per device, has "
        f"{budget / _GIB:.2f} GiB (budget); use more devices per stage, fewer "
        f"micro-batches in flight or a smaller micro-batch",
        required_bytes=required,
        available_bytes=budget,
    )


def solve_intra_op(
    graph: OpGraph,
    op_ids: Sequence[int],
    mesh: LogicalMesh,
    device: DeviceSpec,
    calibration: Calibration,
    *,
    mode: ShardingMode = ShardingMode.AUTO,
    num_micro_batches: int = 1,
    memory_budget_bytes: float | None = None,
    activation_multiplier: int = 1,
    memory_weight: float = 0.0,
    time_limit_s: float = 10.0,
    solver: str = "auto",
    presolve: bool = True,
    input_hints: Mapping[int, ShardSpec] | None = None,
    context: SolveContext | None = None,
    fixed_inputs: Mapping[int, ShardSpec] | None = None,
) -> IntraOpResult:
    """Shard ``op_ids`` of ``graph`` on ``mesh`` (see the module docstring).

    ``input_hints``: the spec each boundary input arrives in; another choice pays
    its resharding; ``fixed_inputs``: boundary inputs pinned to one spec each (see
    :func:`~alpajob.planner.intra_op.model.build_model`).

    ``memory_budget_bytes`` bounds ``weight + activation_multiplier * activation``
    bytes per device; when no sharding fits, raises :class:`InfeasibleError` with the
    least memory any sharding needs. ``solver`` is "auto" (HiGHS, else CBC), "highs"
    or "cbc"; ``presolve=False`` hands the whole model to the solver (for tests).
    Raises :class:`SolverError` when the solver finds nothing within ``time_limit_s``.

    ``context``: a :class:`SolveContext` of ``graph``, shared by the solves on it,
    reuses their precomputation (the graph's index, op strategy tables per mesh, the
    models of recent (ops, mesh, mode)); the result is the same with or without it.
    """
    mode = ShardingMode(mode)
    _validate(graph, op_ids, num_micro_batches, activation_multiplier, memory_weight,
              time_limit_s)
    start = time.perf_counter()
    if context is None:  # this solve's own: its index serves the model and the rewrite
        context = SolveContext(graph, max_models=0)
    model = build_model(graph, op_ids, mesh, device, calibration, mode, input_hints,
                        context=context, fixed_inputs=fixed_inputs)
    built = time.perf_counter()
    problem = model.problem(
        num_micro_batches, activation_multiplier, memory_weight, memory_budget_bytes
    )
    solution = solve(problem, time_limit_s=time_limit_s, solver=solver, presolve=presolve)
    if solution.status is SolveStatus.INFEASIBLE:
        if memory_budget_bytes is None:
            raise SolverError(
                f"the sharding ILP of ops {model.op_ids[0]}..{model.op_ids[-1]} has no "
                f"solution without a memory budget; this is a planner bug"
            )
        raise _infeasible(model, activation_multiplier, memory_budget_bytes, time_limit_s,
                          solver)
    realised = _realise(model, solution.choice)
    specs = dict(realised.specs)
    update = realised.update
    weight_bytes = realised.weight_bytes
    rewritten: tuple[int, ...] = ()
    replaced: dict[int, list[Collective]] = {}
    if mode is not ShardingMode.DATA:
        seconds_delta, bytes_delta, state_specs, rewritten, replaced = _weight_update_sharding(
            model,
            solution.choice,
            realised,
            always=mode in (ShardingMode.ZERO2, ShardingMode.EXPERT_ZERO2),
            num_micro_batches=num_micro_batches,
            memory_weight=memory_weight,
            index=context.index,
        )
        update += seconds_delta
        weight_bytes += bytes_delta
        specs.update(state_specs)
    collectives = [
        planned for planned, k in realised.collectives
        if k not in replaced or planned.collective.kind is not CollectiveKind.ALL_REDUCE
    ]
    for k, instead in replaced.items():
        param = model.graph.params[k]
        collectives.extend(
            PlannedCollective(c, None, param, True, model.graph.tensor(param).size)
            for c in instead
        )
    stats = IntraOpStats(
        num_ops=len(model.op_ids),
        num_nodes=len(model.nodes),
        num_edges=len(model.edges),
        nodes_after_presolve=solution.nodes_left,
        num_variables=solution.num_variables,
        num_constraints=solution.num_constraints,
        build_seconds=built - start,
        solve_seconds=solution.solve_seconds,
        solver=solution.solver,
        status=solution.status,
    )
    return IntraOpResult(
        compute_seconds=realised.compute,
        comm_seconds=realised.comm,
        update_seconds=update,
        weight_bytes=weight_bytes,
        activation_bytes=realised.activation_bytes,
        working_bytes=realised.working_bytes,
        objective=solution.objective,
        specs=specs,
        boundary_inputs=model.boundary_inputs,
        boundary_outputs=model.boundary_outputs,
        weight_update_sharded=rewritten,
        stats=stats,
        mesh=mesh,
        collectives=tuple(collectives),
    )


def brute_force_intra_op(
    graph: OpGraph,
    op_ids: Sequence[int],
    mesh: LogicalMesh,
    device: DeviceSpec,
    calibration: Calibration,
    *,
    mode: ShardingMode = ShardingMode.AUTO,
    num_micro_batches: int = 1,
    memory_budget_bytes: float | None = None,
    activation_multiplier: int = 1,
    memory_weight: float = 0.0,
) -> float:
    """The optimal objective of :func:`solve_intra_op` by exhaustive enumeration of
    every node's strategies (tiny graphs only: tests). Raises :class:`InfeasibleError`
    when nothing fits ``memory_budget_bytes``."""
    mode = ShardingMode(mode)
    _validate(graph, op_ids, num_micro_batches, activation_multiplier, memory_weight, 1.0)
    model = build_model(graph, op_ids, mesh, device, calibration, mode)
    problem = model.problem(
        num_micro_batches, activation_multiplier, memory_weight, memory_budget_bytes
    )
    best = brute_force(problem)
    if best.status is SolveStatus.INFEASIBLE:
        least = brute_force(model.memory_problem(activation_multiplier))
        budget = memory_budget_bytes if memory_budget_bytes is not None else 0.0
        raise InfeasibleError(
            f"needs {least.objective / _GIB:.2f} GiB per device, has {budget / _GIB:.2f} GiB "
            f"(budget)",
            required_bytes=least.objective,
            available_bytes=budget,
        )
    return best.objective
