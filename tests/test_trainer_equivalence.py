"""Parallel training equals single-device training: losses and parameters, step by step.

Each case plans a tiny zoo model for the 8 forced CPU devices (data parallel,
shard-only, or pipelines of 2 and 4 stages on even and uneven submeshes, GPipe and
1F1B), trains it three steps with ``alpajob run``'s runner, and compares with the
serial reference (the whole step on one device, the whole batch).

SGD keeps the comparison tight (rtol 1e-5): Adam divides each gradient by its own
running magnitude, which turns the rounding noise of a parameter whose true
gradient is zero (an attention key bias: softmax ignores a per-query constant) into
full-size updates, so with Adam only the losses are compared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.trainer_image.local_run import run

STEPS = 3


def _manifest(model: str, parallelism: dict[str, Any], optimizer: str = "sgd", batch: int = 16) -> Any:
    return parse_job(
        {
            "apiVersion": "alpajob.io/v1alpha1",
            "kind": "AlpaJob",
            "metadata": {"name": f"eq-{model}"},
            "spec": {
                "model": {"zoo": model, "config": "tiny"},
                "training": {"globalBatchSize": batch, "dtype": "float32", "optimizer": optimizer,
                             "learningRate": 0.05 if optimizer == "sgd" else 1e-3},
                "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                "parallelism": parallelism,
            },
        }
    )


def _train(manifest: Any, serial: bool = False, **extra: Any) -> Any:
    options = TrainOptions(steps=STEPS, serial=serial, planning=PlanOptions(ilp_time_limit=5.0), **extra)
    return run(manifest, options)


def _stages(*specs: tuple[tuple[int, int], tuple[int, int]]) -> list[dict[str, Any]]:
    return [{"layers": list(layers), "submeshShape": list(shape)} for layers, shape in specs]


CASES = {
    "mlp-data": ("mlp", {"method": "data"}),
    "gpt-shard": ("gpt", {"method": "shard"}),
    "moe-shard": ("moe", {"method": "shard"}),
    "wresnet-data": ("wresnet", {"method": "data"}),
    "gpt-1stage-m4": (  # one executable: four micro-batches under a scan, grouped
        "gpt",
        {"method": "manual", "numMicroBatches": 4, "numLayers": 2, "stages": _stages(((0, 2), (1, 8)))},
    ),
    "moe-1stage-2d-m2": (  # one executable on a 2x4 mesh, whatever the ILP shards
        "moe",
        {"method": "manual", "numMicroBatches": 2, "numLayers": 2,
         "stages": [{"layers": [0, 2], "submeshShape": [1, 8], "logicalMeshShape": [2, 4]}]},
    ),
    "gpt-2stage-1f1b-uneven": (
        "gpt",
        {"method": "manual", "numMicroBatches": 4, "schedule": "1f1b",
         "stages": _stages(((0, 1), (1, 2)), ((1, 2), (1, 4)))},
    ),
    "moe-2stage-gpipe": (
        "moe",
        {"method": "manual", "numMicroBatches": 2, "schedule": "gpipe",
         "stages": _stages(((0, 1), (1, 4)), ((1, 2), (1, 4)))},
    ),
    "wresnet-2stage-1f1b": (
        "wresnet",
        {"method": "manual", "numMicroBatches": 2, "schedule": "1f1b",
         "stages": _stages(((0, 2), (1, 4)), ((2, 4), (1, 4)))},
    ),
    "mlp-2stage-1f1b-uneven": (
        "mlp",
        {"method": "manual", "numMicroBatches": 4, "schedule": "1f1b",
         "stages": _stages(((0, 1), (1, 2)), ((1, 4), (1, 4)))},
    ),
    "mlp-4stage-gpipe": (
        "mlp",
        {"method": "manual", "numMicroBatches": 4, "schedule": "gpipe",
         "stages": _stages(((0, 1), (1, 2)), ((1, 2), (1, 2)), ((2, 3), (1, 2)), ((3, 4), (1, 2)))},
    ),
    "gpt-4stage-1f1b-uneven": (
        "gpt",
        {"method": "manual", "numMicroBatches": 4, "schedule": "1f1b", "numLayers": 4,
         "stages": _stages(((0, 1), (1, 1)), ((1, 2), (1, 2)), ((2, 3), (1, 4)), ((3, 4), (1, 1)))},
    ),
}

_serial_cache: dict[tuple[str, str], Any] = {}


def _serial(model: str, optimizer: str) -> Any:
    key = (model, optimizer)
    if key not in _serial_cache:
        _serial_cache[key] = _train(_manifest(model, {}, optimizer), serial=True)
    return _serial_cache[key]


#: Cases the default suite leaves to ``-m slow``: the longest, and variants whose kind
#: (one stage with micro-batches, an uneven 1F1B pipeline, GPipe, sharding) another
#: default case covers (the uneven 1F1B pipeline: the Adam case below).
SLOW_CASES = {"wresnet-2stage-1f1b", "wresnet-data", "gpt-1stage-m4", "gpt-2stage-1f1b-uneven",
              "moe-2stage-gpipe", "moe-shard", "gpt-4stage-1f1b-uneven", "mlp-2stage-1f1b-uneven"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in sorted(CASES)])
def test_parallel_equals_serial(case: str) -> None:
    model, parallelism = CASES[case]
    parallel = _train(_manifest(model, parallelism))
    serial = _serial(model, "sgd")
    if parallelism.get("stages"):
        assert len(parallel.plan.stages) == len(parallelism["stages"])
    np.testing.assert_allclose(parallel.losses, serial.losses, rtol=1e-5)
    assert parallel.losses[0] != parallel.losses[-1]  # it trained
    assert set(parallel.params) == set(serial.params)
    for name, value in serial.params.items():
        np.testing.assert_allclose(parallel.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_adam_pipeline_losses_equal_serial() -> None:
    """Adam's state through an uneven 1F1B pipeline (one layer on 2 devices, three on 4)
    trains as the serial run does."""
    _, parallelism = CASES["mlp-2stage-1f1b-uneven"]
    parallel = _train(_manifest("mlp", parallelism, optimizer="adam"))
    assert len(parallel.plan.stages) == 2
    serial = _serial("mlp", "adam")
    np.testing.assert_allclose(parallel.losses, serial.losses, rtol=1e-5)
