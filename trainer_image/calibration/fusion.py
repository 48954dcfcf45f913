"""How much of the non-matmul ops' traffic survives XLA's fusion, fitted from training.

The cost model prices an elementwise or reduction op by its roofline,
``max(flops / vector rate, f * bytes / bandwidth)``, where ``bytes`` is the op's
unfused traffic (its inputs and output) and ``f`` is ``fused_memory_fraction``: XLA
fuses chains of such ops into one loop, so most intermediates never reach memory. The
data sheet gives no ``f``; this step measures it.

Four zoo families (two on a GPU), each trained by the real local runtime on **one** device (one
stage, one micro-batch: no communication, so the step is the ops alone plus the
fitted host costs), at a size that suits the platform (small models in float32 on
forced CPU devices, larger ones in bfloat16 on a GPU). Their mixes differ: GPT's
attention and normalisations, MoE's routing, Wide-ResNet's batch norms, the MLP's
biases and activations. The planner's prediction of each run (the same manual plan
planned by :func:`~alpajob.planner.plan.make.make_plan`, with the constants found
so far) grows with ``f``, convexly (a sum of rooflines), so the ``f`` that minimises
the models' squared log errors is found by a golden-section search on ``log f`` in
``[FRACTION_FLOOR, 1]``. Each model's error at the fit is kept: where they spread,
one fraction does not describe the mix.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any

from alpajob.api.options import TrainOptions
from alpajob.api.resource import parse_job
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import Calibration
from alpajob.trainer_image.calibration.overheads import FRACTION_FLOOR, PLANNING, local_job_document

#: (zoo family, config, global batch) trained on forced CPU devices: about 5-200 ms
#: a step on 2 cores.
CPU_MODELS: dict[str, tuple[str, Any, int]] = {
    "gpt-256x2": ("gpt", {"hidden": 256, "layers": 2, "heads": 4, "seqLen": 128, "vocab": 512}, 16),
    "moe-tiny": ("moe", "tiny", 16),
    "wresnet-tiny": ("wresnet", "tiny", 16),
    "mlp-512x4": ("mlp", {"hidden": 512, "layers": 4, "inputDim": 512, "outputDim": 512}, 256),
}
#: The transformer families on a GPU, in bfloat16, big enough that launches do not
#: dominate (the GPU presets have no measured kernel overhead). Left out here:
#: Wide-ResNet, whose first H200 calibration (26 layers, 224-pixel images) did not
#: finish in 280 s; and the MLP, whose step on a GPU is mostly its batch crossing from
#: the host (4096 x 4096 inputs and targets: 11.3 ms measured on an H200 where its ops
#: are priced 3.5 ms), a copy the plan does not price and that has no fusion in it.
#: With it the H200 fit chose 0.507 and over-predicted GPT and MoE by 33-42%.
GPU_MODELS: dict[str, tuple[str, Any, int]] = {
    "gpt-1024x4": ("gpt", {"hidden": 1024, "layers": 4, "heads": 16, "seqLen": 1024,
                           "vocab": 51200}, 8),
    "moe-768x4": ("moe", {"hidden": 768, "layers": 4, "heads": 16, "seqLen": 1024,
                          "vocab": 32000, "experts": 8, "expertGroupSize": 2048,
                          "capacityFactor": 2.0}, 8),
}
#: Golden-section iterations on ``log f`` after the bracketing grid: the bracket (two
#: grid steps, 2 x 0.99 of ``log f``) shrinks 0.618x each, to 0.8% of its width.
ITERATIONS = 10
#: The bracketing grid's points on ``log f``.
GRID = 8

#: The plan every fusion model trains with: one stage of every layer on one device.
ONE_DEVICE = {"method": "manual", "numMicroBatches": 1, "numLayers": 1,
               "stages": [{"layers": [0, 1], "submeshShape": [1, 1]}]}


def measure_fusion(cluster: ClusterSpec, calibration: Calibration, devices: list[Any], *,
                   steps: int = 12, warmup: int = 3,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fit ``fused_memory_fraction`` (module docstring) on ``cluster`` (one node of the
    local ``devices``) with the constants found so far; ``progress`` hears each model."""
    from alpajob.planner.plan.make import make_plan, search_options
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import job_graph

    on_cpu = devices[0].platform == "cpu"
    models = CPU_MODELS if on_cpu else GPU_MODELS
    rows: list[dict[str, Any]] = []
    predictors: list[Callable[[float], float]] = []
    for label, (zoo, config, batch) in models.items():
        if progress is not None:
            progress(f"fusion, {label}")
        job = parse_job(local_job_document(
            "calibrate", zoo, config, ONE_DEVICE, batch=batch,
            gpu=cluster.preset, devices=len(devices),
            dtype="float32" if on_cpu else "bfloat16"))
        graph = job_graph(job)
        options = search_options(job.spec.parallelism, PLANNING)

        def predicted(fraction: float, graph: Any = graph, options: Any = options) -> float:
            trial = dataclasses.replace(calibration, fused_memory_fraction=fraction)
            planned = make_plan(graph, cluster, dataclasses.replace(options, calibration=trial))
            return planned.plan.predicted_step_seconds

        result = run(job, TrainOptions(steps=steps, planning=PLANNING, devices=len(devices)))
        measured = statistics.median(result.step_seconds[warmup:])
        rows.append({"model": label, "measured_ms": round(measured * 1e3, 3),
                     "stored_ms": round(predicted(calibration.fused_memory_fraction) * 1e3, 3)})
        predictors.append(predicted)

    if progress is not None:
        progress("fusion, the fit")
    cache: dict[float, list[float]] = {}

    def loss(log_f: float) -> float:
        if log_f not in cache:
            cache[log_f] = [p(math.exp(log_f)) for p in predictors]
        return sum(math.log(t / (r["measured_ms"] / 1e3)) ** 2
                   for t, r in zip(cache[log_f], rows, strict=True))

    best_log = golden_minimum(loss, math.log(FRACTION_FLOOR), 0.0)
    loss(best_log)  # cached: the predictions at the fit
    best, fitted = math.exp(best_log), cache[best_log]
    for r, seconds in zip(rows, fitted, strict=True):
        r["fitted_ms"] = round(seconds * 1e3, 3)
        r["fit_error"] = f"{(seconds * 1e3 - r['measured_ms']) / r['measured_ms']:+.0%}"
    return {"device": {},
            "calibration": {"fused_memory_fraction": float(f"{best:.3g}")},
            "measurements": {"fusion": {"stored_fraction": calibration.fused_memory_fraction,
                                        "models": rows}}}


def golden_minimum(loss: Callable[[float], float], low: float, high: float) -> float:
    """The minimiser of ``loss`` on ``[low, high]``: the best of :data:`GRID` evenly
    spaced points brackets it (so a loss with a flat stretch, where ``f`` no longer
    matters, still finds the bend), then golden-section search within the bracket."""
    grid = [low + (high - low) * i / (GRID - 1) for i in range(GRID)]
    best = min(range(GRID), key=lambda i: loss(grid[i]))
    a, b = grid[max(0, best - 1)], grid[min(GRID - 1, best + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    for _ in range(ITERATIONS):
        if loss(c) <= loss(d):
            b, d = d, c
            c = b - ratio * (b - a)
        else:
            a, c = c, d
            d = a + ratio * (b - a)
    return min((a, b, c, d, grid[best]), key=loss)
