"""A small MLP with a mean-squared-error loss: the zoo's test model.

``layers`` dense layers map ``inputDim -> hidden -> ... -> hidden -> outputDim``, with
``tanh`` between them (not after the last). Its forward ``dot_general`` FLOPs have the
closed form ``2 * batch * sum(d_in * d_out)``, which the extraction tests check.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from alpajob.api.zoo import mlp_layer_dims
from alpajob.trainer_image.zoo.model import Batch, ModelDef, Params, dense, dense_init


def build(name: str, config: dict[str, Any], dtype: str) -> ModelDef:
    """The MLP :class:`ModelDef` for a resolved ``config``."""
    dims = mlp_layer_dims(config)

    def init(key: jax.Array) -> Params:
        keys = jax.random.split(key, len(dims))
        return {"layers": [dense_init(k, i, o, dtype) for k, (i, o) in zip(keys, dims, strict=True)]}

    def loss(params: Params, batch: Batch) -> jax.Array:
        x = batch["x"].astype(dtype)
        for i, layer in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                x = dense(layer, x)
                if i < len(dims) - 1:
                    x = jnp.tanh(x)
        diff = x.astype(jnp.float32) - batch["y"].astype(jnp.float32)
        return jnp.mean(jnp.square(diff))

    def batch_shapes(batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, config["inputDim"]), jnp.dtype(dtype)),
            "y": jax.ShapeDtypeStruct((batch_size, config["outputDim"]), jnp.dtype(dtype)),
        }

    return ModelDef(name, "mlp", jax.jit(init), loss, batch_shapes, dtype, dict(config))
