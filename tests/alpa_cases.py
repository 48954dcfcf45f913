"""Alpa's test models and cost setting, for the tests that hold our ILP to Alpa's answers.

Alpa's suite (alpa-projects/alpa, ``tests/shard_parallel``) shards small Flax models on
a 4-device mesh whose axes have given alpha-beta costs (``mesh_alpha``,
``mesh_beta``), then asserts which sharding each weight gets and how many
collectives of each kind the compiled step has. The models here are our own plain-JAX
equivalents (same shapes, same layers); :func:`plan` poses them to our intra-op pass
with the same costs.

The same costs, in our model: Alpa's objective is communication only, and it never
replicates a heavy op (``allow_recompute_heavy_op`` is off), so every matmul and
convolution is split over all devices while other ops are free. We charge compute, so
the equivalent device (:data:`ALPA_DEVICE`) does one matmul or convolution FLOP per
time unit (replicating one costs more than any collective of these tests) and
everything else in no time; collectives cost exactly Alpa's ``mesh_alpha +
mesh_beta * ...`` (no calibration overhead or efficiency on top), without Alpa's
tie-breaking constants (+0.1 all-gather, +0.01 all-reduce, +0.001 reduce-scatter).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import LogicalMesh, MeshAxis, load_calibration
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.intra_op.collectives import CollectiveKind, count_collectives
from alpajob.planner.intra_op.sharding import ShardSpec
from alpajob.planner.intra_op.solve import IntraOpResult, ShardingMode, solve_intra_op
from alpajob.trainer_image.step import graph_of

#: Matmuls and convolutions: 1 FLOP per time unit; all else free (memory included).
ALPA_DEVICE = DeviceSpec("alpa-test", {"float32": 1e30}, 1 << 50, 1e30)
ALPA_CALIBRATION = dataclasses.replace(
    load_calibration("v100-16gb"),
    matmul_efficiency=1e-30,
    conv_efficiency=1e-30,
    vector_flops_fraction=1.0,
    collective_overhead_seconds=0.0,
    comm_bandwidth_efficiency=1.0,
    instruction_overhead_seconds=0.0,
    kernel_overhead_seconds=0.0,
    matmul_operand_traffic=0.0,
)


def alpa_mesh(shape: Sequence[int], alpha: Sequence[float], beta: Sequence[float]) -> LogicalMesh:
    """Alpa's ``get_logical_mesh(shape, mesh_alpha, mesh_beta)`` on one 4-device host."""
    a, b = shape
    axes = tuple(
        MeshAxis(size, al if size > 1 else 0.0, be if size > 1 else 0.0)
        for size, al, be in zip(shape, alpha, beta, strict=True)
    )
    return LogicalMesh((1, a * b), (a, b), (axes[0], axes[1]))


def all_reduce_cost(mesh: LogicalMesh, nbytes: float, dim: int) -> float:
    """Alpa's ``all_reduce_cost(num_bytes, mesh_dim)`` (without its +0.01)."""
    axis = mesh.axes[dim]
    n = axis.size
    return axis.alpha_seconds + axis.beta_seconds_per_byte * 2 * (n - 1) / n * nbytes


@dataclass(frozen=True)
class Model:
    """A trainable model (what :func:`~alpajob.trainer_image.step.graph_of` needs)."""

    name: str
    init: Callable[[jax.Array], Any]
    loss: Callable[[Any, Any], jax.Array]
    batch_shapes: Callable[[int], Any]


@dataclass(frozen=True)
class Planned:
    """A solved case: the graph, the result and the parameters by path name."""

    graph: OpGraph
    result: IntraOpResult

    def spec(self, name: str) -> ShardSpec:
        """The sharding of the parameter at path ``name`` (``Dense_0/kernel``)."""
        k = self.graph.param_names.index(name)
        return self.result.specs[self.graph.params[k]]

    @property
    def param_specs(self) -> dict[str, ShardSpec]:
        return {n: self.result.specs[p]
                for n, p in zip(self.graph.param_names, self.graph.params, strict=True)}

    def counts(self, *, ignore_scalar_all_reduce: bool = False) -> dict[CollectiveKind, int]:
        """Collectives by kind, as Alpa's ``count_communication_primitives``."""
        return dict(count_collectives(self.result.collectives,
                                      ignore_scalar_all_reduce=ignore_scalar_all_reduce))

    @property
    def comm(self) -> float:
        """Alpa's objective: every collective of the step (one micro-batch)."""
        return self.result.comm_seconds + self.result.update_seconds


def plan(model: Model, batch_size: int, mesh: LogicalMesh, *,
         mode: ShardingMode = ShardingMode.AUTO, optimizer: str = "adam") -> Planned:
    """Our sharding of ``model``'s whole training step on ``mesh`` at Alpa's costs."""
    graph = graph_of(model, batch_size, optimizer)
    result = solve_intra_op(graph, range(len(graph.ops)), mesh, ALPA_DEVICE,
                            ALPA_CALIBRATION, mode=mode)
    return Planned(graph, result)


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def mlp(num_layers: int, dim: int, *, use_bias: bool = True) -> Model:
    """``test_mlp``'s model: ``num_layers`` dense layers of width ``dim``, ReLU between,
    mean squared error against ``y``."""

    def init(key: jax.Array) -> Any:
        return {f"Dense_{i}": {"kernel": jnp.zeros((dim, dim)), **(
            {"bias": jnp.zeros((dim,))} if use_bias else {})} for i in range(num_layers)}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = batch["x"]
        for i in range(num_layers):
            layer = params[f"Dense_{i}"]
            x = x @ layer["kernel"] + (layer["bias"] if use_bias else 0.0)
            if i < num_layers - 1:
                x = jax.nn.relu(x)
        return jnp.mean((x - batch["y"]) ** 2)

    return Model("alpa-mlp", init, loss, lambda n: {"x": _f32(n, dim), "y": _f32(n, dim)})


def _layer_norm(x: jax.Array, p: Any) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-12) * p["scale"] + p["bias"]


def _dense(x: jax.Array, p: Any) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def _dropout(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def bert_layer(x: jax.Array, mask: jax.Array, p: Any, heads: int, key: jax.Array | None,
               rate: float = 0.1) -> jax.Array:
    """One BERT encoder layer: fused QKV projection, attention, output projection,
    residual + LayerNorm, a 4x MLP with GELU, residual + LayerNorm; dropout after the
    attention probabilities and both projections when ``key`` is given."""
    b, s, h = x.shape
    d = h // heads
    # Alpa's layout: the fused projection viewed as [b, s, h, 3], split on the last dim.
    qkv = _dense(x, p["qkv"]).reshape(b, s, h, 3)
    q, v, k = (t.reshape(b, s, heads, d) for t in jnp.split(qkv, 3, axis=3))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores + jnp.where(mask[:, None, None, :] > 0, 0.0, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    keys = jax.random.split(key, 3) if key is not None else (None, None, None)
    if keys[0] is not None:
        probs = _dropout(probs, keys[0], rate)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h)
    attn = _dense(attn, p["attn_out"])
    if keys[1] is not None:
        attn = _dropout(attn, keys[1], rate)
    x = _layer_norm(x + attn, p["ln1"])
    y = _dense(jax.nn.gelu(_dense(x, p["intermediate"])), p["output"])
    if keys[2] is not None:
        y = _dropout(y, keys[2], rate)
    return _layer_norm(x + y, p["ln2"])


def _bert_layer_params(h: int) -> Any:
    def dense(i: int, o: int) -> Any:
        return {"kernel": jnp.zeros((i, o)), "bias": jnp.zeros((o,))}

    def norm() -> Any:
        return {"scale": jnp.ones((h,)), "bias": jnp.zeros((h,))}

    return {"qkv": dense(h, 3 * h), "attn_out": dense(h, h), "ln1": norm(),
            "intermediate": dense(h, 4 * h), "output": dense(4 * h, h), "ln2": norm()}


#: The four matmul weights of a BERT layer, in order (Megatron: column, row, column, row).
BERT_WEIGHTS = ("qkv", "attn_out", "intermediate", "output")


def bert_layers(num_layers: int, seq_len: int, hidden: int, heads: int, *,
                dropout: bool) -> Model:
    """``test_bert``'s layer stack: hidden states in, MSE against a label of the same
    shape; with ``dropout`` (Alpa's ``deterministic=False``) a PRNG key in the batch."""

    def init(key: jax.Array) -> Any:
        return {str(i): _bert_layer_params(hidden) for i in range(num_layers)}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = batch["hidden_states"]
        keys = (jax.random.split(batch["rng"], num_layers) if dropout
                else [None] * num_layers)
        for i in range(num_layers):
            x = bert_layer(x, batch["attention_mask"], params[str(i)], heads, keys[i])
        return jnp.mean((x - batch["label"]) ** 2)

    def shapes(n: int) -> Any:
        batch = {"hidden_states": _f32(n, seq_len, hidden),
                 "attention_mask": jax.ShapeDtypeStruct((n, seq_len), jnp.int32),
                 "label": _f32(n, seq_len, hidden)}
        if dropout:
            batch["rng"] = jax.ShapeDtypeStruct((2,), jnp.uint32)
        return batch

    return Model("alpa-bert-layers", init, loss, shapes)


def dense_dropout_dense() -> Model:
    """``test_basic.test_dropout``'s model: Dense(16), dropout 0.1, Dense(16), no bias,
    on ``x [32, 32, 16]``."""

    def init(key: jax.Array) -> Any:
        return {"Dense_0": {"kernel": jnp.zeros((16, 16))},
                "Dense_1": {"kernel": jnp.zeros((16, 16))}}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = batch["x"] @ params["Dense_0"]["kernel"]
        x = _dropout(x, batch["rng"], 0.1)
        x = x @ params["Dense_1"]["kernel"]
        return jnp.mean((x - batch["y"]) ** 2)

    return Model("alpa-dropout", init, loss, lambda n: {
        "x": _f32(n, 32, 16), "y": _f32(n, 32, 16),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)})
