"""Training for real: a tiny GPT learns Python's own library, byte by byte, under the
serial reference, the planner's automatic plan and a forced 2-stage pipeline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.api.spec import LRSchedule, Optimizer, OptimizerSpec
from alpajob.trainer_image.local_run import run
from alpajob.trainer_image.step import learning_rate_schedule, make_optimizer

ROOT = Path(__file__).resolve().parent.parent
STEPS = 60


def text_job(method: str) -> Any:
    return parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "learn"},
        "spec": {
            "model": {"zoo": "gpt", "config": "tiny"},  # hidden 64, 2 layers, seqLen 32, bytes
            # The interpreter's library: text that does not change with every commit of
            # ours (the parallel runs must follow the serial one to 1e-4 on it).
            "data": {"train": "{stdlib}/[a-m]*.py", "eval": "{stdlib}/[t-z]*.py"},
            "training": {"globalBatchSize": 16, "steps": STEPS, "evalEvery": STEPS // 2, "evalSteps": 2,
                         "optimizer": {"name": "adamw", "learningRate": 3e-3, "schedule": "cosine",
                                       "warmupSteps": 10, "clipNorm": 1.0}},
            "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
            "parallelism": {"method": method},
        }})


@pytest.fixture(scope="module")
def serial() -> Any:
    return run(text_job("auto"), TrainOptions(serial=True))


@pytest.mark.parametrize("method", [pytest.param("serial", marks=pytest.mark.slow), "auto",
                                    pytest.param("pipeshard", marks=pytest.mark.slow)])
def test_the_eval_loss_falls_well_below_chance_on_real_text(method: str, serial: Any) -> None:
    result = serial if method == "serial" else run(text_job(method), TrainOptions(
        planning=PlanOptions(ilp_time_limit=5.0)))
    chance = math.log(256)
    assert "tokens (bytes)" in result.data
    assert [step for step, _ in result.evals] == [STEPS // 2, STEPS]
    first_eval, last_eval = result.evals[0][1], result.evals[-1][1]
    assert result.losses[0] == pytest.approx(chance, abs=0.1)  # it starts knowing nothing
    assert last_eval < first_eval < chance - 1.5, result.evals  # and learns the text
    assert np.mean(result.losses[-10:]) < chance - 2.0
    if method == "pipeshard":
        assert len(result.plan.stages) >= 2
    if method != "serial":
        # The same data in the same order: the parallel run follows the serial one.
        # Its gradients are summed in another order, and AdamW divides each by its own
        # running scale, which amplifies the last-bit differences: 1.2e-4 by step 5
        # (measured), where a wrong gradient is off by far more.
        np.testing.assert_allclose(result.losses[:5], serial.losses[:5], rtol=1e-3)


def test_learning_rate_schedules() -> None:
    def lrs(schedule: LRSchedule, warmup: int, steps: int = 10) -> list[float]:
        spec = OptimizerSpec(name=Optimizer.ADAMW, learning_rate=1.0, schedule=schedule, warmup_steps=warmup)
        rate = learning_rate_schedule(spec, steps)
        return [float(rate(i)) if callable(rate) else float(rate) for i in range(steps + 1)]

    assert lrs(LRSchedule.CONSTANT, 0) == [1.0] * 11
    warm = lrs(LRSchedule.CONSTANT, 4)
    assert warm[:5] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0]) and warm[5:] == [1.0] * 6
    cosine = lrs(LRSchedule.COSINE, 2)
    assert cosine[2] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.0, abs=1e-6)
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:], strict=False))
    linear = lrs(LRSchedule.LINEAR, 0)
    assert linear[0] == 1.0 and linear[5] == pytest.approx(0.5) and linear[10] == pytest.approx(0.0)


def test_weight_decay_spares_vectors_and_clipping_bounds_the_update() -> None:
    import jax.numpy as jnp

    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    zero = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    decay = make_optimizer(OptimizerSpec(name=Optimizer.SGD, learning_rate=0.5, weight_decay=0.1), steps=1)
    updates, _ = decay.update(zero, decay.init(params), params)
    assert float(updates["w"][0, 0]) == pytest.approx(-0.05) and float(updates["b"][0]) == 0.0
    clipped = make_optimizer(OptimizerSpec(name=Optimizer.SGD, learning_rate=1.0, clip_norm=1.0), steps=1)
    big = {"w": jnp.full((2, 2), 10.0), "b": jnp.zeros(2)}
    updates, _ = clipped.update(big, clipped.init(params), params)
    assert float(jnp.sqrt(sum(jnp.sum(u**2) for u in updates.values()))) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
def test_a_resumed_run_reads_the_batches_the_interrupted_one_would_have(tmp_path: Path) -> None:
    job = text_job("data")
    fast = PlanOptions(ilp_time_limit=5.0)
    whole = run(job, TrainOptions(steps=6, planning=fast))
    first = run(job, TrainOptions(steps=3, planning=fast, checkpoint_dir=str(tmp_path)))
    resumed = run(job, TrainOptions(steps=6, planning=fast, checkpoint_dir=str(tmp_path), resume=True))
    assert resumed.start_step == 3
    np.testing.assert_array_equal(first.losses + resumed.losses, whole.losses)


@pytest.mark.slow
def test_a_job_resumed_under_another_plan_trains_on_the_batches_of_a_serial_run(tmp_path: Path) -> None:
    """6 steps on two pipeline stages of two data-parallel devices each, checkpointed,
    then resumed on one stage of four data-parallel devices for 6 more: the sample
    order depends on the step alone, so the 12 losses are a one-device run's."""
    def job(stages: list[dict]) -> Any:
        document = text_job("data").model_dump(by_alias=True, exclude_none=True)
        document["spec"]["training"].update({"dtype": "float32", "optimizer": "sgd", "learningRate": 0.05})
        document["spec"]["parallelism"] = {"method": "manual", "numMicroBatches": 2, "stages": stages}
        return parse_job(document)

    pipeline = job([{"layers": [0, 1], "submeshShape": [1, 2]}, {"layers": [1, 2], "submeshShape": [1, 2]}])
    data_parallel = job([{"layers": [0, 2], "submeshShape": [1, 4]}])
    serial = run(pipeline, TrainOptions(steps=12, serial=True))
    first = run(pipeline, TrainOptions(steps=6, checkpoint_dir=str(tmp_path)))
    assert len(first.plan.stages) == 2
    resumed = run(data_parallel, TrainOptions(steps=12, checkpoint_dir=str(tmp_path), resume=True))
    assert resumed.start_step == 6 and len(resumed.plan.stages) == 1
    np.testing.assert_allclose(first.losses + resumed.losses, serial.losses, rtol=1e-5)
