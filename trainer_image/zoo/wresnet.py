"""Wide-ResNet: a bottleneck ResNet with widened middle convolutions (Alpa's WResNet suite).

Structure (``c`` = channels, ``w`` = widthFactor; NHWC images, float)::

    stem:  7x7/2 conv (3 -> c), norm, relu, 3x3/2 max pool
    4 stages, stage k has filters f = c * 2^k and depth-dependent block counts
    (50 layers: 3, 4, 6, 3; 101 layers: 3, 4, 23, 3); each block is a layer:
        1x1 conv (in -> f), norm, relu
        3x3 conv (f -> f*w), stride 2 in the first block of stages 1..3, norm, relu
        1x1 conv (f*w -> 4f), norm
        + shortcut (a strided 1x1 projection where the shape changes), relu
    head:  global average pool, dense (4 * 8c -> numClasses), softmax cross-entropy

Normalization: BatchNorm is replaced by a normalization of each example over its
whole feature map (H, W and C) with a per-channel scale and bias, and no running
statistics. It keeps examples independent, so a micro-batched step computes exactly
the full-batch gradient, and sharding the batch needs no cross-device reduction; the
op mix (reductions plus elementwise ops per conv) matches BatchNorm's.

The 3x3 convolution's ``9 f (w f)`` weights dominate: WResNet-250M (50 layers, c=160,
w=2) has 2.54e8 parameters with ``numClasses`` 1024.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from alpajob.api.zoo import block_specs
from alpajob.trainer_image.zoo.model import (
    Batch,
    ModelDef,
    Params,
    dense,
    dense_init,
    layer_norm,
    norm_init,
    normal,
    relu,
    softmax_cross_entropy,
)


def conv_init(key: jax.Array, size: int, c_in: int, c_out: int, dtype: str) -> jax.Array:
    """An HWIO kernel with He-normal initialization."""
    return normal(key, (size, size, c_in, c_out), dtype, (2.0 / (size * size * c_in)) ** 0.5)


def conv(x: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
    """A SAME-padded NHWC convolution."""
    return lax.conv_general_dilated(
        x, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def feature_norm(params: Params, x: jax.Array) -> jax.Array:
    """Per-example normalization over H, W and C (see the module docstring)."""
    return layer_norm(params, x, axes=(1, 2, 3))


def block_init(key: jax.Array, c_in: int, filters: int, width: int, dtype: str) -> Params:
    """The weights of one bottleneck block (with a projection if the shape changes)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    mid = filters * width
    block = {
        "conv1": conv_init(k1, 1, c_in, filters, dtype),
        "norm1": norm_init(filters, dtype),
        "conv2": conv_init(k2, 3, filters, mid, dtype),
        "norm2": norm_init(mid, dtype),
        "conv3": conv_init(k3, 1, mid, 4 * filters, dtype),
        "norm3": norm_init(4 * filters, dtype),
    }
    if c_in != 4 * filters:
        block["proj"] = conv_init(k4, 1, c_in, 4 * filters, dtype)
        block["proj_norm"] = norm_init(4 * filters, dtype)
    return block


def block_apply(params: Params, x: jax.Array, stride: int) -> jax.Array:
    """One bottleneck block."""
    y = relu(feature_norm(params["norm1"], conv(x, params["conv1"])))
    y = relu(feature_norm(params["norm2"], conv(y, params["conv2"], stride)))
    y = feature_norm(params["norm3"], conv(y, params["conv3"]))
    if "proj" in params:
        x = feature_norm(params["proj_norm"], conv(x, params["proj"], stride))
    return relu(x + y)


def build(name: str, config: dict[str, Any], dtype: str) -> ModelDef:
    """The Wide-ResNet :class:`ModelDef` for a resolved ``config``."""
    channels, width = config["channels"], config["widthFactor"]
    image, classes = config["imageSize"], config["numClasses"]
    specs = block_specs(config)

    def init(key: jax.Array) -> Params:
        k_stem, k_head, *k_blocks = jax.random.split(key, len(specs) + 2)
        return {
            "stem": {"conv": conv_init(k_stem, 7, 3, channels, dtype), "norm": norm_init(channels, dtype)},
            "layers": [
                block_init(k, c_in, filters, width, dtype)
                for k, (c_in, filters, _) in zip(k_blocks, specs, strict=True)
            ],
            "head": dense_init(k_head, 4 * specs[-1][1], classes, dtype),
        }

    def loss(params: Params, batch: Batch) -> jax.Array:
        with jax.named_scope("stem"):
            x = conv(batch["images"].astype(dtype), params["stem"]["conv"], 2)
            x = relu(feature_norm(params["stem"]["norm"], x))
            x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        for i, (block, (_, _, stride)) in enumerate(zip(params["layers"], specs, strict=True)):
            with jax.named_scope(f"layer_{i}"):
                x = block_apply(block, x, stride)
        with jax.named_scope("head"):
            logits = dense(params["head"], jnp.mean(x, axis=(1, 2)))
            return softmax_cross_entropy(logits, batch["labels"])

    def batch_shapes(batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "images": jax.ShapeDtypeStruct((batch_size, image, image, 3), jnp.dtype(dtype)),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.dtype(jnp.int32)),
        }

    return ModelDef(name, "wresnet", jax.jit(init), loss, batch_shapes, dtype, dict(config))
