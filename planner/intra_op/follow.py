"""Followers: ops that copy the strategy of one operand (paper section 4.2).

Elementwise ops, layout ops (``broadcast_in_dim``, ``transpose``, ``reshape``,
``squeeze``, ``expand_dims``), ops that resize unsplit dims (``slice``, ``pad``,
``concatenate``, ``cumsum``, ...) and reductions own no ILP variable: each takes the
strategy of one operand, its spec mapped through the op's dimension mapping. This
merging is what keeps the ILP small (a transformer layer's few hundred ops become a
few dozen nodes).

Mapping per kind (:class:`~alpajob.planner.intra_op.strategies.OpKind`):

- elementwise: same spec; other operands of the same shape must match it;
- broadcast: operand dim ``i`` -> output dim ``broadcast_dimensions[i]``;
- transpose: output dim ``i`` takes operand dim ``permutation[i]``;
- reshape: dims are grouped into runs of equal products; a split of a run's major
  dim becomes a split of the output run's major dim (``[B, S, H]`` split on B ->
  ``[B*S, H]`` split on dim 0); any other split does not map cleanly;
- resize: dims whose size changes, or that the op works along (``cumsum``'s axis),
  are replicated;
- reduction: kept dims keep their axes; a split reduced dim leaves partial results,
  all-reduced over its axes.

Where a spec does not map cleanly the affected dims are replicated: the op then
requires its operand in that less-sharded spec, which the ILP charges as a
resharding (an all-gather). Compute is divided by the output's shard count (the
input's for a reduction), so replicated work is charged in full.
"""

from __future__ import annotations

from collections.abc import Sequence

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import Calibration, LogicalMesh, all_reduce_seconds
from alpajob.planner.graph.opgraph import Op, OpGraph
from alpajob.planner.intra_op.collectives import Collective, CollectiveKind
from alpajob.planner.intra_op.sharding import ShardSpec, replicated, shard_factor, tensor_bytes
from alpajob.planner.intra_op.strategies import (
    OpKind,
    Strategy,
    named_dims,
    op_base_seconds,
    op_kind,
)


def _project(spec: ShardSpec, src: Sequence[int], dst: Sequence[int]) -> ShardSpec:
    """Carry ``spec`` from shape ``src`` to ``dst`` dim by dim: a dim keeps its axes
    when the ranks match and the dim has the same size, else it is replicated."""
    if len(src) != len(dst):
        return replicated(len(dst))
    return tuple(
        axes if a == b else () for axes, a, b in zip(spec, src, dst, strict=True)
    )


def _reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Split two shapes of equal size into runs of dims with equal products.

    (4, 6, 8) -> (24, 2, 4) gives [([0, 1], [0]), ([2], [1, 2])]. None when the
    sizes differ.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ins: list[int] = []
        outs: list[int] = []
        pa = pb = 1
        if i < len(a):
            ins.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            outs.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                outs.append(j)
                pb *= b[j]
                j += 1
            else:
                return None
        groups.append((ins, outs))
    return groups


def _reshape_map(
    spec: ShardSpec, src: Sequence[int], dst: Sequence[int], mesh: LogicalMesh
) -> tuple[ShardSpec, ShardSpec]:
    """(spec the operand must have, output spec) of a reshape from ``src`` to ``dst``.

    Within a group of dims, only a split of the group's major (first non-1) dim maps
    cleanly: it becomes a split of the output group's major dim, if that divides.
    [B, S, H] split on B -> [B*S, H] split on dim 0; [B, S, H] split on S -> [B*S, H]
    is not clean, so S is replicated first.
    """
    groups = _reshape_groups(src, dst)
    if groups is None:
        return replicated(len(src)), replicated(len(dst))
    need = list(spec)
    out: list[tuple[int, ...]] = [()] * len(dst)
    for ins, outs in groups:
        split = [d for d in ins if spec[d]]
        if not split:
            continue
        lead_in = next((d for d in ins if src[d] != 1), None)
        lead_out = next((d for d in outs if dst[d] != 1), None)
        axes = spec[split[0]]
        if (
            split == [lead_in]
            and lead_out is not None
            and dst[lead_out] % mesh.size_of(axes) == 0
        ):
            out[lead_out] = axes
        else:
            for d in ins:
                need[d] = ()
    return tuple(need), tuple(out)


def follow_strategy(
    op: Op,
    graph: OpGraph,
    operand: int,
    operand_spec: ShardSpec,
    mesh: LogicalMesh,
    device: DeviceSpec,
    calibration: Calibration,
    *,
    base_seconds: float | None = None,
) -> Strategy:
    """The strategy of follower ``op`` when its input number ``operand`` has
    ``operand_spec`` (see the module docstring for the mapping per kind).

    ``base_seconds``, the op's unsharded time, may be passed to save recomputing it.
    """
    kind = op_kind(op.primitive)
    src = graph.tensor(op.inputs[operand])
    out = graph.tensor(op.outputs[0])
    if base_seconds is None:
        base_seconds = op_base_seconds(op, graph, device, calibration)
    if kind is OpKind.ELEMENTWISE and all(
        graph.tensors[t].shape == out.shape for t in (*op.inputs, *op.outputs)
    ):  # the common case: everything in the operand's spec
        factor = shard_factor(operand_spec, mesh)
        return Strategy(
            f"follow:{op.primitive}",
            (operand_spec,) * len(op.outputs),
            (operand_spec,) * len(op.inputs),
            0.0,
            base_seconds / factor if base_seconds else 0.0,
        )
    need: ShardSpec = operand_spec
    collectives: tuple[Collective, ...] = ()
    if kind is OpKind.BROADCAST:
        dims = tuple(op.param("broadcast_dimensions", ()))
        if len(dims) != len(src.shape):
            dims = tuple(range(len(out.shape) - len(src.shape), len(out.shape)))
        need = tuple(
            axes if src.shape[i] == out.shape[dims[i]] else ()
            for i, axes in enumerate(operand_spec)
        )
        out_list: list[tuple[int, ...]] = [()] * len(out.shape)
        for i, axes in enumerate(need):
            out_list[dims[i]] = axes
        out_spec: ShardSpec = tuple(out_list)
    elif kind is OpKind.TRANSPOSE:
        perm = tuple(op.param("permutation", tuple(reversed(range(len(src.shape))))))
        out_spec = tuple(operand_spec[p] for p in perm)
    elif kind is OpKind.RESHAPE:
        need, out_spec = _reshape_map(operand_spec, src.shape, out.shape, mesh)
    elif kind is OpKind.RESIZE:
        if len(src.shape) == len(out.shape):
            # Replicate the dims the op works along or resizes, in any same-rank input.
            reset = named_dims(op)
            for tensor_id in op.inputs:
                shape = graph.tensor(tensor_id).shape
                if len(shape) == len(out.shape):
                    reset |= {d for d, size in enumerate(shape) if size != out.shape[d]}
            need = tuple(() if d in reset else axes for d, axes in enumerate(operand_spec))
            out_spec = need
        else:
            need, out_spec = replicated(len(src.shape)), replicated(len(out.shape))
    elif kind is OpKind.REDUCE:
        reduced = named_dims(op)
        out_spec = tuple(axes for d, axes in enumerate(operand_spec) if d not in reduced)
        if len(out_spec) != len(out.shape):
            out_spec = replicated(len(out.shape))
        split = tuple(sorted(k for d in reduced if d < len(operand_spec) for k in operand_spec[d]))
        if split:
            group_bytes = tensor_bytes(out.shape, out.dtype) / shard_factor(out_spec, mesh)
            seconds = all_reduce_seconds(mesh, split, group_bytes)
            collectives = (Collective(CollectiveKind.ALL_REDUCE, split, group_bytes, seconds),)
    elif src.shape == out.shape:  # elementwise
        out_spec = need
    else:  # elementwise with a differently shaped operand (no same-shaped one exists)
        same_rank = len(src.shape) == len(out.shape)
        need = _project(operand_spec, src.shape, out.shape) if same_rank else replicated(
            len(src.shape)
        )
        out_spec = _project(need, src.shape, out.shape)
    inputs = []
    for position, tensor_id in enumerate(op.inputs):
        if position == operand:
            inputs.append(need)
        elif kind in (OpKind.ELEMENTWISE, OpKind.RESIZE):
            shape = graph.tensor(tensor_id).shape
            inputs.append(_project(out_spec, out.shape, shape))
        else:
            inputs.append(replicated(len(graph.tensor(tensor_id).shape)))
    outputs = tuple(
        out_spec if graph.tensor(t).shape == out.shape else replicated(len(graph.tensor(t).shape))
        for t in op.outputs
    )
    work_spec = need if kind is OpKind.REDUCE else out_spec
    compute = base_seconds / shard_factor(work_spec, mesh) if base_seconds else 0.0
    comm = sum(c.seconds for c in collectives)
    return Strategy(
        f"follow:{op.primitive}", outputs, tuple(inputs), comm, compute, collectives
    )
