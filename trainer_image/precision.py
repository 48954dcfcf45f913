"""Mixed precision: compute in bfloat16 or float16, keep the weights in float32.

``spec.training.dtype: bfloat16`` (or ``float16``) means the model's matrix products
run in that type, while the parameters the optimizer updates (the *master weights*)
and its moments stay float32, so small updates are not lost to rounding (a bfloat16
weight of 1.0 cannot take an update below 2^-8). :func:`master_weights` wraps a model
that way, for every runtime at once: its ``init`` returns float32 parameters and its
``loss`` casts each floating parameter to the compute type where it is read; the
gradient of that cast brings gradients back to float32. The planner traces the wrapped
step, so its memory model counts the float32 weights and the compute-type copies.

float16's range is narrow (largest 65504, smallest normal 6e-5): small gradients
underflow to 0, and big ones overflow to inf. :class:`LossScale` is dynamic loss
scaling: the loss is multiplied by ``scale`` before the backward pass and the
gradients divided by it before the update; a step whose gradients are not all finite
is skipped (parameters and optimizer state untouched, counted in
:attr:`LossScale.skipped`) and the scale halved; after ``period`` finite steps in a
row the scale doubles. bfloat16 has float32's range and needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

from alpajob.api.spec import DType
from alpajob.trainer_image.zoo.model import ModelDef


def _floating(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.floating)


def master_weights(model: ModelDef) -> ModelDef:
    """``model`` with float32 parameters that it computes with in ``model.dtype``
    (a float32 model is returned as it is)."""
    compute = jnp.dtype(model.dtype)
    if compute == jnp.float32:
        return model
    init, loss = model.init, model.loss

    def init32(key: jax.Array) -> Any:
        return jax.tree.map(lambda p: p.astype(jnp.float32) if _floating(p) else p, init(key))

    def loss_in_compute_type(params: Any, batch: Any) -> jax.Array:
        cast = jax.tree.map(lambda p: p.astype(compute) if _floating(p) else p, params)
        return loss(cast, batch)

    return replace(model, init=init32, loss=loss_in_compute_type)


@dataclass
class LossScale:
    """Dynamic loss scaling (module docstring); one per run, kept on the host."""

    scale: float = 2.0**15
    period: int = 2000  # finite steps in a row before the scale doubles
    good: int = 0  # finite steps since the last change
    skipped: int = 0  # steps skipped for non-finite gradients

    @staticmethod
    def for_dtype(dtype: DType | str) -> LossScale | None:
        """Loss scaling for float16; None (no scaling) for float32 and bfloat16."""
        return LossScale() if DType(dtype) is DType.FLOAT16 else None

    def after(self, finite: bool) -> None:
        """Account for a step whose gradients were (not) all finite."""
        if not finite:
            self.skipped += 1
            self.good = 0
            self.scale = max(self.scale / 2, 1.0)
            return
        self.good += 1
        if self.good >= self.period:
            self.good = 0
            self.scale = min(self.scale * 2, 2.0**24)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (a boolean scalar)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _floating(x)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)
