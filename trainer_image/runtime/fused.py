"""A plan of one stage as one executable: the whole training step in one ``jax.jit``.

A pipeline stage runs as separate forward, backward and update executables
(:mod:`.stage`), because other stages' work interleaves with its own. A plan of ONE
stage has nothing to interleave, and splitting its step costs what plain JAX does
not pay: every forward hands its residuals out of an executable and the backward
reads them back (no fusion across the boundary, the residuals all live at once), and
every executable is a launch and a host round of Python. So a one-stage step is
traced into one program, :func:`fused_step`:

1. the stage's parameters as its forward reads them (a grouped data-parallel
   stage's per-device copies, :mod:`.grouped`);
2. the micro-batches under ``jax.lax.scan``: each runs the stage's forward and
   backward, adding its float32 gradients to accumulators that are the scan's carry
   (a grouped stage's accumulators are per device, so the gradient all-reduce
   happens once per step, after the scan, as the plan charges; a stage whose
   parameters are sharded keeps GSPMD's per-micro-batch reduction, as its separate
   executables did). One micro-batch runs without a scan;
3. the update: the stage's own optax update (the grouped stage's one reduction),
   times ``1 / scale``; with a loss scale, a step whose gradients are not all finite
   keeps the old parameters and optimizer state (``jnp.where``, no host round trip).

The forward, backward and update it calls are the stage's own jitted functions: a
``jax.jit`` called inside another one is inlined into it, with its in- and out-
shardings as sharding constraints, so the plan's parameter, batch and pinned-op
shardings hold as in the separate executables, and the numerics are theirs (the
parallel == serial tests run this path). Parameters and optimizer state are donated
and come back with the shardings they went in with.

Why GSPMD constraints and not ``shard_map`` or explicit sharding: the stage's
functions already carry the plan's shardings as constraints, and the grouped stage
already keeps each device's gradient sum on its device with no collective, so one
trace of them gives XLA the whole step to fuse and schedule. ``shard_map`` would
need a per-device program for every sharding the ILP can choose, and explicit
sharding types (JAX's ``unreduced``) need Explicit mesh axes where the plan's meshes
are Auto.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from alpajob.trainer_image.runtime.meshes import place_all
from alpajob.trainer_image.runtime.split import SplitProgram
from alpajob.trainer_image.runtime.stage import StageRuntime

#: ``step(params, opt_state, batch, seed, inv_scale) -> (params, opt_state, losses,
#: finite)``: ``batch`` the stage's batch leaves stacked as ``[micro-batches, ...]``.
FusedStep = Callable[[dict[str, jax.Array], Any, list[jax.Array], Any, Any],
                     tuple[dict[str, jax.Array], Any, jax.Array, jax.Array]]


def stacked_shardings(stage: StageRuntime) -> list[NamedSharding]:
    """The stage's batch shardings with a leading, unsharded micro-batch axis."""
    return [NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec)) for sh in stage.batch_sharding]


def stack_micro_batches(split: SplitProgram, stage: StageRuntime, batch: Sequence[np.ndarray],
                        num_micro_batches: int) -> list[jax.Array]:
    """The stage's batch leaves of a host ``batch`` (flattened leaves, global batch)
    cut into ``[num_micro_batches, micro, ...]`` (the micro-batches of
    :func:`~.executor.split_micro_batches`, in order) and placed in one batched put."""
    leaves = []
    for leaf in split.stages[stage.index].batch:
        x = batch[leaf]
        if x.shape[0] % num_micro_batches:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by {num_micro_batches} micro-batches")
        leaves.append(x.reshape(num_micro_batches, x.shape[0] // num_micro_batches, *x.shape[1:]))
    return place_all(leaves, stacked_shardings(stage))


def fused_step(stage: StageRuntime, num_micro_batches: int, scaled: bool) -> FusedStep:
    """The jitted step of a one-stage plan (module docstring), for ``stage`` holding
    its placed parameters and optimizer state; ``scaled``: a float16 run's step, which
    checks its gradients and skips a non-finite update."""
    leaves = stage.param_leaves
    names = [stage.leaf_names[k] for k in leaves]
    replicated = NamedSharding(stage.mesh, PartitionSpec())

    def step(params: dict[str, Any], opt_state: Any, batch: list[Any], seed: Any,
             inv_scale: Any) -> tuple[Any, Any, Any, Any]:
        prepared = stage.prepare([params[n] for n in names])

        def micro_batch(acc: list[Any] | None, leaves: list[Any]) -> tuple[list[Any], Any]:
            _, loss, residuals = stage.forward(prepared, list(leaves), [])
            acc, _, _ = stage.backward(prepared, residuals, [seed], acc)
            return acc, loss

        if num_micro_batches == 1:
            acc, loss = micro_batch(None, [x[0] for x in batch])  # the backward makes them
            losses = loss[None]
        else:
            acc, losses = jax.lax.scan(micro_batch, stage.zeros(), batch)
        finite = stage.finite(acc) if scaled else jnp.array(True)
        grads = dict(zip(names, acc, strict=True))
        new_params, new_state = stage.update(params, opt_state, grads, {}, inv_scale)
        if scaled:
            new_params, new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                                 (new_params, new_state), (params, opt_state))
        return new_params, new_state, losses, finite

    def sharding(x: Any) -> Any:
        return x.sharding

    params_sh = jax.tree.map(sharding, stage.params)
    state_sh = jax.tree.map(sharding, stage.opt_state)
    return jax.jit(
        step,
        in_shardings=(params_sh, state_sh, stacked_shardings(stage), replicated, replicated),
        out_shardings=(params_sh, state_sh, replicated, replicated),
        donate_argnums=(0, 1),
    )


class FusedRunner:
    """A one-stage plan's steps on its stage (the local driver's and a mesh host's):
    the unscaled and the loss-scaled step, each compiled on first use, updating the
    stage's parameters and optimizer state in place."""

    def __init__(self, split: SplitProgram, stage: StageRuntime, num_micro_batches: int,
                 loss_seed: jax.Array) -> None:
        self.split, self.stage, self.num_micro_batches, self.loss_seed = split, stage, num_micro_batches, loss_seed
        self._steps: dict[bool, FusedStep] = {}

    def step(self, batch: Sequence[np.ndarray], scale: float | None) -> tuple[jax.Array, jax.Array]:
        """One step on the host ``batch`` (flattened leaves, global batch) with loss
        ``scale`` (float16) if given; the micro-batches' losses and whether the update
        was applied, as arrays (not waited for)."""
        stage, scaled = self.stage, scale is not None
        if scaled not in self._steps:
            self._steps[scaled] = fused_step(stage, self.num_micro_batches, scaled)
        leaves = stack_micro_batches(self.split, stage, batch, self.num_micro_batches)
        seed = self.loss_seed * scale if scale is not None else self.loss_seed
        inv_scale = np.float32(1.0 / scale if scale is not None else 1.0)
        stage.params, stage.opt_state, losses, finite = self._steps[scaled](
            stage.params, stage.opt_state, leaves, seed, inv_scale)
        return losses, finite

