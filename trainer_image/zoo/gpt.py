"""GPT: a decoder-only pre-LN transformer language model (the Alpa paper's GPT suite).

Structure (``h`` = hidden, ``n`` = heads, ``s`` = seqLen, ``v`` = vocab)::

    input_ids [b, s] --gather--> token embedding [v, h] + position embedding [s, h]
    layer_i (i < layers), each inside named_scope("layer_i"):
        x = x + attn(LN1(x))    q, k, v, o: [h, h] dense; causal softmax per head
        x = x + mlp(LN2(x))     [h, 4h] -> gelu -> [4h, h]
    final LN; logits = x @ token_embedding.T (tied LM head); cross-entropy vs labels

Parameters per layer are ``12 h^2 + 13 h``, plus ``(v + s) h + 2 h`` outside the layers,
so GPT-2.6B (h=2560, 32 layers) has 2.65e9. The attention and dense pieces are reused
by :mod:`alpajob.trainer_image.zoo.moe`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from alpajob.api.zoo import GPT_MLP_FACTOR
from alpajob.trainer_image.zoo.model import (
    Batch,
    ModelDef,
    Params,
    dense,
    dense_init,
    gelu,
    layer_norm,
    norm_init,
    normal,
    per_part_init,
    softmax_as,
    softmax_cross_entropy,
)

#: Ratio of the MLP's inner width to ``hidden``.
MLP_FACTOR = GPT_MLP_FACTOR


def embed_init(key: jax.Array, vocab: int, seq_len: int, hidden: int, dtype: str) -> Params:
    """Token and position embeddings."""
    k_tok, k_pos = jax.random.split(key)
    return {
        "tokens": normal(k_tok, (vocab, hidden), dtype, 0.02),
        "positions": normal(k_pos, (seq_len, hidden), dtype, 0.02),
    }


def embed(params: Params, input_ids: jax.Array) -> jax.Array:
    """``tokens[input_ids] + positions`` -> ``[batch, seq, hidden]``."""
    x = jnp.take(params["tokens"], input_ids, axis=0)
    return x + params["positions"][None, : input_ids.shape[1]]


def attention_init(key: jax.Array, hidden: int, dtype: str) -> Params:
    """Query, key, value and output projections, each ``[hidden, hidden]`` plus bias."""
    keys = jax.random.split(key, 4)
    return {name: dense_init(k, hidden, hidden, dtype) for name, k in zip("qkvo", keys, strict=True)}


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, fused: bool | None = None) -> jax.Array:
    """Causal scaled dot-product attention of ``[batch, seq, heads, head_dim]`` queries,
    keys and values.

    ``fused`` (default: on a GPU) calls ``jax.nn.dot_product_attention`` with the mask
    as its own ``is_causal`` argument, which JAX runs as cuDNN's fused attention where
    the GPU supports it (nothing of size ``seq^2`` kept for the backward) and as XLA's
    attention otherwise. Elsewhere the scores are written out: softmax in float32,
    kept for the backward in the compute type only (:func:`~.model.softmax_as`), the
    causal mask an additive bias the backward does not read; on CPU this keeps a third
    of what XLA's attention keeps, and the planner, which traces on CPU, prices it.
    Both compute the same function (a test holds them to it).
    """
    if fused is None:
        fused = jax.default_backend() == "gpu"
    if fused:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    s, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) * head_dim**-0.5
    row = lax.broadcasted_iota(jnp.int32, (s, s), 0)
    col = lax.broadcasted_iota(jnp.int32, (s, s), 1)
    causal = jnp.where(col <= row, 0.0, jnp.finfo(jnp.float32).min)  # [s, s], added
    probs = softmax_as(scores + causal, q.dtype)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v)


def causal_attention(params: Params, x: jax.Array, heads: int) -> jax.Array:
    """Multi-head self-attention with a causal mask (:func:`attention_core`)."""
    b, s, h = x.shape
    head_dim = h // heads
    q = dense(params["q"], x).reshape(b, s, heads, head_dim)
    k = dense(params["k"], x).reshape(b, s, heads, head_dim)
    v = dense(params["v"], x).reshape(b, s, heads, head_dim)
    return dense(params["o"], attention_core(q, k, v).reshape(b, s, h))


def mlp_init(key: jax.Array, hidden: int, ffn: int, dtype: str) -> Params:
    """The position-wise MLP ``[hidden, ffn] -> gelu -> [ffn, hidden]``."""
    k1, k2 = jax.random.split(key)
    return {"fc1": dense_init(k1, hidden, ffn, dtype), "fc2": dense_init(k2, ffn, hidden, dtype)}


def mlp(params: Params, x: jax.Array) -> jax.Array:
    """``fc2(gelu(fc1(x)))``."""
    return dense(params["fc2"], gelu(dense(params["fc1"], x)))


def lm_head_loss(params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
    """Final LN, tied LM head (``x @ tokens.T``), mean cross-entropy against ``labels``."""
    x = layer_norm(params["final_ln"], x)
    logits = jnp.einsum("bsh,vh->bsv", x, params["embed"]["tokens"])
    return softmax_cross_entropy(logits, labels)


def token_batch_shapes(seq_len: int):
    """``batch_shapes`` of a language model: int32 ``input_ids`` and ``labels``."""

    def batch_shapes(batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.dtype(jnp.int32))
        return {"input_ids": shape, "labels": shape}

    return batch_shapes


def build(name: str, config: dict[str, Any], dtype: str) -> ModelDef:
    """The GPT :class:`ModelDef` for a resolved ``config``."""
    hidden, layers, heads = config["hidden"], config["layers"], config["heads"]
    seq_len, vocab = config["seqLen"], config["vocab"]

    def block_init(k: jax.Array) -> Params:
        k_attn, k_mlp = jax.random.split(k)
        return {
            "ln1": norm_init(hidden, dtype),
            "attn": attention_init(k_attn, hidden, dtype),
            "ln2": norm_init(hidden, dtype),
            "mlp": mlp_init(k_mlp, hidden, MLP_FACTOR * hidden, dtype),
        }

    init = per_part_init(
        lambda k: embed_init(k, vocab, seq_len, hidden, dtype), [block_init] * layers,
        lambda: norm_init(hidden, dtype))

    def loss(params: Params, batch: Batch) -> jax.Array:
        with jax.named_scope("embed"):
            x = embed(params["embed"], batch["input_ids"])
        for i, block in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                x = x + causal_attention(block["attn"], layer_norm(block["ln1"], x), heads)
                x = x + mlp(block["mlp"], layer_norm(block["ln2"], x))
        with jax.named_scope("head"):
            return lm_head_loss(params, x, batch["labels"])

    return ModelDef(name, "gpt", init, loss, token_batch_shapes(seq_len), dtype, dict(config))
