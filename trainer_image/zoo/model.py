"""The model contract: :class:`ModelDef`, and small building blocks the families share.

A model is four plain functions and some plain data. The planner traces
``loss`` (through :func:`alpajob.trainer_image.step.trace_step`) on abstract shapes; the
trainer calls ``init`` with a real PRNG key and jits ``loss``. A user's custom
entrypoint returns an object of the same shape (duck typing is enough: the planner
only reads ``name``, ``init``, ``loss`` and ``batch_shapes``).

Conventions every zoo family follows:

- ``params`` is a dict pytree; repeated layers live in a list (``params["layers"][i]``)
  so pytree paths read ``layers/3/attn/qkv``.
- Every layer's code runs inside ``jax.named_scope(f"layer_{i}")`` and layers are an
  unrolled Python loop (no ``lax.scan``), so each layer is its own run of equations.
- Parameters are stored in ``dtype``; normalizations, softmaxes and the loss are
  computed in float32 (mixed precision).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: A model's parameters (a dict pytree of arrays).
Params = Any
#: One batch: a dict of arrays keyed like :attr:`ModelDef.batch_shapes`.
Batch = Mapping[str, jax.Array]


@dataclass(frozen=True)
class ModelDef:
    """A trainable model, as the planner and the trainer see it.

    Attributes:
        name: display name, e.g. ``"gpt-2.6b"`` or ``"gpt-custom"``.
        family: the zoo family (``gpt``, ``moe``, ``wresnet``, ``mlp``) or ``"custom"``.
        init: ``init(key) -> params``; pure, so ``jax.eval_shape(init, key)`` gives the
            parameter shapes without allocating anything. The zoo's are ``jax.jit`` ted
            (one compilation instead of one per eager op).
        loss: ``loss(params, batch) -> scalar`` (float32), differentiable in ``params``.
        batch_shapes: ``batch_shapes(batch_size) -> {name: jax.ShapeDtypeStruct}``, the
            abstract batch; every entry's leading dimension is the batch.
        dtype: parameter and compute dtype name (``"float32"``, ``"bfloat16"``, ...).
        config: the resolved configuration (plain JSON-like data, camelCase keys).
    """

    name: str
    family: str
    init: Callable[[jax.Array], Params]
    loss: Callable[[Params, Batch], jax.Array]
    batch_shapes: Callable[[int], dict[str, jax.ShapeDtypeStruct]]
    dtype: str
    config: dict[str, Any] = field(default_factory=dict, hash=False)

    def param_shapes(self) -> Params:
        """The parameter pytree as ``jax.ShapeDtypeStruct`` s (nothing allocated)."""
        return jax.eval_shape(self.init, jax.random.key(0))

    def num_parameters(self) -> int:
        """Number of parameter elements, computed abstractly."""
        leaves = jax.tree.leaves(self.param_shapes())
        return sum(int(leaf.size) for leaf in leaves)


def normal(key: jax.Array, shape: tuple[int, ...], dtype: str, stddev: float) -> jax.Array:
    """A ``N(0, stddev^2)`` initializer in ``dtype``."""
    return (jax.random.normal(key, shape, jnp.float32) * stddev).astype(dtype)


def dense_init(key: jax.Array, d_in: int, d_out: int, dtype: str) -> dict[str, jax.Array]:
    """A dense layer ``{"kernel": [d_in, d_out], "bias": [d_out]}`` (LeCun-normal kernel)."""
    return {
        "kernel": normal(key, (d_in, d_out), dtype, d_in**-0.5),
        "bias": jnp.zeros((d_out,), dtype),
    }


def dense(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """``x @ kernel + bias`` over the last dimension of ``x``."""
    return x @ params["kernel"] + params["bias"]


def norm_init(dim: int, dtype: str) -> dict[str, jax.Array]:
    """Scale (ones) and bias (zeros) of a normalization over ``dim`` features."""
    return {"scale": jnp.ones((dim,), dtype), "bias": jnp.zeros((dim,), dtype)}


def per_part_init(
    embed: Callable[[jax.Array], Params], blocks: list[Callable[[jax.Array], Params]],
    final_norm: Callable[[], Params],
) -> Callable[[jax.Array], Params]:
    """A language model's ``init(key) -> {"embed", "layers", "final_ln"}`` that
    compiles each kind of part once: the key is split into one for the embedding and
    one per layer, and each part's init is its own ``jax.jit``, called per layer. A
    whole-model ``jax.jit`` of the init compiles the random numbers of every layer
    (GPT-350M's took over four minutes for a GPU with the default threefry PRNG);
    per part, a 24-layer model compiles one layer's. Identical blocks share one
    compiled init (``blocks`` holding the same function)."""
    compiled: dict[int, Callable[[jax.Array], Params]] = {}
    embed_jit, norm_jit = jax.jit(embed), jax.jit(final_norm)

    def part(block: Callable[[jax.Array], Params]) -> Callable[[jax.Array], Params]:
        return compiled.setdefault(id(block), jax.jit(block))

    def init(key: jax.Array) -> Params:
        k_embed, *k_layers = jax.random.split(key, len(blocks) + 1)
        return {
            "embed": embed_jit(k_embed),
            "layers": [part(block)(k) for block, k in zip(blocks, k_layers, strict=True)],
            "final_ln": norm_jit(),
        }

    return init


def layer_norm(
    params: dict[str, jax.Array], x: jax.Array, axes: tuple[int, ...] = (-1,)
) -> jax.Array:
    """Normalize ``x`` over ``axes`` (in float32, :func:`normalize`), then scale and
    shift per last-dim feature."""
    y = normalize(x, axes)
    return (y * params["scale"].astype(jnp.float32) + params["bias"].astype(jnp.float32)).astype(
        x.dtype
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def normalize(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``(x - mean) / sqrt(var + 1e-5)`` over ``axes``, in float32, whose backward keeps
    only its output and the per-example ``1 / sqrt(var + 1e-5)``.

    Differentiated as written, a normalization keeps about five float32 tensors of
    ``x``'s size (centred values, their square, products) for the backward; for
    Wide-ResNet's batch of 64 images at 56 x 56 x 640 those are 490 MiB each. The
    output is kept anyway (the scale's gradient reads it), and the gradient is a
    function of it: with ``y`` the output, ``r`` the reciprocal deviation and means
    over ``axes``, ``dx = r * (dy - mean(dy) - y * mean(dy * y))``.
    """
    return _normalize_forward(x, axes)[0]


def _normalize_forward(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), axis=axes, keepdims=True) + 1e-5)
    y = (x32 - mean) * rstd
    return y, (y, rstd, jnp.zeros((), x.dtype))


def _normalize_backward(axes: tuple[int, ...], saved: tuple[jax.Array, jax.Array, jax.Array],
                        dy: jax.Array) -> tuple[jax.Array]:
    y, rstd, like = saved
    dx = rstd * (dy - jnp.mean(dy, axis=axes, keepdims=True)
                 - y * jnp.mean(dy * y, axis=axes, keepdims=True))
    return (dx.astype(like.dtype),)


normalize.defvjp(_normalize_forward, _normalize_backward)


@jax.custom_vjp
def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)`` whose backward reads its output (``y > 0``), not its input: the
    output is kept for the next layer anyway, so the input need not be. A VJP, not a
    JVP rule: differentiating a JVP rule computes the mask ``y > 0`` in the forward
    and keeps it too (a boolean residual beside ``y``: a quarter more per relu); here
    the backward computes it from ``y``."""
    return jnp.maximum(x, 0)


def _relu_forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = jnp.maximum(x, 0)
    return y, y


def _relu_backward(y: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    return (jnp.where(y > 0, dy, jnp.zeros_like(dy)),)


relu.defvjp(_relu_forward, _relu_backward)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def softmax_as(x: jax.Array, dtype: Any) -> jax.Array:
    """Softmax over the last axis, computed in float32 and returned in ``dtype``, whose
    derivative reads only that output.

    Differentiated as written, a softmax keeps its input, its exponentials and its
    output (three float32 tensors the size of the attention scores) for the backward;
    with the rule ``dy = y * (dx - sum(y * dx))`` it keeps ``y`` alone, in the compute
    type, as fused attention kernels do. At GPT-1.3B's micro-batch of 32 sequences of
    1,024 tokens that is 1 GiB per layer in float16 instead of 5.5 (``jnp.where``'s
    broadcast mask included; the causal mask is an additive bias here, which the
    backward does not read).
    """
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(dtype)


@softmax_as.defjvp
def _softmax_as_jvp(dtype: Any, primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    (x,), (dx,) = primals, tangents
    y = softmax_as(x, dtype)
    y32, dx32 = y.astype(jnp.float32), dx.astype(jnp.float32)
    return y, (y32 * (dx32 - jnp.sum(y32 * dx32, axis=-1, keepdims=True))).astype(dtype)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """``jax.nn.gelu`` (tanh approximation) whose backward keeps only its input and
    recomputes the slope from it (a few elementwise ops), instead of the four
    intermediates (``tanh``, products, a sum) that differentiating the formula keeps."""
    return jax.nn.gelu(x)


def _gelu_forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.nn.gelu(x), x


def _gelu_backward(x: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    _, slope = jax.jvp(jax.nn.gelu, (x,), (jnp.ones_like(x),))  # elementwise: the derivative
    return (slope * dy,)


gelu.defvjp(_gelu_forward, _gelu_backward)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy (float32) of integer ``labels`` under ``logits``.

    The label's log-probability is picked with a one-hot product (elementwise ops and a
    reduction), which keeps every op linear in the batch.
    """
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    return -jnp.mean(jnp.sum(log_probs * one_hot, axis=-1))


def synthetic_batch(model: ModelDef, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random host-side batch for ``model``: standard-normal floats, uniform integers.

    Integer entries (token ids, labels) are drawn from ``[0, n)`` with ``n`` the
    config's ``vocab`` or ``numClasses`` (2 when it has neither). Drawn with numpy, so
    no device computation is compiled.
    """
    high = model.config.get("vocab", model.config.get("numClasses", 2))
    rng = np.random.default_rng(seed)
    batch = {}
    for name, shape in sorted(model.batch_shapes(batch_size).items()):
        if jnp.issubdtype(shape.dtype, jnp.integer):
            batch[name] = rng.integers(0, high, shape.shape).astype(shape.dtype)
        else:
            batch[name] = rng.standard_normal(shape.shape).astype(shape.dtype)
    return batch
