"""Rematerialise a stage one layer at a time, so its backward holds one layer's residuals.

A rematerialised stage keeps only each layer's inputs between its forward and its
backward, and the backward recomputes the layers' forwards. The planner prices that
(:class:`~alpajob.planner.inter_op.stage_costs.MemoryLevel`) as the layers' inputs
per in-flight micro-batch plus one layer's full residuals (and its backward's
working set) while its backward runs.

Wrapping the whole stage in one ``jax.checkpoint`` computes the right values but not
that memory: XLA schedules every layer's recomputation before the first layer's
backward, so the residuals of all the stage's layers are live at once. A
``jax.checkpoint`` per layer is no different, because nothing in the program says
layer ``k``'s recomputation must wait for layer ``k + 1``'s backward, and an
``optimization_barrier`` tying the two together is dropped by XLA's CPU compiler
before it schedules (``benchmarks/remat_memory.py`` measures all three).

So the stage runs as a chain of layers, each a :func:`jax.custom_vjp` function:

- **forward** runs the layer and saves its inputs (no copy: they are the values the
  stage already holds);
- **backward** first makes the layer's activation and batch inputs read the incoming
  cotangent, ``x + 0 * ct[0]``, then recomputes the layer from them and applies its
  VJP. The data dependency is what orders the schedule: layer ``k`` cannot be
  recomputed before layer ``k + 1``'s backward has produced ``k``'s cotangent, and by
  then layer ``k + 1``'s residuals are dead. The addition is exact for a finite
  cotangent (``x + 0 = x``); a non-finite one already makes the step's gradients
  non-finite, and a loss-scaled step is then skipped either way. It costs one
  element read per layer and one add over the layer's activation and batch inputs
  (parameters are not touched: adding to a weight would copy it).

**Where the layers are.** The plan names, for every parameter of a rematerialised
stage, the layer that first reads it (``StagePlan.param_layers``). The stage's
equations are placed on those layers exactly as the whole loss is placed on stages
(:func:`~.split.place_equations`: each equation no earlier than the parameters it
reads, the others where the fewest bytes cross), so a layer's saved inputs are as
small as the cut allows. Each layer becomes a :class:`~.split.StageProgram` of its
own, run by the stage's interpreter (plain or grouped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from alpajob.trainer_image.runtime.split import (
    SplitProgram,
    StageProgram,
    ValueId,
    place_equations,
    readers_of_stage,
    stage_env,
)

#: ``f(params, batch, inputs) -> (outputs, loss_or_None)``, as :func:`~.split.stage_function`.
StageRun = Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[list[Any], Any]]


def layer_programs(
    split: SplitProgram, stage: StageProgram, param_layers: Mapping[int, int], num_layers: int
) -> tuple[StageProgram, ...]:
    """Stage ``stage`` cut into ``num_layers`` consecutive programs (module docstring).

    ``param_layers`` maps a parameter leaf to its layer counted from the stage's first
    (clamped into ``0 .. num_layers - 1``; a leaf it does not name goes to layer 0).
    Layers that receive no equation are dropped, so the result may be shorter. A
    layer's ``outputs`` are the values a later layer or the stage's own outputs read;
    the last one returns the stage's loss if the stage does.
    """
    if num_layers <= 1 or not stage.eqns:
        return (stage,)
    param_layer = {
        split.param_ids[leaf]: min(max(param_layers.get(leaf, 0), 0), num_layers - 1)
        for leaf in stage.params
    }
    sinks = [split.loss] if stage.returns_loss else []
    placed = place_equations(stage.eqns, split.avals, split.consts, param_layer, sinks, num_layers)
    groups = [[e for e, p in zip(stage.eqns, placed, strict=True) if p == k] for k in range(num_layers)]
    groups = [g for g in groups if g]
    leaf_of = {vid: leaf for leaf, vid in enumerate(split.param_ids)}
    batch_leaf_of = {vid: leaf for leaf, vid in enumerate(split.batch_ids)}
    needed_after: set[ValueId] = set(stage.outputs)
    programs: list[StageProgram] = []
    for k in reversed(range(len(groups))):  # last layer first: what later layers read is known
        eqns = tuple(groups[k])
        produced = {o for e in eqns for o in e.outputs}
        reads = readers_of_stage(eqns)
        returns_loss = stage.returns_loss and split.loss in produced
        programs.append(StageProgram(
            index=stage.index,
            eqns=eqns,
            params=tuple(sorted(leaf_of[v] for v in reads if v in leaf_of)),
            batch=tuple(sorted(batch_leaf_of[v] for v in reads if v in batch_leaf_of)),
            inputs=tuple(sorted(v for v in reads
                                if v not in leaf_of and v not in batch_leaf_of and v not in split.consts)),
            outputs=tuple(sorted(v for v in produced if v in needed_after)),
            returns_loss=returns_loss,
        ))
        needed_after |= reads
    return tuple(reversed(programs))


def in_layers(
    make_run: Callable[[StageProgram], StageRun],
    split: SplitProgram,
    stage: StageProgram,
    layers: Sequence[StageProgram] | None,
) -> StageRun:
    """The stage's function, run by ``make_run`` (the stage's interpreter); with
    ``layers`` (:func:`layer_programs`), rematerialised layer by layer, each layer run
    by ``make_run`` inside :func:`chained_layer`."""
    if layers is None:
        return make_run(stage)
    runs = [chained_layer(make_run(layer)) for layer in layers]

    def run(params: Sequence[Any], batch: Sequence[Any], inputs: Sequence[Any]) -> tuple[list[Any], Any]:
        env = stage_env(split, stage, params, batch, inputs)
        loss = None
        for layer, layer_run in zip(layers, runs, strict=True):
            outs, layer_loss = layer_run(
                [env[split.param_ids[k]] for k in layer.params],
                [env[split.batch_ids[k]] for k in layer.batch],
                [env[v] for v in layer.inputs],
            )
            env.update(zip(layer.outputs, outs, strict=True))
            loss = layer_loss if layer.returns_loss else loss
        return [env[v] for v in stage.outputs], loss

    return run


def chained_layer(run: StageRun) -> StageRun:
    """``run`` as a rematerialised layer whose recomputation waits for its cotangent."""

    @jax.custom_vjp
    def layer(params: list[Any], batch: list[Any], inputs: list[Any]) -> tuple[list[Any], Any]:
        return run(params, batch, inputs)

    def forward(params: list[Any], batch: list[Any], inputs: list[Any]) -> tuple[Any, Any]:
        return run(params, batch, inputs), (params, batch, inputs)

    def backward(saved: Any, cotangent: Any) -> Any:
        params, batch, inputs = saved
        tie = _zero_from(cotangent)
        if tie is not None:
            inputs = [_plus(x, tie) for x in inputs]
            batch = [_plus(x, tie) for x in batch]
        _, vjp = jax.vjp(run, params, batch, inputs)
        return vjp(cotangent)

    layer.defvjp(forward, backward)
    return layer  # type: ignore[no-any-return]


def _zero_from(cotangent: Any) -> jax.Array | None:
    """``0 * (one element of a floating cotangent)``: a zero that the scheduler must
    wait for; None when no cotangent is floating point."""
    for leaf in jax.tree.leaves(cotangent):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size:
            return jnp.reshape(leaf, (-1,))[0].astype(jnp.float32) * 0.0
    return None


def _plus(x: Any, zero: jax.Array) -> Any:
    """``x + zero`` in ``x``'s own type, for numbers; anything else (booleans, PRNG
    keys) as it is."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        return x
    return x + zero.astype(dtype)
