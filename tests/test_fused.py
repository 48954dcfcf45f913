"""A plan of one stage runs its whole step as one executable (runtime/fused.py)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from test_grouped import _all_reduced_elements

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.api.timeline import SpanKind
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.local_run import run
from alpajob.trainer_image.runtime.build import build_pipeline
from alpajob.trainer_image.runtime.fused import fused_step, stack_micro_batches
from alpajob.trainer_image.step import named_optimizer
from alpajob.trainer_image.zoo.model import synthetic_batch

MICRO_BATCHES = 4


@pytest.fixture(scope="module")
def one_stage() -> Any:
    """GPT-tiny planned as one data-parallel stage on 4 devices with 4 micro-batches,
    its executor, and a batch."""
    manifest = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "fused"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"},
                 "training": {"globalBatchSize": 16, "dtype": "float32", "optimizer": "sgd", "learningRate": 0.05},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                 "parallelism": {"method": "manual", "numLayers": 2, "numMicroBatches": MICRO_BATCHES,
                                 "stages": [{"layers": [0, 2], "submeshShape": [1, 4]}]}}})
    plan = run(manifest, TrainOptions(steps=1, planning=PlanOptions(ilp_time_limit=5.0))).plan
    model = load_model(manifest.spec.model, "float32")
    params = model.init(jax.random.key(0))
    executor = build_pipeline(plan, model.loss, params, model.batch_shapes, named_optimizer("sgd", 0.05),
                              jax.devices())
    batch = [np.asarray(x) for x in jax.tree.leaves(synthetic_batch(model, 16, seed=0))]
    return executor, batch


def test_the_step_is_one_scan_that_all_reduces_the_gradients_once(one_stage: Any) -> None:
    """Four micro-batches in one executable: a loop over them, and the gradient
    all-reduce after it, once (not once per micro-batch, as GSPMD would in the loop)."""
    executor, batch = one_stage
    stage = executor.stages[0]
    assert stage.groups == 4
    step = fused_step(stage, MICRO_BATCHES, scaled=False)
    leaves = stack_micro_batches(executor.split, stage, batch, MICRO_BATCHES)
    hlo = step.lower(stage.params, stage.opt_state, leaves, np.float32(0.25), np.float32(1.0)).compile().as_text()
    assert " while(" in hlo
    param_elements = sum(int(np.prod(p.shape)) for p in stage.params.values())
    reduced = _all_reduced_elements(hlo)
    assert param_elements <= reduced < 1.5 * param_elements, (reduced, param_elements)


def test_a_timed_step_is_one_span_and_a_waiting_step_keeps_its_instructions(one_stage: Any) -> None:
    executor, batch = one_stage
    result = executor.step(batch, timed=True)
    [times] = result.stages
    assert [s.kind for s in times.spans] == [SpanKind.STEP]
    assert times.compute == pytest.approx(result.seconds)
    executor.wait = True  # --exact-stage-times: the separate executables, each timed
    try:
        [exact] = executor.step(batch, timed=True).stages
    finally:
        executor.wait = False
    assert len(exact.forward) == len(exact.backward) == MICRO_BATCHES


def test_an_overflowing_scaled_step_changes_nothing(one_stage: Any) -> None:
    """float16's loss scale: a step whose gradients overflow keeps parameters and
    optimizer state (decided inside the executable), then a finite one applies."""
    executor, batch = one_stage
    stage = executor.stages[0]
    before = {k: np.asarray(v) for k, v in stage.params.items()}
    assert not executor.step(batch, timed=False, scale=float("inf")).applied
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(stage.params[name]), value, err_msg=name)
    assert executor.step(batch, timed=False, scale=8.0).applied
    assert any(not np.array_equal(np.asarray(stage.params[k]), v) for k, v in before.items())
