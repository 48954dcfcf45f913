"""Mixed precision: bfloat16 and float16 compute with float32 master weights, and
float16's dynamic loss scaling, in the serial reference and in a pipeline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.api.spec import ModelSpec
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.local_run import run
from alpajob.trainer_image.precision import LossScale
from alpajob.trainer_image.runtime.build import param_names
from alpajob.trainer_image.step import make_scaled_train_step, named_optimizer

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40


def job(dtype: str, method: str) -> Any:
    stages = [{"layers": [0, 1], "submeshShape": [1, 4]}, {"layers": [1, 2], "submeshShape": [1, 4]}]
    parallelism = ({"method": "manual", "numLayers": 2, "numMicroBatches": 4, "stages": stages}
                   if method == "manual" else {"method": method})
    return parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "mixed"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"},
                 # The interpreter's own library: text that does not change with every
                 # commit of ours (16-bit runs drift apart at rates that depend on it).
                 "data": {"train": "{stdlib}/[a-m]*.py", "eval": "{stdlib}/[t-z]*.py"},
                 "training": {"globalBatchSize": 16, "steps": STEPS, "dtype": dtype, "evalEvery": STEPS,
                              "evalSteps": 2, "optimizer": {"name": "adamw", "learningRate": 3e-3,
                                                            "warmupSteps": 5, "clipNorm": 1.0}},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                 "parallelism": parallelism}})


def test_weights_are_float32_and_matrix_products_run_in_the_compute_type() -> None:
    model = load_model(ModelSpec(zoo="gpt", config="tiny"), "bfloat16")
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    text = str(jax.make_jaxpr(model.loss)(params, model.batch_shapes(2)))
    products = [line for line in text.splitlines() if "dot_general" in line]
    assert products and all("bf16[" in line for line in products)


# bfloat16's runs are slow-set cases (float16 exercises everything they do, and loss scaling).
@pytest.fixture(scope="module", params=[pytest.param("bfloat16", marks=pytest.mark.slow), "float16"])
def serial(request: pytest.FixtureRequest) -> Any:
    return request.param, run(job(request.param, "data"), TrainOptions(serial=True))


def test_mixed_precision_training_is_finite_and_learns(serial: Any) -> None:
    dtype, result = serial
    assert all(math.isfinite(x) for x in result.losses)
    assert result.evals[-1][1] < math.log(256) - 1.5, result.evals
    assert np.mean(result.losses[-5:]) < result.losses[0] - 1.5
    assert (result.skipped_steps >= 0) if dtype == "float16" else result.skipped_steps == 0


def test_a_pipeline_trains_like_the_serial_run_in_mixed_precision(serial: Any) -> None:
    dtype, reference = serial
    piped = run(job(dtype, "manual"), TrainOptions(planning=PlanOptions(ilp_time_limit=5.0)))
    assert len(piped.plan.stages) == 2
    assert piped.skipped_steps == reference.skipped_steps
    # Micro-batches sum in another order, in a 16-bit type: close, not equal.
    np.testing.assert_allclose(piped.losses[:8], reference.losses[:8], rtol=2e-2)
    assert piped.evals[-1][1] == pytest.approx(reference.evals[-1][1], rel=5e-2)
    # Each layer's parameters, the first stage's too (its gradients come back from the
    # second stage in the 16-bit type), moved as in the serial run: far less apart
    # than moved (summed over the layer: a key bias has no gradient and moves by noise).
    manifest = job(dtype, "manual")
    init = load_model(manifest.spec.model, dtype).init(jax.random.key(manifest.spec.training.seed))
    moved: dict[str, float] = {}
    apart: dict[str, float] = {}
    for name, start in zip(param_names(init), jax.tree.leaves(init), strict=True):
        group = "/".join(name.split("/")[:2])
        ref = np.asarray(reference.params[name], np.float32)
        moved[group] = moved.get(group, 0.0) + float(np.sum((ref - np.asarray(start, np.float32)) ** 2))
        apart[group] = apart.get(group, 0.0) + float(np.sum((np.asarray(piped.params[name], np.float32) - ref) ** 2))
    ratios = {group: math.sqrt(apart[group] / moved[group]) for group in moved}
    assert max(ratios.values()) < 0.5, ratios


def test_an_overflowing_float16_step_is_skipped_and_the_scale_halved() -> None:
    model = load_model(ModelSpec(zoo="gpt", config="tiny"), "float16")
    optimizer = named_optimizer("adam", 1e-3)
    params = model.init(jax.random.key(0))
    state = optimizer.init(params)
    batch = {k: jnp.ones(v.shape, v.dtype) for k, v in model.batch_shapes(4).items()}
    step = jax.jit(make_scaled_train_step(model.loss, optimizer))
    before = jax.tree.map(np.asarray, params)
    loss, finite, after, _ = step(params, state, batch, jnp.float32(1e38))  # overflows float16
    assert not bool(finite) and math.isfinite(float(loss))
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))
    _, finite, after, _ = step(params, state, batch, jnp.float32(1024.0))
    assert bool(finite) and any(not np.array_equal(o, np.asarray(n)) for o, n in
                                zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
    scale = LossScale(scale=8.0, period=2)
    scale.after(False)
    assert (scale.scale, scale.skipped) == (4.0, 1)
    scale.after(True)
    scale.after(True)
    assert scale.scale == 8.0
    assert LossScale.for_dtype("bfloat16") is None and LossScale.for_dtype("float16") is not None
