"""Assemble a plan's pipeline for a model: split, meshes, stage runtimes, parameters.

:func:`build_pipeline` is the one call the local runner (and later the Ray runtime,
per mesh) makes: it traces the model's loss for one micro-batch, cuts it where the
plan's stages own their parameters (:mod:`.split`), builds each stage's mesh and
executables (:mod:`.meshes`, :mod:`.stage`), and places the initial parameters and
optimizer state on the stage that owns them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from alpajob.api.plan import Plan, path_name
from alpajob.api.spec import Schedule
from alpajob.trainer_image.runtime.driver import PipelineExecutor
from alpajob.trainer_image.runtime.grouped import NotGroupable, batch_dims
from alpajob.trainer_image.runtime.meshes import place, stage_mesh
from alpajob.trainer_image.runtime.pinning import stage_pins
from alpajob.trainer_image.runtime.split import SplitProgram, split_loss
from alpajob.trainer_image.runtime.stage import StageRuntime, build_stage


def param_names(params: Any) -> list[str]:
    """Pytree path names of the parameter leaves (``layers/0/attn/q/kernel`` ...)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return [path_name(path) for path, _ in leaves]


def param_stages(plan: Plan, names: Sequence[str]) -> list[int]:
    """Per parameter leaf, the first stage whose shardings name it (0 if none does)."""
    first: dict[str, int] = {}
    for stage in plan.stages:
        for name in stage.param_shardings:
            first.setdefault(name, stage.index)
    return [first.get(name, 0) for name in names]


def split_for_plan(plan: Plan, loss: Any, params: Any, batch_shapes: Any) -> tuple[SplitProgram, list[str]]:
    """The loss traced at the plan's micro-batch size and cut into its stages, and the
    parameter leaves' names. With more than one micro-batch the split also carries
    every value's batch dimension, which lets data-parallel stages run grouped
    (:mod:`.grouped`); with one, a backward all-reduces once per step either way."""
    names = param_names(params)
    micro = plan.global_batch_size // plan.num_micro_batches
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    split = split_loss(loss, abstract, batch_shapes(micro), param_stages(plan, names), len(plan.stages))
    if plan.num_micro_batches > 1:
        with contextlib.suppress(NotGroupable):  # else no stage runs grouped
            split = dataclasses.replace(split, batch_dims=batch_dims(loss, abstract, batch_shapes, micro))
    return split, names


def place_stage(
    plan: Plan,
    split: SplitProgram,
    names: Sequence[str],
    index: int,
    mesh: Mesh,
    leaves: Sequence[Any],
    optimizer: optax.GradientTransformation,
) -> StageRuntime:
    """Stage ``index``'s runtime on ``mesh``, holding its own parameters (from the
    full list of initial ``leaves``) and fresh optimizer state."""
    plan_shapes = {str(task.tensor): tuple(task.shape) for task in plan.resharding}
    pins = stage_pins(split, plan.stages)[index]
    stage = build_stage(split, index, plan.stages[index], mesh, names, optimizer, plan_shapes, pins)
    for leaf in split.stages[index].params:
        if split.home[leaf] == index:
            stage.params[names[leaf]] = place(np.array(leaves[leaf]), stage.param_sharding[leaf])
    stage.opt_state = stage.init_opt(stage.params)
    return stage


def build_pipeline(
    plan: Plan,
    loss: Any,
    params: Any,
    batch_shapes: Any,
    optimizer: optax.GradientTransformation,
    devices: Sequence[Any],
    wait: bool = False,
    fuse: bool = True,
) -> PipelineExecutor:
    """The executor for ``plan``, holding ``params`` (a pytree) and fresh optimizer state
    (``wait``: exact per-stage times, see :class:`~.driver.Stopwatch`; ``fuse=False``:
    every forward, backward and update an executable of its own, see
    :func:`~.driver.drive_step`).

    ``batch_shapes(b)`` gives the abstract batch at batch size ``b``; the loss is traced
    at the micro-batch size ``global_batch_size / num_micro_batches``.
    """
    split, names = split_for_plan(plan, loss, params, batch_shapes)
    leaves = jax.tree.leaves(params)
    stages = [
        place_stage(plan, split, names, index, stage_mesh(plan_stage, plan, devices), leaves, optimizer)
        for index, plan_stage in enumerate(plan.stages)
    ]
    return PipelineExecutor(split, stages, Schedule(plan.schedule), plan.num_micro_batches, wait, fuse)
