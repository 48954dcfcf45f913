"""Turn the winning candidate into the Plan document (contract 2).

Reads every decision back out of the per-layer ILP solutions: the PartitionSpec of each
parameter, of each tensor entering or leaving a stage and of the output of each forward
op the trainer pins (``PINNED_PRIMITIVES``), which parameters got
weight-update sharding, and the cross-mesh resharding tasks between stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alpajob.api.plan import (
    PINNED_PRIMITIVES,
    LayerInfo,
    ModelInfo,
    PinnedOp,
    Plan,
    ReshardingTask,
    SolverStats,
    SpecEntry,
    StagePlan,
)
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.graph.opgraph import OpGraph, Phase, TensorRole
from alpajob.planner.inter_op.pools import PoolCandidate
from alpajob.planner.inter_op.remat_pieces import piece_of_forward
from alpajob.planner.inter_op.schedules import bubble_fraction
from alpajob.planner.inter_op.search import Candidate, CostContext
from alpajob.planner.inter_op.stage_costs import (
    MEMORY_LEVELS,
    LayerCoster,
    Link,
    StageEval,
    forward_range,
)
from alpajob.planner.inter_op.stage_dp import assign_submeshes
from alpajob.planner.intra_op.sharding import ShardSpec, to_partition_spec

AXIS_NAMES = ("x", "y")


def _spec_json(spec: ShardSpec | None, ndim: int) -> list[SpecEntry]:
    if spec is None:
        return [None] * ndim
    out: list[SpecEntry] = []
    for entry in to_partition_spec(spec, AXIS_NAMES):
        out.append(list(entry) if isinstance(entry, tuple) else entry)
    return out


def _layer_of_tensor_use(coster: LayerCoster, graph: OpGraph, stage: StageEval) -> dict[int, int]:
    """For each tensor some op of the stage reads or writes, the first such layer."""
    seen: dict[int, int] = {}
    for layer in range(stage.first, stage.last + 1):
        for op_id in coster.layers[layer]:
            op = graph.ops[op_id]
            for tensor in (*op.inputs, *op.outputs):
                seen.setdefault(tensor, layer)
    return seen


def _part_of_param(
    coster: LayerCoster, graph: OpGraph, stage: StageEval, names: dict[int, str]
) -> dict[str, int]:
    """For a stage rematerialised by block parts, each parameter's part counted from
    the stage's first: the part of the forward op that first reads it (each layer
    cut as its class was costed, :meth:`LayerCoster.pieces`). Empty otherwise."""
    if not stage.remat_parts:
        return {}
    keep = MEMORY_LEVELS[stage.level].parts
    part_of: dict[str, int] = {}
    offset = 0
    for layer in range(stage.first, stage.last + 1):
        cut = coster.pieces(layer, keep).cut
        piece = piece_of_forward(graph, coster.layers[layer], cut)
        for op_id in sorted(piece):  # forward program order
            for tensor in graph.ops[op_id].inputs:
                if tensor in names and graph.tensors[tensor].role is TensorRole.PARAM:
                    part_of.setdefault(names[tensor], offset + piece[op_id])
        offset += len(cut) - 1
    return part_of


def _stage_plan(
    index: int,
    stage: StageEval,
    slots: list[tuple[int, int]],
    coster: LayerCoster,
    graph: OpGraph,
) -> StagePlan:
    def spec_of(tensor: int, layer: int) -> list[SpecEntry]:
        spec = coster.spec(layer, tensor, stage.submesh, stage.shape, stage.level)
        return _spec_json(spec, len(graph.tensors[tensor].shape))

    used = _layer_of_tensor_use(coster, graph, stage)
    names = dict(zip(graph.params, graph.param_names or [str(p) for p in graph.params], strict=False))
    layer_of_param = {t: layer for t, layer in used.items()
                      if graph.tensors[t].role is TensorRole.PARAM and t in names}
    params = {names[t]: spec_of(t, layer) for t, layer in layer_of_param.items()}
    batch = {str(k): spec_of(t, used[t]) for k, t in enumerate(graph.batch) if t in used}
    inputs = {}
    for tensor, _src, dst in coster.crossing_tensors(stage.first):
        if stage.first <= dst <= stage.last:
            inputs[str(tensor)] = spec_of(tensor, dst)
    outputs = {}
    for tensor, src, _dst in coster.crossing_tensors(stage.last + 1):
        if stage.first <= src <= stage.last:
            outputs[str(tensor)] = spec_of(tensor, src)
    pinned = []
    for layer in range(stage.first, stage.last + 1):
        for op_id in coster.layers[layer]:
            op = graph.ops[op_id]
            if op.phase is Phase.FORWARD and op.primitive in PINNED_PRIMITIVES and len(op.outputs) == 1:
                out = op.outputs[0]
                pinned.append(PinnedOp(op=op_id, primitive=op.primitive,
                                       shape=list(graph.tensors[out].shape), sharding=spec_of(out, layer)))
    pinned.sort(key=lambda p: p.op)
    wus: set[str] = set()
    for layer in range(stage.first, stage.last + 1):
        result = coster.result(layer, stage.submesh, stage.shape, stage.level)
        for tensor in result.weight_update_sharded:
            own = coster.from_representative(layer, tensor)
            if own is not None and own in names:
                wus.add(names[own])
    return StagePlan(
        index=index,
        layers=(stage.first, stage.last + 1),
        submesh_shape=stage.submesh,
        device_slots=slots,
        logical_mesh_shape=stage.shape,
        axis_names=AXIS_NAMES,
        predicted_seconds=stage.seconds,
        compute_seconds=stage.compute,
        communication_seconds=stage.comm + stage.transfer,
        update_seconds=stage.update,
        peak_memory_bytes=stage.peak_memory,
        weight_bytes=stage.weight_bytes,
        activation_bytes=stage.activation_bytes,
        in_flight_micro_batches=stage.in_flight,
        rematerialize=stage.remat,
        param_layers={names[t]: layer for t, layer in layer_of_param.items()},
        param_parts=_part_of_param(coster, graph, stage, names),
        param_shardings=params,
        input_shardings=inputs,
        output_shardings=outputs,
        batch_shardings=batch,
        weight_update_sharded=sorted(wus),
        pinned_ops=pinned,
    )


def _resharding(coster: LayerCoster, graph: OpGraph, stages: Sequence[StageEval],
                costers: Sequence[LayerCoster] | None = None,
                links: Sequence[Link | None] | None = None) -> list[ReshardingTask]:
    """One task per tensor crossing between two consecutive stages. In a plan across
    GPU types ``costers[q]`` holds stage ``q``'s solutions (its pool's) and
    ``links[q]`` the link stage ``q`` receives on."""
    costers = costers or [coster] * len(stages)
    links = links or [None] * len(stages)
    tasks = []
    stage_of_layer = {}
    for index, stage in enumerate(stages):
        for layer in range(stage.first, stage.last + 1):
            stage_of_layer[layer] = index
    for stage in stages[1:]:
        for tensor, src, dst in coster.crossing_tensors(stage.first):
            src_stage, dst_stage = stage_of_layer[src], stage_of_layer[dst]
            if src_stage == dst_stage:
                continue
            s, d = stages[src_stage], stages[dst_stage]
            src_spec = costers[src_stage].spec(src, tensor, s.submesh, s.shape, s.level)
            dst_spec = costers[dst_stage].spec(dst, tensor, d.submesh, d.shape, d.level)
            info = graph.tensors[tensor]
            dst_json = _spec_json(dst_spec, len(info.shape))
            replicated_dst = all(e is None for e in dst_json)
            tasks.append(
                ReshardingTask(
                    src_stage=src_stage,
                    dst_stage=dst_stage,
                    tensor=tensor,
                    direction="forward" if src < dst else "backward",
                    shape=list(info.shape),
                    dtype=info.dtype,
                    bytes=info.nbytes,
                    src_sharding=_spec_json(src_spec, len(info.shape)),
                    dst_sharding=dst_json,
                    # Alpa's cross-mesh resharding: send each needed tile once; a
                    # replicated destination gets one copy and all-gathers locally.
                    strategy="send-once+local-allgather" if replicated_dst else "send-tiles",
                    predicted_seconds=costers[dst_stage].transfer_seconds(info.nbytes, links[dst_stage]),
                )
            )
    return tasks


def assemble_plan(
    *,
    method: str,
    graph: OpGraph,
    cluster: ClusterSpec,
    context: CostContext,
    candidate: Candidate,
    solver: SolverStats,
    baselines: dict[str, float | None] | None,
) -> Plan:
    """The Plan document for ``candidate`` (costed in ``context``)."""
    coster = context.coster(candidate.num_micro_batches, candidate.mode)
    micro = coster.graph
    slots = assign_submeshes(
        [s.submesh for s in candidate.stages], cluster.num_nodes, cluster.devices_per_node
    )
    stages = [
        _stage_plan(i, stage, [tuple(x) for x in slots[i]], coster, micro)  # type: ignore[misc]
        for i, stage in enumerate(candidate.stages)
    ]
    return _document(method, graph, cluster.to_dict(), context, candidate, stages,
                     _resharding(coster, micro, candidate.stages), solver, baselines)


def assemble_pools_plan(*, graph: OpGraph, contexts: Sequence[CostContext], link: Link,
                        candidate: PoolCandidate, solver: SolverStats, method: str = "auto") -> Plan:
    """The Plan document of a plan across GPU types (found by ``method``: auto or
    pipeshard): ``cluster.pools`` lists each
    pool (its preset, nodes, devices per node, and ``first_node``, where its nodes
    start in the slots' node numbering), each stage names its ``pool`` and takes its
    slots inside it, specs come from the stage's own pool's solutions, and a tensor
    crossing between pools is costed on ``link``."""
    costers = [contexts[p].coster(candidate.num_micro_batches, candidate.mode) for p in candidate.pools]
    micro = costers[0].graph
    first, pools = 0, []
    for context in contexts:
        pools.append(context.cluster.to_dict() | {"first_node": first})
        first += context.cluster.num_nodes
    per_node = max(c.cluster.devices_per_node for c in contexts)
    stages = []
    for pool, context in enumerate(contexts):
        mine = [q for q, p in enumerate(candidate.pools) if p == pool]
        placed = assign_submeshes([candidate.stages[q].submesh for q in mine], context.cluster.num_nodes,
                                  context.cluster.devices_per_node)
        for q, slots in zip(mine, placed, strict=True):
            stage = _stage_plan(q, candidate.stages[q], [(node + pools[pool]["first_node"], gpu)
                                                         for node, gpu in slots], costers[q], micro)
            stages.append(stage.model_copy(update={"pool": pool}))
    stages.sort(key=lambda s: s.index)
    links: list[Link | None] = [None if q == 0 or candidate.pools[q - 1] == p else link
                                for q, p in enumerate(candidate.pools)]
    cluster = {"preset": "+".join(c.cluster.preset for c in contexts), "num_nodes": first,
               "devices_per_node": per_node, "pools": pools,
               "pool_link": {"latency": link[0], "bandwidth": link[1]}}
    return _document(method, graph, cluster, contexts[0], candidate, stages,
                     _resharding(costers[0], micro, candidate.stages, costers, links), solver, None)


def _document(method: str, graph: OpGraph, cluster: dict[str, Any], context: CostContext, candidate: Candidate,
              stages: list[StagePlan], resharding: list[ReshardingTask], solver: SolverStats,
              baselines: dict[str, float | None] | None) -> Plan:
    layers = []
    for index, ops in enumerate(context.layers):
        param_bytes = sum(
            graph.tensors[t].nbytes
            for t in {t for o in ops for t in graph.ops[o].inputs}
            if graph.tensors[t].role is TensorRole.PARAM
        )
        layers.append(
            LayerInfo(
                index=index,
                forward_ops=forward_range(graph, ops),
                num_ops=len(ops),
                flops=float(sum(graph.ops[o].flops for o in ops)),
                param_bytes=param_bytes,
            )
        )
    dtypes = {graph.tensors[t].dtype for t in graph.params}
    return Plan(
        method=method,
        model=ModelInfo(
            name=graph.name,
            fingerprint=graph.fingerprint(),
            num_parameters=graph.num_parameters,
            flops_per_step=graph.total_flops,
            dtype=sorted(dtypes)[0] if dtypes else "float32",
            num_ops=len(graph.ops),
        ),
        cluster=cluster,
        global_batch_size=graph.batch_size,
        num_micro_batches=candidate.num_micro_batches,
        schedule=context.schedule.value,
        layers=layers,
        stages=stages,
        resharding=resharding,
        predicted_step_seconds=candidate.step_seconds,
        predicted_pflops=graph.total_flops / candidate.step_seconds / 1e15,
        bubble_fraction=bubble_fraction(len(candidate.stages), candidate.num_micro_batches),
        solver=solver,
        baselines=baselines,
    )
