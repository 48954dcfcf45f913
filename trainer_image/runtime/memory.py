"""What a stage's compiled executables hold in device memory, to check the planner's model.

The planner predicts a stage's peak as its weights (parameters, gradients, optimizer
state), the residuals of its in-flight micro-batches, and the largest transient (a
layer's backward working set, plus its residuals when rematerialised).
:func:`stage_memory` measures the same things on the executables the runtime runs,
from XLA's own accounting (``compiled.memory_analysis()``) and the arrays it holds:

- **weights**: the stage's parameters, optimizer state and gradient accumulators;
- **residuals**: what the forward hands the backward for one micro-batch (the
  parameters among them are not returned: the backward takes them again);
- the **forward**, **backward** and **update** executables' temporaries;
- the **forward_backward** executable's temporaries (the last stage's: one micro-
  batch's forward and backward in one executable, its residuals inside it).

The peak is the weights plus the largest of: the forward's temporaries and the
residuals it writes; the residuals and the backward's temporaries; the update's
temporaries. One micro-batch in flight; with more, add their residuals. A stage that
runs forward and backward as one executable holds no residuals between them: its
peak (``fused_peak``) is the weights plus the larger of that executable's and the
update's temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpajob.trainer_image.runtime.stage import StageRuntime


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds (module docstring), per device of a one-device mesh."""

    weights: int
    residuals: int
    forward_temp: int
    backward_temp: int
    update_temp: int
    forward_backward_temp: int

    @property
    def peak(self) -> int:
        busiest = max(self.forward_temp + self.residuals, self.residuals + self.backward_temp,
                      self.update_temp)
        return self.weights + busiest

    @property
    def fused_peak(self) -> int:
        return self.weights + max(self.forward_backward_temp, self.update_temp)


def _analysis(jitted: Any, *args: Any) -> Any:
    """XLA's memory analysis of ``jitted`` (a ``jax.jit`` function) compiled for ``args``."""
    return jitted.lower(*args).compile().memory_analysis()


def _nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def stage_memory(stage: StageRuntime, batch: Sequence[Any], inputs: Sequence[Any]) -> StageMemory:
    """Measure ``stage`` (built and holding its parameters) on one micro-batch.

    The update is compiled without gradients received for shared parameters: a stage
    whose parameters other stages also read needs its plan's other stages measured
    with it, which this does not do.
    """
    params = stage.prepare([stage.params[stage.leaf_names[k]] for k in stage.param_leaves])
    accumulators = stage.zeros()
    forward = _analysis(stage.forward, params, list(batch), list(inputs))
    outputs, loss, saved = stage.forward(params, list(batch), list(inputs))
    residuals = _nbytes(saved)  # what it computed: the parameters among them are not copied
    differentiable = [outputs[i] for i in stage.diff_outputs] + ([loss] if loss is not None else [])
    cotangents = [jnp.ones_like(x) for x in differentiable]
    backward = _analysis(stage.backward, params, saved, cotangents, accumulators)
    fused = _analysis(stage.forward_backward, params, list(batch), list(inputs), cotangents, accumulators)
    grads = {stage.leaf_names[k]: a for k, a in zip(stage.param_leaves, accumulators, strict=True)
             if stage.leaf_names[k] in stage.home_names}
    update = _analysis(stage.update, stage.params, stage.opt_state, grads, {}, jnp.float32(1.0))
    return StageMemory(
        weights=_nbytes(stage.params) + _nbytes(stage.opt_state) + _nbytes(accumulators),
        residuals=residuals,
        forward_temp=int(forward.temp_size_in_bytes),
        backward_temp=int(backward.temp_size_in_bytes),
        update_temp=int(update.temp_size_in_bytes),
        forward_backward_temp=int(fused.temp_size_in_bytes),
    )
