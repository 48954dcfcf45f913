"""A custom model for ``spec.model.entrypoint`` (the worked example of the documentation's "Your own model" guide, docs/guides/own-model.md).

``make_model()`` returns three plain functions; the planner and the runtime derive
everything else (layers, stages, shardings) from tracing ``loss``.
"""

import jax
import jax.numpy as jnp

WIDTH, DEPTH, CLASSES = 64, 4, 10


def make_model():
    def init(key):
        keys = jax.random.split(key, DEPTH + 1)
        layers = [{"w": jax.random.normal(k, (WIDTH, WIDTH)) * WIDTH**-0.5, "b": jnp.zeros(WIDTH)}
                  for k in keys[:-1]]
        head = jax.random.normal(keys[-1], (WIDTH, CLASSES)) * WIDTH**-0.5
        return {"layers": layers, "head": head}

    def loss(params, batch):
        x = batch["x"]
        for layer in params["layers"]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        logits = x @ params["head"]
        labels = jax.nn.one_hot(batch["y"], CLASSES)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

    def batch_shapes(batch_size):
        return {"x": jax.ShapeDtypeStruct((batch_size, WIDTH), jnp.float32),
                "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}

    return init, loss, batch_shapes
