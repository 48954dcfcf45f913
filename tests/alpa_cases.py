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
import optax

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
        return dict(count_collectives(self.result.collectives, self.graph,
                                      ignore_scalar_all_reduce=ignore_scalar_all_reduce))

    @property
    def comm(self) -> float:
        """Alpa's objective: every collective of the step (one micro-batch)."""
        return self.result.comm_seconds + self.result.update_seconds


def plan(model: Model, batch_size: int, mesh: LogicalMesh, *,
         mode: ShardingMode = ShardingMode.AUTO,
         optimizer: str | optax.GradientTransformation = "adam") -> Planned:
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


def _self_attention(x: jax.Array, mask: jax.Array, p: Any, heads: int,
                    keys: tuple[jax.Array | None, jax.Array | None], rate: float) -> jax.Array:
    """BERT self-attention with residual + LayerNorm: the fused QKV projection viewed
    as ``[b, s, h, 3]`` and split on the last dim (Alpa's layout), attention, output
    projection; dropout after the probabilities and the projection where ``keys`` give
    a key."""
    b, s, h = x.shape
    d = h // heads
    qkv = _dense(x, p["qkv"]).reshape(b, s, h, 3)
    q, v, k = (t.reshape(b, s, heads, d) for t in jnp.split(qkv, 3, axis=3))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores + jnp.where(mask[:, None, None, :] > 0, 0.0, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    if keys[0] is not None:
        probs = _dropout(probs, keys[0], rate)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h)
    attn = _dense(attn, p["attn_out"])
    if keys[1] is not None:
        attn = _dropout(attn, keys[1], rate)
    return _layer_norm(x + attn, p["ln1"])


def bert_layer(x: jax.Array, mask: jax.Array, p: Any, heads: int, key: jax.Array | None,
               rate: float = 0.1) -> jax.Array:
    """One BERT encoder layer: self-attention (:func:`_self_attention`), a 4x MLP with
    GELU, residual + LayerNorm; dropout in the attention and after the MLP when
    ``key`` is given."""
    keys = jax.random.split(key, 3) if key is not None else (None, None, None)
    x = _self_attention(x, mask, p, heads, (keys[0], keys[1]), rate)
    y = _dense(jax.nn.gelu(_dense(x, p["intermediate"])), p["output"])
    if keys[2] is not None:
        y = _dropout(y, keys[2], rate)
    return _layer_norm(x + y, p["ln2"])


def _dense_params(i: int, o: int) -> Any:
    return {"kernel": jnp.zeros((i, o)), "bias": jnp.zeros((o,))}


def _norm_params(h: int) -> Any:
    return {"scale": jnp.ones((h,)), "bias": jnp.zeros((h,))}


def _bert_layer_params(h: int) -> Any:
    return {"qkv": _dense_params(h, 3 * h), "attn_out": _dense_params(h, h),
            "ln1": _norm_params(h), "intermediate": _dense_params(h, 4 * h),
            "output": _dense_params(4 * h, h), "ln2": _norm_params(h)}


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


def tied_embedding(vocab: int, hidden: int, seq_len: int) -> Model:
    """``test_bert.test_embedding_2d_mesh``'s model: ids looked up in an embedding
    whose transpose also projects back to the vocabulary; summed cross-entropy."""

    def init(key: jax.Array) -> Any:
        return {"embed": {"embedding": jnp.zeros((vocab, hidden))}}

    def loss(params: Any, batch: Any) -> jax.Array:
        table = params["embed"]["embedding"]
        logits = jnp.take(table, batch["x"], axis=0) @ table.T
        labels = jax.nn.one_hot(batch["y"], vocab)
        return -jnp.sum(labels * jax.nn.log_softmax(logits, axis=-1), axis=-1).sum()

    ids = jax.ShapeDtypeStruct
    return Model("alpa-tied-embedding", init, loss, lambda n: {
        "x": ids((n, seq_len), jnp.int32), "y": ids((n, seq_len), jnp.int32)})


def bert_mlm(num_layers: int, seq_len: int, hidden: int, heads: int, vocab: int) -> Model:
    """``test_bert``'s masked-LM BERT: word, position and token-type embeddings,
    LayerNorm, dropout, the layer stack, the LM head's transform (dense, GELU,
    LayerNorm) and a decoder tied to the word embedding; Alpa's masked loss."""

    def init(key: jax.Array) -> Any:
        return {
            "embeddings": {"word": jnp.zeros((vocab, hidden)),
                           "position": jnp.zeros((seq_len, hidden)),
                           "token_type": jnp.zeros((2, hidden)), "ln": _norm_params(hidden)},
            "encoder": {str(i): _bert_layer_params(hidden) for i in range(num_layers)},
            "cls": {"transform": {"kernel": jnp.zeros((hidden, hidden)),
                                  "bias": jnp.zeros((hidden,))},
                    "ln": _norm_params(hidden), "bias": jnp.zeros((vocab,))},
        }

    def loss(params: Any, batch: Any) -> jax.Array:
        emb = params["embeddings"]
        keys = jax.random.split(batch["rng"], num_layers + 1)
        x = (jnp.take(emb["word"], batch["input_ids"], axis=0)
             + jnp.take(emb["position"], batch["position_ids"], axis=0)
             + jnp.take(emb["token_type"], batch["token_type_ids"], axis=0))
        x = _dropout(_layer_norm(x, emb["ln"]), keys[0], 0.1)
        for i in range(num_layers):
            x = bert_layer(x, batch["attention_mask"], params["encoder"][str(i)], heads,
                           keys[i + 1])
        head = params["cls"]
        x = _layer_norm(jax.nn.gelu(_dense(x, head["transform"])), head["ln"])
        logits = x @ emb["word"].T + head["bias"]
        mask = jnp.where(batch["labels"] > 0, 1.0, 0.0)
        labels = jax.nn.one_hot(batch["labels"], vocab)
        per_token = -jnp.sum(labels * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        return (mask * per_token).sum() / mask.sum() * 0.1234

    def shapes(n: int) -> Any:
        ids = jax.ShapeDtypeStruct((n, seq_len), jnp.int32)
        return {"input_ids": ids, "attention_mask": ids, "token_type_ids": ids,
                "position_ids": ids, "labels": ids,
                "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}

    return Model("alpa-bert-mlm", init, loss, shapes)


def moe_layer(seq_len: int, hidden: int, heads: int, group: int, experts: int) -> Model:
    """``test_moe``'s layer: BERT self-attention (fused QKV, output projection,
    residual + LayerNorm), then a GShard mixture-of-experts MLP (4x wide, top-2
    routing in groups of ``group`` tokens, capacity factor 2: the zoo's
    :func:`~alpajob.trainer_image.zoo.moe.moe_mlp`), residual + LayerNorm; MSE."""
    from alpajob.trainer_image.zoo.moe import moe_mlp

    config = {"expertGroupSize": group, "experts": experts, "capacityFactor": 2.0}

    def init(key: jax.Array) -> Any:
        ffn = 4 * hidden
        return {"qkv": _dense_params(hidden, 3 * hidden), "attn_out": _dense_params(hidden, hidden),
                "ln1": _norm_params(hidden), "ln2": _norm_params(hidden),
                "moe": {"gate": jnp.zeros((hidden, experts)),
                        "wi": jnp.zeros((experts, hidden, ffn)), "bi": jnp.zeros((experts, ffn)),
                        "wo": jnp.zeros((experts, ffn, hidden)),
                        "bo": jnp.zeros((experts, hidden))}}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = _self_attention(batch["hidden_states"], batch["attention_mask"], params, heads,
                            (None, None), 0.0)
        y, _ = moe_mlp(params["moe"], x, config)
        x = _layer_norm(x + y, params["ln2"])
        return jnp.mean((x - batch["labels"]) ** 2)

    return Model("alpa-moe-layer", init, loss, lambda n: {
        "hidden_states": _f32(n, seq_len, hidden),
        "attention_mask": jax.ShapeDtypeStruct((n, seq_len), jnp.int32),
        "labels": _f32(n, seq_len, hidden)})


def mixed_experts(experts: int = 4, width: int = 16) -> Model:
    """``test_mixed_2d``'s model: two dense layers, the features viewed as
    ``[B, E, M/E]``, two expert einsums (``BEM,EMH->EBH`` and ``EBH,EHM->BEM``, H = 8M),
    back to ``[B, M]``, two dense layers; no biases, MSE."""
    part, inner = width // experts, 8 * width

    def init(key: jax.Array) -> Any:
        return {**{f"Dense_{i}": {"kernel": jnp.zeros((width, width))} for i in range(4)},
                "wi": jnp.zeros((experts, part, inner)), "wo": jnp.zeros((experts, inner, part))}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = batch["x"] @ params["Dense_0"]["kernel"] @ params["Dense_1"]["kernel"]
        x = x.reshape(-1, experts, part)
        x = jnp.einsum("BEM,EMH->EBH", x, params["wi"])
        x = jnp.einsum("EBH,EHM->BEM", x, params["wo"]).reshape(-1, width)
        x = x @ params["Dense_2"]["kernel"] @ params["Dense_3"]["kernel"]
        return jnp.mean((x - batch["y"]) ** 2)

    return Model("alpa-mixed-2d", init, loss,
                 lambda n: {"x": _f32(n, width), "y": _f32(n, width)})


def dense_gather_dense() -> Model:
    """``test_basic.test_gather``'s model: Dense(32), the first 16 columns picked by an
    index array (a gather), Dense(16), no biases, on ``x [256, 32]``."""

    def init(key: jax.Array) -> Any:
        return {"Dense_0": {"kernel": jnp.zeros((32, 32))},
                "Dense_1": {"kernel": jnp.zeros((16, 16))}}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = batch["x"] @ params["Dense_0"]["kernel"]
        x = jnp.take(x, jnp.arange(16) * 2, axis=1)  # every other column: a real gather
        x = x @ params["Dense_1"]["kernel"]
        return jnp.mean((x - batch["y"]) ** 2)

    return Model("alpa-gather", init, loss, lambda n: {"x": _f32(n, 32), "y": _f32(n, 16)})


def gemv() -> Model:
    """``test_basic.test_gemv``: a vector ``a [128]`` times a matrix ``b [128, 256]``,
    both trained here (the squared product, scaled by the batch's mean, is the loss)."""

    def init(key: jax.Array) -> Any:
        return {"a": jnp.zeros((128,)), "b": jnp.zeros((128, 256))}

    def loss(params: Any, batch: Any) -> jax.Array:
        return jnp.mean((params["a"] @ params["b"]) ** 2) * batch["scale"].mean()

    return Model("alpa-gemv", init, loss, lambda n: {"scale": _f32(n)})


def argmax_over_rows() -> Model:
    """``test_basic.test_argmax``: ``argmax(a, axis=0)`` of ``a [144, 144]`` (here
    weighting a trained vector, so the step has a loss)."""

    def init(key: jax.Array) -> Any:
        return {"w": jnp.zeros((144,))}

    def loss(params: Any, batch: Any) -> jax.Array:
        picked = jnp.argmax(batch["a"], axis=0).astype(jnp.float32)
        return jnp.mean(params["w"] * picked)

    return Model("alpa-argmax", init, loss, lambda n: {"a": _f32(n, 144)})


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


#: ``test_conv``'s optimizer.
SGD_MOMENTUM = optax.sgd(0.1, momentum=0.9)


def _batch_norm(x: jax.Array, p: Any) -> jax.Array:
    """Flax's ``BatchNorm`` in training mode over every dim but the channels: the mean
    and the mean of squares from the batch (two independent reductions)."""
    axes = tuple(range(x.ndim - 1))
    mean = x.mean(axes)
    var = jnp.maximum(0.0, (x * x).mean(axes) - mean * mean)
    return (x - mean) * (jax.lax.rsqrt(var + 1e-5) * p["scale"]) + p["bias"]


def _conv(x: jax.Array, kernel: jax.Array, stride: int, groups: int = 1) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=groups)


def _max_pool(x: jax.Array) -> jax.Array:
    """2 x 2 max-pool, stride 1, SAME (its backward is ``select_and_scatter_add``)."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")


def conv_net(num_layers: int, image: int, channel: int) -> Model:
    """``test_conv``'s net: ``num_layers`` x (3 x 3 conv stride 2 without bias,
    BatchNorm, ReLU, 2 x 2 max-pool), MSE against ``y``."""

    def init(key: jax.Array) -> Any:
        return {**{f"Conv_{i}": {"kernel": jnp.zeros((3, 3, channel, channel))}
                   for i in range(num_layers)},
                **{f"BatchNorm_{i}": {"scale": jnp.ones(channel), "bias": jnp.zeros(channel)}
                   for i in range(num_layers)}}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = batch["x"]
        for i in range(num_layers):
            x = _conv(x, params[f"Conv_{i}"]["kernel"], 2)
            x = _max_pool(jax.nn.relu(_batch_norm(x, params[f"BatchNorm_{i}"])))
        return jnp.mean((x - batch["y"]) ** 2)

    out = image // 2 ** num_layers
    return Model("alpa-conv", init, loss, lambda n: {
        "x": _f32(n, image, image, channel), "y": _f32(n, out, out, channel)})


def depthwise_conv_net(image: int, channel: int) -> Model:
    """``test_conv``'s depthwise net: conv to 8 x channels, depthwise 3 x 3 conv
    (``feature_group_count`` = 8 x channels), conv back to channels, ReLU, BatchNorm."""
    wide = 8 * channel

    def init(key: jax.Array) -> Any:
        return {"Conv_0": {"kernel": jnp.zeros((3, 3, channel, wide))},
                "Conv_1": {"kernel": jnp.zeros((3, 3, 1, wide))},
                "Conv_2": {"kernel": jnp.zeros((3, 3, wide, channel))},
                "BatchNorm_0": {"scale": jnp.ones(channel), "bias": jnp.zeros(channel)}}

    def loss(params: Any, batch: Any) -> jax.Array:
        x = _conv(batch["x"], params["Conv_0"]["kernel"], 1)
        x = _conv(x, params["Conv_1"]["kernel"], 1, groups=wide)
        x = _conv(x, params["Conv_2"]["kernel"], 1)
        x = _batch_norm(jax.nn.relu(x), params["BatchNorm_0"])
        return jnp.mean((x - batch["y"]) ** 2)

    return Model("alpa-depthwise-conv", init, loss, lambda n: {
        "x": _f32(n, image, image, channel), "y": _f32(n, image, image, channel)})
