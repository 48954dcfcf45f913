"""The two ways ``alpajob run`` trains, behind one small interface.

:class:`SerialRunner` is the reference: the whole step, the whole batch, one device,
one ``jax.jit``. :class:`PipelineRunner` runs a plan's stages
(:class:`~.runtime.driver.PipelineExecutor`). Both train a step (with float16's loss
scale, :mod:`.precision`), evaluate a batch (forward only), and hand out and take back
their parameters and optimizer state by name (:mod:`.checkpoint.names`); parallel training equals the
serial reference, and the tests hold them to it.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from alpajob.trainer_image.checkpoint.names import (
    load_stage,
    named_leaves,
    stage_arrays,
    with_leaves,
)
from alpajob.trainer_image.precision import LossScale
from alpajob.trainer_image.runtime.driver import PipelineExecutor
from alpajob.trainer_image.runtime.executor import StageTimes
from alpajob.trainer_image.step import init_optimizer_state, make_scaled_train_step, make_train_step
from alpajob.trainer_image.zoo import ModelDef


class Runner(Protocol):
    """What a run asks of its runner."""

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]: ...
    def evaluate(self, batch: list[np.ndarray]) -> float: ...
    def named_arrays(self) -> dict[str, jax.Array]: ...
    def load(self, arrays: dict[str, jax.Array]) -> None: ...

    @property
    def scale(self) -> LossScale | None: ...


class SerialRunner:
    """The reference: the whole step, whole batch, on one device."""

    def __init__(self, model: ModelDef, optimizer: Any, params: Any, device: Any, batch_size: int,
                 scale: LossScale | None) -> None:
        self._batch_def = jax.tree.structure(model.batch_shapes(batch_size))
        self.params = jax.device_put(params, device)
        # committed to the device like the parameters: a step's inputs then have the
        # shardings of its outputs, and the second step does not compile again
        self.opt_state = jax.device_put(jax.jit(lambda p: init_optimizer_state(optimizer, p))(self.params), device)
        train = make_train_step(model.loss, optimizer)

        def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
            loss, _, new_params, new_state = train(params, opt_state, batch)
            return loss, new_params, new_state  # the gradients never leave the executable

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._scaled = jax.jit(make_scaled_train_step(model.loss, optimizer), donate_argnums=(0, 1))
        self._loss = jax.jit(model.loss)
        self.device = device
        self.scale = scale

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]:
        tree = jax.tree.unflatten(self._batch_def, batch)
        if self.scale is None:
            loss, self.params, self.opt_state = self._step(self.params, self.opt_state, tree)
            return float(loss), ()
        loss, finite, self.params, self.opt_state = self._scaled(
            self.params, self.opt_state, tree, jnp.float32(self.scale.scale))
        self.scale.after(bool(finite))
        return float(loss), ()

    def evaluate(self, batch: list[np.ndarray]) -> float:
        return float(self._loss(self.params, jax.tree.unflatten(self._batch_def, batch)))

    def named_arrays(self) -> dict[str, jax.Array]:
        out = named_leaves("params", self.params)
        out.update(named_leaves("opt", self.opt_state))
        return out

    def load(self, arrays: dict[str, jax.Array]) -> None:
        self.params = with_leaves("params", self.params, arrays)
        self.opt_state = with_leaves("opt", self.opt_state, arrays)


class PipelineRunner:
    """The plan's pipeline, behind the same small interface as :class:`SerialRunner`."""

    def __init__(self, executor: PipelineExecutor, scale: LossScale | None) -> None:
        self.executor = executor
        self.scale = scale

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]:
        result = self.executor.step(batch, timed, self.scale.scale if self.scale else None)
        if self.scale is not None:
            self.scale.after(result.applied)
        return result.loss, result.stages

    def evaluate(self, batch: list[np.ndarray]) -> float:
        return self.executor.evaluate(batch)

    def named_arrays(self) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for stage in self.executor.stages:
            out.update(stage_arrays(stage))
        return out

    def load(self, arrays: dict[str, jax.Array]) -> None:
        for stage in self.executor.stages:
            load_stage(stage, arrays)
