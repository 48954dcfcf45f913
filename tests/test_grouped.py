"""Grouped data-parallel stages: per-device gradient sums, exact against the plain stage."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.local_run import run
from alpajob.trainer_image.runtime.build import build_pipeline
from alpajob.trainer_image.runtime.executor import split_micro_batches
from alpajob.trainer_image.runtime.grouped import (
    NotGroupable,
    batch_dims,
    group_batch,
    grouped_stage_function,
    ungroup_batch,
)
from alpajob.trainer_image.runtime.meshes import place
from alpajob.trainer_image.runtime.split import split_loss, stage_function
from alpajob.trainer_image.step import named_optimizer
from alpajob.trainer_image.zoo.model import synthetic_batch
from alpajob.trainer_image.zoo.registry import resolve_model

GROUPS = 4
MICRO = 8


def _all_reduced_elements(hlo: str) -> int:
    """Elements all-reduced by a compiled module (every all-reduce's result types)."""
    total = 0
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        result_type = line.split("=", 1)[1].split("all-reduce", 1)[0]
        for dims in re.findall(r"\[([\d,]*)\]", result_type):
            total += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _setup(zoo: str):
    model = resolve_model(zoo, "tiny")
    params = model.init(jax.random.key(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    leaves = jax.tree.leaves(params)
    split = split_loss(model.loss, abstract, model.batch_shapes(MICRO), [0] * len(leaves), 1)
    dims = batch_dims(model.loss, abstract, model.batch_shapes, MICRO)
    mesh = Mesh(np.array(jax.devices()[:GROUPS]), ("d",))
    return model, leaves, split, dims, mesh


def test_group_batch_round_trips_and_gives_each_group_its_rows() -> None:
    x = jnp.arange(2 * 8 * 3).reshape(2, 8, 3)
    g = group_batch(x, 1, 4)
    assert g.shape == (4, 2, 2, 3)
    np.testing.assert_array_equal(g[1], x[:, 2:4])
    np.testing.assert_array_equal(ungroup_batch(g, 1), x)
    with pytest.raises(NotGroupable, match="does not divide"):
        group_batch(x, 1, 3)


@pytest.mark.parametrize("zoo", ["gpt", "mlp", "moe"])
def test_grouped_stage_matches_the_plain_stage_and_all_reduces_no_gradient(zoo: str) -> None:
    model, leaves, split, dims, mesh = _setup(zoo)
    stage = split.stages[0]
    group = NamedSharding(mesh, P("d"))
    replicated = NamedSharding(mesh, P())
    plain = stage_function(split, stage)
    grouped = grouped_stage_function(split, stage, dims, GROUPS, group)
    batch_tree = synthetic_batch(model, MICRO, seed=1)
    batch_leaves = jax.tree.leaves(batch_tree)
    batch = [jax.device_put(np.asarray(batch_leaves[k]), group) for k in stage.batch]
    params = [jax.device_put(leaves[k], replicated) for k in stage.params]
    copies = [jax.device_put(np.broadcast_to(np.asarray(leaves[k]), (GROUPS, *leaves[k].shape)), group)
              for k in stage.params]

    def gradients(f):
        def step(p, b):
            loss, vjp = jax.vjp(lambda p: f(p, b, [])[1], p)
            return loss, vjp(jnp.ones((), loss.dtype))[0]
        return jax.jit(step)

    plain_step, grouped_step = gradients(plain), gradients(grouped)
    loss, grads = plain_step(params, batch)
    grouped_loss, grouped_grads = grouped_step(copies, batch)
    np.testing.assert_allclose(float(grouped_loss), float(loss), rtol=1e-6)
    for k, g, gg in zip(stage.params, grads, grouped_grads, strict=True):
        assert gg.shape == (GROUPS, *g.shape)
        np.testing.assert_allclose(np.asarray(gg).sum(0), np.asarray(g), rtol=1e-4, atol=1e-6, err_msg=str(k))

    param_elements = sum(int(np.prod(leaves[k].shape)) for k in stage.params)
    plain_reduced = _all_reduced_elements(plain_step.lower(params, batch).compile().as_text())
    grouped_reduced = _all_reduced_elements(grouped_step.lower(copies, batch).compile().as_text())
    assert plain_reduced >= param_elements  # the plain stage all-reduces every gradient
    assert grouped_reduced < param_elements / 10  # what is left is batch-coupled (the loss's mean)


def test_a_convolution_reading_a_parameter_is_not_grouped() -> None:
    model, leaves, split, dims, mesh = _setup("wresnet")
    stage = split.stages[0]
    group = NamedSharding(mesh, P("d"))
    grouped = grouped_stage_function(split, stage, dims, GROUPS, group)
    copies = [jax.ShapeDtypeStruct((GROUPS, *leaves[k].shape), leaves[k].dtype) for k in stage.params]
    batch = [jax.ShapeDtypeStruct(split.avals[split.batch_ids[k]].shape, split.avals[split.batch_ids[k]].dtype)
             for k in stage.batch]
    with pytest.raises(NotGroupable, match="conv_general_dilated"):
        jax.eval_shape(lambda p, b: grouped(p, b, []), copies, batch)



@pytest.mark.slow
def test_a_grouped_pipeline_trains_like_one_device_and_reduces_gradients_once_per_step() -> None:
    """A 2-stage GPT plan with 4 micro-batches: both stages are grouped (their
    parameters are replicated; the tied embedding is shared between them), training
    equals the serial run, and a backward all-reduces no parameter gradient."""
    stages = [{"layers": [0, 1], "submeshShape": [1, 4]}, {"layers": [1, 2], "submeshShape": [1, 4]}]
    manifest = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "grouped"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"},
                 "training": {"globalBatchSize": 16, "dtype": "float32", "optimizer": "sgd", "learningRate": 0.05},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                 "parallelism": {"method": "manual", "numLayers": 2, "numMicroBatches": 4, "stages": stages}}})
    parallel = run(manifest, TrainOptions(steps=3, planning=PlanOptions(ilp_time_limit=5.0)))
    serial = run(manifest, TrainOptions(steps=3, serial=True))
    np.testing.assert_allclose(parallel.losses, serial.losses, rtol=1e-5)
    for name, value in serial.params.items():
        np.testing.assert_allclose(parallel.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)

    model = load_model(manifest.spec.model, "float32")
    params = model.init(jax.random.key(0))
    executor = build_pipeline(parallel.plan, model.loss, params, model.batch_shapes, named_optimizer("sgd", 0.05),
                              jax.devices())
    assert [s.groups for s in executor.stages] == [4, 4]
    assert executor.split.shared_params(), "the tied embedding is read by both stages"
    first = executor.stages[0]
    program = executor.split.stages[0]
    batch = jax.tree.leaves(synthetic_batch(model, 16, seed=0))
    micro = split_micro_batches(batch, 4)[0]
    leaves = [place(micro[k], sh) for k, sh in zip(program.batch, first.batch_sharding, strict=True)]
    copies = first.prepare([first.params[first.leaf_names[k]] for k in program.params])
    outs, _, vjp = first.forward(copies, leaves, [])
    cotangents = [jnp.ones(o.shape, o.dtype) for o in outs]
    hlo = first.backward.lower(copies, vjp, cotangents, None).compile().as_text()
    param_elements = sum(int(np.prod(c.shape[1:])) for c in copies)
    assert _all_reduced_elements(hlo) < param_elements / 10
