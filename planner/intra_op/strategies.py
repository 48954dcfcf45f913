"""Per-primitive sharding strategies: the rows of Alpa's ILP (paper section 4.2).

A :class:`Strategy` of an op is the spec of each output, the spec each input must
arrive in, and what running the op that way costs (collectives, compute). Ops fall in
two families (:func:`op_kind`):

Strategy roots, each an ILP node with its own one-hot variable ``s_v``:

- ``dot_general``: every mesh axis goes to one "slot" (a batch dim, a free dim of the
  lhs, a free dim of the rhs, a contracting dim) or to none; both axes may take the
  same slot (split over both, axis 0 major). A split contracting dim leaves partial
  sums: all-reduce the output over those axes or, as an alternative strategy,
  reduce-scatter it onto the first unsplit output dim that divides. Among several
  free (or contracting) dims of one side only those up to the first that the whole
  mesh divides become slots. For ``x[B,S,H] @ W[H,F]`` with B divisible by the 2 x 2
  mesh the slots are B, F and H: 16 assignments plus 5 reduce-scatter variants,
  among them data parallelism "xy->l0", Megatron's column split "y->r0" (W
  ((), (1,)), output ((), (), (1,))) and row split "y->k0" (all-reduce).
- ``conv_general_dilated``: the same over the slots N (batch), O (output feature)
  and I (input feature, contracting); spatial dims are never split. A grouped or
  depthwise conv (``feature_group_count`` G) has N and G: whole groups per device,
  their input features, kernels and output features split together; its kernel
  gradient (``batch_group_count`` G) has G and I.
- generators (``random_bits``, ``iota``): their output in any tiling, each device
  making its own part (JAX's partitionable threefry gives the same bits as one
  device would), inputs (the key) replicated, compute divided; dropout masks then
  come sharded like the activations they mask instead of replicated;
- ``gather`` / ``scatter-add`` of one indexed dim (an embedding lookup and its
  gradient): the slots vocab, batch and hidden (:func:`_take_slots`); a split
  vocabulary is Megatron's vocabulary-parallel embedding;
- anything else (other gathers, scatter, sort, ...): replicated, plus "split the batch
  dim over axis 0 / axis 1 / both" when every output has a batch dim and the op does
  not name the batch dim as its axis (so it acts elementwise along the batch).

Every other op is a follower (:mod:`alpajob.planner.intra_op.follow`): it copies the strategy
of one operand and adds no ILP variable.

Compute is the op's roofline time divided by the number of devices that split the
work (:func:`alpajob.planner.cost.model.op_seconds`); replicated work is charged in
full on every device. A ``dot_general`` adds the traffic of its operands' shards on each
device (:func:`alpajob.planner.cost.model.matmul_operand_seconds`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import (
    Calibration,
    LogicalMesh,
    all_reduce_seconds,
    matmul_operand_seconds,
    op_seconds,
    reduce_scatter_seconds,
)
from alpajob.planner.graph.opgraph import Op, OpGraph, Phase, Tensor
from alpajob.planner.intra_op.collectives import Collective, CollectiveKind
from alpajob.planner.intra_op.sharding import (
    ShardSpec,
    replicated,
    shard_factor,
    tensor_bytes,
    tiling_specs,
)


class OpKind(StrEnum):
    """How an op takes part in the ILP."""

    DOT = "dot"  # root: dot_general slots
    CONV = "conv"  # root: conv_general_dilated slots
    OTHER = "other"  # root: replicated or batch-split
    ELEMENTWISE = "elementwise"  # follower, same shape
    BROADCAST = "broadcast"  # follower via broadcast_dimensions
    TRANSPOSE = "transpose"  # follower via permutation
    RESHAPE = "reshape"  # follower via dimension groups
    RESIZE = "resize"  # follower; resized (or scanned) dims replicated
    REDUCE = "reduce"  # follower; split reduced dims all-reduced

    @property
    def is_follower(self) -> bool:
        """Whether ops of this kind copy an operand's strategy instead of owning one."""
        return self not in (OpKind.DOT, OpKind.CONV, OpKind.OTHER)


_ELEMENTWISE = frozenset(
    {
        "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2",
        "bitcast_convert_type",
        "atanh", "cbrt", "ceil", "clamp", "conj", "convert_element_type", "copy", "copy_p",
        "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
        "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma",
        "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not",
        "or", "population_count", "pow", "real", "reduce_precision", "rem", "round", "rsqrt",
        "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
        "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
    }
)
_RESHAPE = frozenset({"reshape", "squeeze", "expand_dims"})
_RESIZE = frozenset(
    {
        "slice", "split", "pad", "concatenate", "dynamic_slice", "dynamic_update_slice", "rev",
        "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
        # Windowed ops (pooling and its backward): only their windowed dims resize.
        "reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window",
        "select_and_scatter_add", "select_and_gather_add", "select_and_scatter",
    }
)
_REDUCE = frozenset(
    {
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
        "argmax", "argmin",
    }
)
#: Ops whose output depends on no operand's layout: each device can make any part.
_GENERATORS = frozenset({"random_bits", "iota"})
#: Embedding lookups and their gradients, by number of inputs (see :func:`_take_slots`).
_TAKES = {"gather": 2, "scatter-add": 3, "scatter_add": 3}
#: Op params that name the dimensions an op works along.
_AXIS_PARAMS = ("axis", "axes", "dimension", "dimensions")


def named_dims(op: Op) -> set[int]:
    """The dims an op's params name as its working axes (``axes=(1,)``, ``axis=0``...),
    and for a windowed op (pooling) the dims its window spans, strides, dilates or pads:
    a 2 x 2 max-pool over ``[N, H, W, C]`` works along H and W, not N or C."""
    named = set().union(*(_int_values(op.param(p)) for p in _AXIS_PARAMS))
    window = op.param("window_dimensions")
    if window is None:
        return named
    trivial = {"window_dimensions": 1, "window_strides": 1, "window_dilation": 1,
               "base_dilation": 1, "padding": (0, 0)}
    for name, unit in trivial.items():
        for d, value in enumerate(op.param(name) or ()):
            if (tuple(value) if isinstance(value, (list, tuple)) else value) != unit:
                named.add(d)
    return named


def op_kind(primitive: str) -> OpKind:
    """The :class:`OpKind` of a primitive (unknown primitives are ``OTHER``)."""
    if primitive == "dot_general":
        return OpKind.DOT
    if primitive == "conv_general_dilated":
        return OpKind.CONV
    if primitive in _ELEMENTWISE:
        return OpKind.ELEMENTWISE
    if primitive == "broadcast_in_dim":
        return OpKind.BROADCAST
    if primitive == "transpose":
        return OpKind.TRANSPOSE
    if primitive in _RESHAPE:
        return OpKind.RESHAPE
    if primitive in _RESIZE:
        return OpKind.RESIZE
    if primitive in _REDUCE:
        return OpKind.REDUCE
    return OpKind.OTHER


@dataclass(frozen=True)
class Strategy:
    """One way to run an op: specs out and in, and what it costs (seconds)."""

    name: str
    output_specs: tuple[ShardSpec, ...]
    input_specs: tuple[ShardSpec, ...]
    comm_seconds: float
    compute_seconds: float
    collectives: tuple[Collective, ...] = ()


def _int_values(value: Any) -> set[int]:
    """All ints inside a (nested) op param value."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (tuple, list)):
        return set().union(*(_int_values(v) for v in value)) if value else set()
    return set()


def _op_dtype(op: Op, graph: OpGraph) -> str:
    if op.primitive in ("dot_general", "conv_general_dilated") and op.inputs:
        return graph.tensor(op.inputs[0]).dtype
    ids = op.outputs or op.inputs
    return graph.tensor(ids[0]).dtype if ids else "float32"


def op_base_seconds(
    op: Op, graph: OpGraph, device: DeviceSpec, calibration: Calibration
) -> float:
    """Roofline seconds of ``op`` on one device, unsharded (the optimizer update's
    ops with the calibration's ``update_fused_memory_fraction``)."""
    fused = calibration.update_fused_memory_fraction if op.phase is Phase.UPDATE else None
    return op_seconds(
        op.primitive, op.flops, op.bytes_accessed, _op_dtype(op, graph), device, calibration,
        fused,
    )


@dataclass(frozen=True)
class _Slot:
    """A dimension class of a dot, conv, gather or scatter: its dim in each input
    (None: not there) and in the output (None: contracted, partial sums), and size."""

    label: str
    ins: tuple[int | None, ...]
    out: int | None
    size: int


def _slot_strategies(
    slots: Sequence[_Slot],
    ins: Sequence[Tensor],
    out: Tensor,
    mesh: LogicalMesh,
    base: float,
    operand_byte_seconds: float = 0.0,
) -> list[Strategy]:
    """Every assignment of the active mesh axes to slots (or none), as strategies.

    Each device's compute is ``base`` over the devices that split it, plus
    ``operand_byte_seconds`` per byte of its input shards.
    """
    active = mesh.active_axes
    strategies = []
    for choice in itertools.product(range(-1, len(slots)), repeat=len(active)):
        slot_axes: list[list[int]] = [[] for _ in slots]
        for k, s in zip(active, choice, strict=True):
            if s >= 0:
                slot_axes[s].append(k)
        if any(slot.size % mesh.size_of(axes) for slot, axes in zip(slots, slot_axes, strict=True)):
            continue
        in_specs: list[list[tuple[int, ...]]] = [[()] * len(t.shape) for t in ins]
        out_spec: list[tuple[int, ...]] = [()] * len(out.shape)
        contract: list[int] = []
        used: list[int] = []
        names = []
        for slot, axes in zip(slots, slot_axes, strict=True):
            if not axes:
                continue
            names.append(f"{''.join(mesh.axis_names[k] for k in axes)}->{slot.label}")
            used.extend(axes)
            for spec, dim in zip(in_specs, slot.ins, strict=True):
                if dim is not None:
                    spec[dim] = tuple(axes)
            if slot.out is None:
                contract.extend(axes)
            else:
                out_spec[slot.out] = tuple(axes)
        name = ",".join(names) or "replicated"
        inputs = tuple(tuple(spec) for spec in in_specs)
        compute = base / mesh.size_of(used)
        if operand_byte_seconds:
            compute += operand_byte_seconds * sum(
                tensor_bytes(t.shape, t.dtype) / shard_factor(spec, mesh)
                for t, spec in zip(ins, inputs, strict=True)
            )
        out_t = tuple(out_spec)
        if not contract:
            strategies.append(Strategy(name, (out_t,), inputs, 0.0, compute))
            continue
        contract_axes = tuple(sorted(contract))
        group_bytes = tensor_bytes(out.shape, out.dtype) / shard_factor(out_t, mesh)
        seconds = all_reduce_seconds(mesh, contract_axes, group_bytes)
        reduce = Collective(CollectiveKind.ALL_REDUCE, contract_axes, group_bytes, seconds)
        strategies.append(Strategy(name, (out_t,), inputs, seconds, compute, (reduce,)))
        # Reduce-scatter variant: scatter onto the first free output dim that divides.
        free = [
            d
            for d, size in enumerate(out.shape)
            if not out_spec[d] and size % mesh.size_of(contract_axes) == 0
        ]
        for d in free[:1]:
            scattered = list(out_spec)
            scattered[d] = contract_axes
            rs_seconds = reduce_scatter_seconds(mesh, contract_axes, group_bytes)
            scatter = Collective(
                CollectiveKind.REDUCE_SCATTER, contract_axes, group_bytes, rs_seconds
            )
            strategies.append(
                Strategy(
                    f"{name},rs->out{d}",
                    (tuple(scattered),),
                    inputs,
                    rs_seconds,
                    compute,
                    (scatter,),
                )
            )
    return strategies


def _leading(dims: Sequence[int], shape: Sequence[int], devices: int) -> list[int]:
    """The dims up to the first one that all ``devices`` can split."""
    kept = []
    for d in dims:
        kept.append(d)
        if shape[d] % devices == 0:
            break
    return kept


def _dot_slots(op: Op, lhs: Tensor, rhs: Tensor, mesh: LogicalMesh) -> list[_Slot]:
    """Slots of a dot. Every batch dim is a slot (heads and batch both matter); among
    the free dims of one side, and among the contracting dims, only those up to the
    first that the whole mesh divides: ``x[B, S, H]`` with B divisible offers B but
    not S (what S could do, B does as well, and S-splits would blow up the ILP)."""
    lc, rc = op.param("contracting", ((), ()))
    lb, rb = op.param("batch", ((), ()))
    lf = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
    devices = mesh.size_of(mesh.active_axes)
    slots = [_Slot(f"b{i}", (lb[i], rb[i]), i, lhs.shape[lb[i]]) for i in range(len(lb))]
    for j in _leading(range(len(lf)), [lhs.shape[d] for d in lf], devices):
        slots.append(_Slot(f"l{j}", (lf[j], None), len(lb) + j, lhs.shape[lf[j]]))
    offset = len(lb) + len(lf)
    for j in _leading(range(len(rf)), [rhs.shape[d] for d in rf], devices):
        slots.append(_Slot(f"r{j}", (None, rf[j]), offset + j, rhs.shape[rf[j]]))
    for j in _leading(range(len(lc)), [lhs.shape[d] for d in lc], devices):
        slots.append(_Slot(f"k{j}", (lc[j], rc[j]), None, lhs.shape[lc[j]]))
    return slots


def _conv_slots(op: Op, lhs: Tensor, rhs: Tensor, out: Tensor) -> list[_Slot]:
    # extract spreads ConvDimensionNumbers into lhs_spec / rhs_spec / out_spec
    # ((batch, feature, spatial...), (out feature, in feature, spatial...), ...).
    default = tuple(range(len(lhs.shape)))
    numbers = op.param("dimension_numbers")
    if numbers is not None and len(numbers) == 3:
        lhs_spec, rhs_spec, out_spec = numbers
    else:
        lhs_spec = op.param("lhs_spec", default)
        rhs_spec = op.param("rhs_spec", default)
        out_spec = op.param("out_spec", default)
    features = op.param("feature_group_count", 1)
    batches = op.param("batch_group_count", 1)
    lhs_n, lhs_c = lhs_spec[0], lhs_spec[1]
    rhs_o, rhs_i = rhs_spec[0], rhs_spec[1]
    out_n, out_c = out_spec[0], out_spec[1]
    slots = []
    if batches == 1:
        slots.append(_Slot("N", (lhs_n, None), out_n, lhs.shape[lhs_n]))
    if features == 1 and batches == 1:
        slots.append(_Slot("O", (None, rhs_o), out_c, rhs.shape[rhs_o]))
    if features > 1:
        # Grouped (depthwise) conv: whole groups per device, their input features,
        # kernels and output features together.
        slots.append(_Slot("G", (lhs_c, rhs_o), out_c, features))
    if batches > 1:
        # A grouped conv's kernel gradient: batch group g makes output features g.
        slots.append(_Slot("G", (lhs_n, rhs_o), out_c, batches))
    if features == 1:
        slots.append(_Slot("I", (lhs_c, rhs_i), None, lhs.shape[lhs_c]))
    return slots


def _take_dims(op: Op, operand: Tensor) -> tuple[int, list[int]] | None:
    """(the indexed dim, the operand dims taken whole) of a gather or scatter that
    indexes one operand dim with one index per position (``table[ids]``,
    ``jnp.take(table, ids, axis=0)`` and its transposed scatter-add); None otherwise."""
    indexed = op.param("start_index_map", op.param("scatter_dims_to_operand_dims"))
    removed = op.param("collapsed_slice_dims", op.param("inserted_window_dims"))
    if (op.param("operand_batching_dims", ()) or not indexed or len(indexed) != 1
            or tuple(removed or ()) != tuple(indexed)):
        return None
    sizes = op.param("slice_sizes")
    whole = [d for d in range(len(operand.shape)) if d != indexed[0]]
    if sizes is not None and any(sizes[d] != operand.shape[d] for d in whole):
        return None
    return indexed[0], whole


def _take_slots(op: Op, ins: Sequence[Tensor], out: Tensor,
                mesh: LogicalMesh) -> list[_Slot] | None:
    """Slots of an embedding lookup (``gather``) or its gradient (``scatter-add``).

    Gather ``out[i..., w...] = table[ids[i...], w...]`` (inputs table, ids):

    - ``vocab``: the table's indexed dim. Each device looks up the ids in its rows
      (zeros elsewhere) and the partial outputs are all-reduced: Megatron's
      vocabulary-parallel embedding;
    - ``i{j}``: the ids' dim j and the output's j-th batch dim (data parallel);
    - ``w{k}``: a dim taken whole (the hidden dim) and its output dim.

    Scatter-add ``grad[ids[i...], w...] += upd[i..., w...]`` (inputs zeros, ids,
    updates): ``vocab`` splits the table's rows (each device adds the updates of its
    ids: no collective); ``i{j}`` splits the updates' batch, leaving partial sums to
    all-reduce (a gradient's data-parallel sync); ``w{k}`` as for gather.
    """
    operand, ids = ins[0], ins[1]
    taken = _take_dims(op, operand)
    if taken is None or len(ids.shape) < 1 or ids.shape[-1] != 1:
        return None
    vocab, whole = taken
    devices = mesh.size_of(mesh.active_axes)
    batch_ids = _leading(range(len(ids.shape) - 1), ids.shape[:-1], devices)
    if op.primitive == "gather":
        windows = tuple(op.param("offset_dims", ()))
        batch_out = [d for d in range(len(out.shape)) if d not in windows]
        if len(windows) != len(whole) or len(batch_out) != len(ids.shape) - 1:
            return None
        slots = [_Slot("vocab", (vocab, None), None, operand.shape[vocab])]
        slots += [_Slot(f"i{j}", (None, j), batch_out[j], ids.shape[j]) for j in batch_ids]
        slots += [_Slot(f"w{k}", (d, None), windows[k], operand.shape[d])
                  for k, d in enumerate(whole)]
        return slots
    updates = ins[2]
    windows = tuple(op.param("update_window_dims", ()))
    batch_upd = [d for d in range(len(updates.shape)) if d not in windows]
    if len(windows) != len(whole) or len(batch_upd) != len(ids.shape) - 1:
        return None
    slots = [_Slot("vocab", (vocab, None, None), vocab, operand.shape[vocab])]
    slots += [_Slot(f"i{j}", (None, j, batch_upd[j]), None, ids.shape[j]) for j in batch_ids]
    slots += [_Slot(f"w{k}", (d, None, windows[k]), d, operand.shape[d])
              for k, d in enumerate(whole)]
    return slots


def _generator_strategies(op: Op, graph: OpGraph, mesh: LogicalMesh,
                          base: float) -> list[Strategy]:
    """Every tiling of a generator's one output; its inputs replicated."""
    out = graph.tensor(op.outputs[0])
    ins = tuple(replicated(len(graph.tensor(t).shape)) for t in op.inputs)
    return [
        Strategy(_spec_name(spec, mesh), (spec,), ins, 0.0, base / shard_factor(spec, mesh))
        for spec in tiling_specs(out.shape, mesh)
    ]


def _spec_name(spec: ShardSpec, mesh: LogicalMesh) -> str:
    """``"x->0,y->1"`` for a spec splitting dim 0 over x and dim 1 over y."""
    parts = [f"{''.join(mesh.axis_names[k] for k in axes)}->{d}"
             for d, axes in enumerate(spec) if axes]
    return ",".join(parts) or "replicated"


def _other_strategies(op: Op, graph: OpGraph, mesh: LogicalMesh, base: float) -> list[Strategy]:
    if op.primitive in _GENERATORS and len(op.outputs) == 1:
        return _generator_strategies(op, graph, mesh, base)
    ins = [graph.tensor(t) for t in op.inputs]
    outs = [graph.tensor(t) for t in op.outputs]
    rep = Strategy(
        "replicated",
        tuple(replicated(len(t.shape)) for t in outs),
        tuple(replicated(len(t.shape)) for t in ins),
        0.0,
        base,
    )
    strategies = [rep]
    named = named_dims(op)
    safe = (
        bool(outs)
        and all(t.batch_dim is not None for t in outs)
        and (not ins or any(t.batch_dim is not None for t in ins))
        and not any(t.batch_dim in named for t in ins + outs)
    )
    if not safe:
        return strategies
    active = mesh.active_axes
    options = [(k,) for k in active] + ([tuple(active)] if len(active) > 1 else [])
    for axes in options:
        factor = mesh.size_of(axes)

        def split(t: Tensor, axes: tuple[int, ...] = axes) -> ShardSpec:
            spec: list[tuple[int, ...]] = [()] * len(t.shape)
            if t.batch_dim is not None:
                spec[t.batch_dim] = axes
            return tuple(spec)

        if any(t.batch_dim is not None and t.shape[t.batch_dim] % factor for t in ins + outs):
            continue
        label = "".join(mesh.axis_names[k] for k in axes)
        strategies.append(
            Strategy(
                f"{label}->batch",
                tuple(split(t) for t in outs),
                tuple(split(t) for t in ins),
                0.0,
                base / factor,
            )
        )
    return strategies


def op_strategies(
    op: Op,
    graph: OpGraph,
    mesh: LogicalMesh,
    device: DeviceSpec,
    calibration: Calibration,
) -> tuple[Strategy, ...]:
    """The strategies of a root op (``dot_general``, ``conv_general_dilated``, other).

    Replicated is always among them, so every op has at least one strategy.
    """
    kind = op_kind(op.primitive)
    base = op_base_seconds(op, graph, device, calibration)
    if kind is OpKind.DOT and len(op.inputs) == 2 and len(op.outputs) == 1:
        lhs, rhs = graph.tensor(op.inputs[0]), graph.tensor(op.inputs[1])
        out = graph.tensor(op.outputs[0])
        slots = _dot_slots(op, lhs, rhs, mesh)
        # Once per execution: a dot inside a scan runs (and pays) once per trip.
        per_byte = matmul_operand_seconds(1.0, device, calibration) * op.multiplier
        return tuple(_slot_strategies(slots, (lhs, rhs), out, mesh, base, per_byte))
    if kind is OpKind.CONV and len(op.inputs) == 2 and len(op.outputs) == 1:
        lhs, rhs = graph.tensor(op.inputs[0]), graph.tensor(op.inputs[1])
        out = graph.tensor(op.outputs[0])
        slots = _conv_slots(op, lhs, rhs, out)
        return tuple(_slot_strategies(slots, (lhs, rhs), out, mesh, base))
    if op.primitive in _TAKES and len(op.inputs) == _TAKES[op.primitive] and len(op.outputs) == 1:
        ins = [graph.tensor(t) for t in op.inputs]
        out = graph.tensor(op.outputs[0])
        take_slots = _take_slots(op, ins, out, mesh)
        if take_slots is not None:
            return tuple(_slot_strategies(take_slots, ins, out, mesh, base))
    return tuple(_other_strategies(op, graph, mesh, base))
