"""MoE: a GShard-style mixture-of-experts transformer (the Alpa paper's MoE suite).

The GPT structure of :mod:`alpajob.trainer_image.zoo.gpt` (pre-LN, causal attention, tied LM
head) with an MLP of width ``8 * hidden`` (Alpa's setting), where every odd layer's
MLP is a mixture of ``experts`` experts with top-2 gating (Lepikhin et al., GShard):

1. Tokens ``[b, s, h]`` are reshaped into ``g = b*s / expertGroupSize`` groups of
   ``expertGroupSize`` tokens (so ``b * seqLen`` must be a multiple of it).
2. Gates ``softmax(x @ wg)`` ``[g, t, e]``; each token picks its best expert and its
   best among the rest. A token's slot in an expert's buffer is the running count
   (``cumsum``) of earlier tokens that picked it; slots past the capacity
   ``c = round(capacityFactor * expertGroupSize / experts)`` are dropped, and second
   choices queue after all first choices.
3. ``combine [g, t, e, c]`` holds the normalized gate weight at each kept
   (token, expert, slot); ``dispatch`` is its non-zero pattern. Einsums move tokens to
   ``[e, g, c, h]``, apply each expert's ``[h, f]`` and ``[f, h]`` weights (expert
   weights are stacked ``[experts, hidden, ffn]``) and bring them back.
4. The auxiliary load-balancing loss ``experts * sum_e(mean_t(gate_e) * mean_t(top1 == e))``
   (1 when balanced), weighted by ``AUX_LOSS_WEIGHT``, is added to the LM loss.

With half the layers MoE, the parameters are
``layers/2 * (20 h^2 + (4 + 16 * experts) h^2) + vocab*h`` to leading order: MoE-380M
(h=768, 8 layers, 8 experts) has 3.8e8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from alpajob.api.zoo import MOE_MLP_FACTOR
from alpajob.trainer_image.zoo import gpt
from alpajob.trainer_image.zoo.model import (
    Batch,
    ModelDef,
    Params,
    gelu,
    layer_norm,
    norm_init,
    normal,
    per_part_init,
)

#: Ratio of the (dense and expert) MLP's inner width to ``hidden``, as in Alpa's suite.
MLP_FACTOR = MOE_MLP_FACTOR
#: Weight of the auxiliary load-balancing loss.
AUX_LOSS_WEIGHT = 0.01


def capacity(config: dict[str, Any]) -> int:
    """Slots per expert per group: ``round(capacityFactor * expertGroupSize / experts)``."""
    return max(1, round(config["capacityFactor"] * config["expertGroupSize"] / config["experts"]))


def moe_init(key: jax.Array, hidden: int, ffn: int, experts: int, dtype: str) -> Params:
    """Gate ``[h, e]`` and stacked expert weights ``[e, h, f]``, ``[e, f, h]``."""
    k_gate, k_in, k_out = jax.random.split(key, 3)
    return {
        "gate": normal(k_gate, (hidden, experts), dtype, hidden**-0.5),
        "wi": normal(k_in, (experts, hidden, ffn), dtype, hidden**-0.5),
        "bi": jnp.zeros((experts, ffn), dtype),
        "wo": normal(k_out, (experts, ffn, hidden), dtype, ffn**-0.5),
        "bo": jnp.zeros((experts, hidden), dtype),
    }


def top2_routing(gates: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """GShard top-2 routing of ``gates [g, t, e]`` (float32) into ``slots`` per expert.

    Returns ``(combine [g, t, e, c], aux_loss)``; see the module docstring.
    """
    experts = gates.shape[-1]
    first = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(first, experts, dtype=jnp.int32)
    rest = gates * (1 - mask1)
    second = jnp.argmax(rest, axis=-1)
    mask2 = jax.nn.one_hot(second, experts, dtype=jnp.int32)

    aux = experts * jnp.mean(
        jnp.sum(jnp.mean(gates, axis=1) * jnp.mean(mask1.astype(jnp.float32), axis=1), axis=-1)
    )

    pos1 = jnp.cumsum(mask1, axis=1) - mask1
    mask1 = mask1 * (pos1 < slots)
    pos2 = jnp.cumsum(mask2, axis=1) - mask2 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < slots)

    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(gate1 + gate2, 1e-9)
    gate1, gate2 = gate1 / denom, gate2 / denom

    slot1 = jax.nn.one_hot(jnp.sum(pos1 * mask1, axis=-1), slots, dtype=jnp.float32)
    slot2 = jax.nn.one_hot(jnp.sum(pos2 * mask2, axis=-1), slots, dtype=jnp.float32)
    combine = jnp.einsum("gte,gtc->gtec", gate1[..., None] * mask1, slot1) + jnp.einsum(
        "gte,gtc->gtec", gate2[..., None] * mask2, slot2
    )
    return combine, aux


def moe_mlp(params: Params, x: jax.Array, config: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """The mixture-of-experts MLP of ``x [b, s, h]``; returns ``(y, aux_loss)``."""
    b, s, h = x.shape
    group = config["expertGroupSize"]
    if (b * s) % group:
        raise ValueError(
            f"batch {b} x seqLen {s} = {b * s} tokens is not a multiple of "
            f"expertGroupSize={group}; pick a batch (or micro-batch) size that makes it one"
        )
    tokens = x.reshape(b * s // group, group, h)
    gates = jax.nn.softmax((tokens @ params["gate"]).astype(jnp.float32), axis=-1)
    combine, aux = top2_routing(gates, capacity(config))
    dispatch = (combine > 0).astype(x.dtype)
    combine = combine.astype(x.dtype)
    expert_in = jnp.einsum("gtec,gth->egch", dispatch, tokens)
    hidden = jnp.einsum("egch,ehf->egcf", expert_in, params["wi"]) + params["bi"][:, None, None]
    hidden = gelu(hidden)
    expert_out = jnp.einsum("egcf,efh->egch", hidden, params["wo"]) + params["bo"][:, None, None]
    y = jnp.einsum("gtec,egch->gth", combine, expert_out)
    return y.reshape(b, s, h), aux


def build(name: str, config: dict[str, Any], dtype: str) -> ModelDef:
    """The MoE :class:`ModelDef` for a resolved ``config``."""
    hidden, layers, heads = config["hidden"], config["layers"], config["heads"]
    seq_len, vocab, experts = config["seqLen"], config["vocab"], config["experts"]
    ffn = MLP_FACTOR * hidden

    def is_moe(i: int) -> bool:
        return i % 2 == 1

    def block_init(moe: bool) -> Callable[[jax.Array], Params]:
        def one(k: jax.Array) -> Params:
            k_attn, k_mlp = jax.random.split(k)
            block = {
                "ln1": norm_init(hidden, dtype),
                "attn": gpt.attention_init(k_attn, hidden, dtype),
                "ln2": norm_init(hidden, dtype),
            }
            if moe:
                block["moe"] = moe_init(k_mlp, hidden, ffn, experts, dtype)
            else:
                block["mlp"] = gpt.mlp_init(k_mlp, hidden, ffn, dtype)
            return block

        return one

    kinds = {moe: block_init(moe) for moe in (False, True)}
    init = per_part_init(
        lambda k: gpt.embed_init(k, vocab, seq_len, hidden, dtype), [kinds[is_moe(i)] for i in range(layers)],
        lambda: norm_init(hidden, dtype))

    def loss(params: Params, batch: Batch) -> jax.Array:
        with jax.named_scope("embed"):
            x = gpt.embed(params["embed"], batch["input_ids"])
        aux_total = jnp.zeros((), jnp.float32)
        for i, block in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                x = x + gpt.causal_attention(block["attn"], layer_norm(block["ln1"], x), heads)
                y = layer_norm(block["ln2"], x)
                if is_moe(i):
                    y, aux = moe_mlp(block["moe"], y, config)
                    aux_total = aux_total + aux
                else:
                    y = gpt.mlp(block["mlp"], y)
                x = x + y
        with jax.named_scope("head"):
            lm_loss = gpt.lm_head_loss(params, x, batch["labels"])
            return lm_loss + AUX_LOSS_WEIGHT * aux_total

    return ModelDef(name, "moe", init, loss, gpt.token_batch_shapes(seq_len), dtype, dict(config))
