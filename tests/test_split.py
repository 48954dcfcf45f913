"""Cutting a traced loss into stages (:mod:`alpajob.trainer_image.runtime.split`).

The equivalence tests check that split programs train to the serial numbers; these
check where the cut puts the work, on losses small enough to reason about by hand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from alpajob.trainer_image.runtime.split import (
    SplitProgram,
    is_differentiable,
    split_loss,
    stage_function,
)

WIDTH = 8


def _params() -> dict[str, Any]:
    shape = jax.ShapeDtypeStruct
    return {"a": shape((WIDTH, WIDTH), jnp.float32), "b": shape((WIDTH, WIDTH), jnp.float32),
            "scale": shape((WIDTH,), jnp.float32)}


def _batch() -> Any:
    return jax.ShapeDtypeStruct((4, WIDTH), jnp.float32)


def _batch_free(split: SplitProgram) -> set[int]:
    """Values computed from parameters and constants alone."""
    free = set(split.param_ids) | set(split.consts)
    for stage in split.stages:
        for eqn in stage.eqns:
            if all(v in free for v in eqn.inputs if isinstance(v, int)):
                free.update(eqn.outputs)
    return free


def _scaled_after_b(params: dict[str, Any], x: Any) -> Any:
    """The scale is applied to the output of ``b``: a broadcast of it (parameters
    only) feeds an equation that cannot run before stage 1."""
    h = jnp.tanh(x @ params["a"]) @ params["b"]
    return jnp.sum((h * params["scale"][None, :]) ** 2)


def _scaled_twice(params: dict[str, Any], x: Any) -> Any:
    """The scale is applied on both stages."""
    h = jnp.tanh((x * params["scale"]) @ params["a"]) @ params["b"]
    return jnp.sum((h * params["scale"][None, :]) ** 2)


# flat leaf order is a, b, scale; the planner puts the scale on stage 0
STAGES = [0, 1, 0]


def test_a_value_of_parameters_alone_moves_to_its_reader_instead_of_crossing() -> None:
    split = split_loss(_scaled_after_b, _params(), _batch(), STAGES, 2)
    assert not set(split.consumers) & _batch_free(split)  # nothing crosses once per micro-batch
    scale = 2
    assert split.home[scale] == 1  # read only on stage 1, so stage 1 owns and updates it
    assert split.shared_params() == {}
    assert [len(s.outputs) for s in split.stages] == [1, 0]  # only tanh(x @ a) crosses


def test_a_parameter_read_on_two_stages_is_shared_once_per_step() -> None:
    split = split_loss(_scaled_twice, _params(), _batch(), STAGES, 2)
    assert not set(split.consumers) & _batch_free(split)
    scale = 2
    assert split.home[scale] == 0
    assert split.shared_params() == {scale: (1,)}


def test_the_stages_compose_to_the_loss() -> None:
    """Run the cut stages one after another on real numbers: the loss is the same."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _params().items()}
    x = rng.standard_normal((4, WIDTH)).astype(np.float32)
    leaves = jax.tree.leaves(params)
    for loss_fn in (_scaled_after_b, _scaled_twice):
        split = split_loss(loss_fn, _params(), _batch(), STAGES, 2)
        values: dict[int, Any] = {}
        loss = None
        for stage in split.stages:
            run = stage_function(split, stage)
            outs, loss = run([leaves[k] for k in stage.params], [x for _ in stage.batch],
                             [values[v] for v in stage.inputs])
            values.update(zip(stage.outputs, outs, strict=True))
        np.testing.assert_allclose(loss, loss_fn(params, x), rtol=1e-6)


def test_every_floating_type_carries_a_gradient_between_stages() -> None:
    """bfloat16 and float8 activations send their gradients back like float32 ones
    (NumPy alone does not count them as floating point)."""
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn):
        assert is_differentiable(jax.ShapeDtypeStruct((2,), dtype)), dtype
    assert not is_differentiable(jax.ShapeDtypeStruct((2,), jnp.int32))
