"""Grouped data-parallel stages: parameter gradients that stay per device.

On a data-parallel stage (every parameter replicated over the stage's devices, the
batch split over them) a parameter's gradient is a sum over the batch. GSPMD
finishes that sum with an all-reduce inside the executable that computes it, so a
backward per micro-batch pays one gradient all-reduce per micro-batch: B per step,
where Alpa (and our planner) pay one, after the last micro-batch.

Grouping keeps the sum per device until the step's end:

1. Every value of the traced loss gets its **batch dimension**, found by tracing
   the loss at two micro-batch sizes and comparing shapes (:func:`batch_dims`):
   the one dimension that doubles, or none.
2. The stage receives its parameters as **copies per device**, stacked on a
   leading *group* axis of size G (the stage's devices) and sharded over it.
3. Every equation that reads such a grouped value runs under ``jax.vmap`` over the
   group axis. Its batch operands are cut the same way, ``[.., b, ..] -> [G, ..,
   b/G, ..]``: device k's slice of the batch meets device k's copy. Its outputs that
   have a batch dimension are merged back; batch-free ones stay grouped (a
   parameter's broadcast, say). Everything else runs unchanged on the whole batch,
   so an op that couples the batch (a loss's mean) computes what one device would.
4. The gradient with respect to the copies is ``[G, ...]``, sharded over the group
   axis: device k's own partial sum, with no all-reduce. The runtime accumulates
   it over the micro-batches and sums the G copies once, in the update.

A stage that cannot be grouped raises :class:`NotGroupable` (it then keeps its
per-micro-batch all-reduce):

- an equation that reads a parameter and sums over the batch in the same step (a
  parameter's gradient would then be complete on every device already);
- a convolution that reads a parameter: GSPMD partitions a vmapped convolution
  wrongly when both operands are split along the vmapped axis (error 14 against
  1e-6 in a 10-line reproduction);
- a loss that traces to another program at another batch size, or a batch
  dimension that does not divide into G.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from alpajob.trainer_image.runtime.split import (
    FlatEqn,
    SplitProgram,
    StageProgram,
    ValueId,
    flatten,
    read_atom,
    stage_env,
)

#: Primitives never run grouped (module docstring).
_REFUSED = frozenset({"conv_general_dilated"})


class NotGroupable(ValueError):
    """The stage cannot run grouped; the message names what stops it."""


def batch_dims(
    loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch_shapes: Callable[[int], Any], micro_batch: int
) -> tuple[int | None, ...]:
    """Per value id of :func:`~.split.flatten` at ``micro_batch``, its batch dimension
    (None for batch-free values), from a second trace at twice the micro-batch."""
    small, _, _ = flatten(loss_fn, params, batch_shapes(micro_batch))
    large, _, _ = flatten(loss_fn, params, batch_shapes(2 * micro_batch))
    if len(small.avals) != len(large.avals) or any(
        a.primitive != b.primitive for a, b in zip(small.eqns, large.eqns, strict=False)
    ):
        raise NotGroupable("the loss traces to a different program at another batch size")
    dims: list[int | None] = []
    for vid, (a, b) in enumerate(zip(small.avals, large.avals, strict=True)):
        one, two = tuple(getattr(a, "shape", ())), tuple(getattr(b, "shape", ()))
        differ = [i for i, (x, y) in enumerate(zip(one, two, strict=False)) if x != y]
        if len(one) != len(two) or len(differ) > 1 or any(two[i] != 2 * one[i] for i in differ):
            raise NotGroupable(f"value {vid} has shape {one} at batch {micro_batch} and {two} at "
                               f"{2 * micro_batch}: no single batch dimension")
        dims.append(differ[0] if differ else None)
    return tuple(dims)


def group_batch(x: jax.Array, dim: int, groups: int) -> jax.Array:
    """``[.., b, ..] -> [G, .., b/G, ..]``: group k holds rows ``k b/G .. (k+1) b/G``."""
    shape = x.shape
    if shape[dim] % groups:
        raise NotGroupable(f"a batch dimension of {shape[dim]} does not divide into {groups} devices")
    x = x.reshape(shape[:dim] + (groups, shape[dim] // groups) + shape[dim + 1:])
    return jnp.moveaxis(x, dim, 0)


def ungroup_batch(y: jax.Array, dim: int) -> jax.Array:
    """The inverse of :func:`group_batch`."""
    y = jnp.moveaxis(y, 0, dim)
    shape = y.shape
    return y.reshape(shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2:])


def grouped_stage_function(
    split: SplitProgram,
    stage: StageProgram,
    dims: Sequence[int | None],
    groups: int,
    group_sharding: Any,
    pins: Mapping[ValueId, Any] | None = None,
) -> Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[list[Any], Any]]:
    """Like :func:`~.split.stage_function`, but ``f(grouped_params, batch, inputs)``
    takes every parameter as ``[groups, ...]`` copies (module docstring).
    ``group_sharding`` shards a leading group axis over the stage's devices."""
    pins = dict(pins or {})

    def run(params: Sequence[Any], batch: Sequence[Any], inputs: Sequence[Any]) -> tuple[list[Any], Any]:
        env = stage_env(split, stage, params, batch, inputs)
        grouped = {split.param_ids[leaf] for leaf in stage.params}
        for eqn in stage.eqns:
            values = [read_atom(split, env, v) for v in eqn.inputs]
            if any(isinstance(v, int) and v in grouped for v in eqn.inputs):
                results = _grouped_eqn(eqn, values, grouped, dims, groups, group_sharding, split.avals)
            else:
                result = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
                results = result if eqn.primitive.multiple_results else [result]
            for vid, value in zip(eqn.outputs, results, strict=True):
                if vid in grouped:
                    value = jax.lax.with_sharding_constraint(value, group_sharding)
                elif vid in pins:
                    value = jax.lax.with_sharding_constraint(value, pins[vid])
                env[vid] = value
        outputs = [env[v] for v in stage.outputs]
        if any(v in grouped for v in stage.outputs) or (stage.returns_loss and split.loss in grouped):
            raise NotGroupable("a stage output depends on the parameters alone")
        return outputs, (env[split.loss] if stage.returns_loss else None)

    return run


def _grouped_eqn(
    eqn: FlatEqn, values: list[Any], grouped: set[ValueId], dims: Sequence[int | None], groups: int,
    group_sharding: Any, avals: Sequence[Any],
) -> list[Any]:
    """One equation that reads a grouped value, vmapped over the group axis; marks its
    batch-free outputs grouped (module docstring, step 3). Every output must come out
    in its traced shape (with the group axis in front if grouped)."""
    name = eqn.primitive.name
    if name in _REFUSED:
        raise NotGroupable(f"{name} reads a parameter (GSPMD partitions a vmapped {name} wrongly)")
    args: list[Any] = []
    axes: list[int | None] = []
    batched = False
    for atom, value in zip(eqn.inputs, values, strict=True):
        dim = dims[atom] if isinstance(atom, int) else None
        if isinstance(atom, int) and atom in grouped:
            args.append(value)
            axes.append(0)
        elif dim is not None:
            args.append(jax.lax.with_sharding_constraint(group_batch(value, dim, groups), group_sharding))
            axes.append(0)
            batched = True
        else:
            args.append(value)
            axes.append(None)
    out_dims = [dims[v] for v in eqn.outputs]
    params = eqn.primitive.get_bind_params(eqn.params)
    if batched and any(d is None for d in out_dims):
        raise NotGroupable(f"{name} reads a parameter and sums over the batch")
    if not batched and any(d is not None for d in out_dims):
        if name != "broadcast_in_dim":
            raise NotGroupable(f"{name} makes a batch dimension from a parameter")
        shape = list(params["shape"])
        shape[out_dims[0]] //= groups  # type: ignore[index]
        params = dict(params, shape=tuple(shape))

    def bind(*xs: Any) -> Any:
        return eqn.primitive.bind(*xs, **params)

    result = jax.vmap(bind, in_axes=axes)(*args)
    results = result if eqn.primitive.multiple_results else [result]
    out = []
    for vid, value, dim in zip(eqn.outputs, results, out_dims, strict=True):
        if dim is None:
            grouped.add(vid)
        else:
            value = ungroup_batch(value, dim)
        expected = ((groups,) if dim is None else ()) + tuple(avals[vid].shape)
        if tuple(value.shape) != expected:
            raise NotGroupable(f"{name} gives shape {tuple(value.shape)} grouped, not {expected}")
        out.append(value)
    return out
