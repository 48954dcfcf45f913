"""Host costs of the real local runtime, fitted from training runs.

- **pipeline instructions and kernels** (:func:`measure_instructions`): two models
  with almost no arithmetic, MLP-tiny (4 layers of width 32) and a small GPT (hidden
  48, 4 layers, sequence 16), trained by the local runtime under 1 stage of 8 devices
  with 1 and 4 micro-batches, 1 stage of 2 devices, 2 stages of 4 devices (B=4) and
  4 stages of 2 (B=8). Their step time is almost all fixed host cost: per pipeline
  instruction (launching a stage's executable, moving its inputs, the hand-off
  between stage threads) and per kernel that each device runs (elementwise ops fuse
  into kernels and cost nothing extra). The planner's prediction is linear in both
  constants, so each plan is planned three times (both at 0, then each alone) for its
  value and two slopes, and a least-squares fit (relative errors) of the measured
  times gives ``instruction_overhead_seconds`` c and ``kernel_overhead_seconds`` d.
- **the optimizer update** (:func:`measure_update`): a wide MLP (4 layers of 1024,
  4.2 M parameters, Adam) trained data parallel, every device updating every
  parameter. The runtime times the update executable;
  ``update_fused_memory_fraction`` is the fraction of the update ops' unfused traffic
  at which the cost model predicts that time (bisection): XLA fuses each parameter's
  whole Adam chain into one loop.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import Calibration

#: How the calibration runs plan: the manifest's own options, a 5 s ILP time limit.
PLANNING = PlanOptions(ilp_time_limit=5.0)

#: The models the instruction fit trains: MLP-tiny (almost no arithmetic, few kernels
#: per layer) and a small GPT (many kernels per layer, none of them big).
INSTRUCTION_MODELS: dict[str, tuple[str, Any]] = {
    "mlp-tiny": ("mlp", "tiny"),
    "gpt-48x4": ("gpt", {"hidden": 48, "layers": 4, "heads": 3, "seqLen": 16, "vocab": 128}),
}

#: The smallest ``update_fused_memory_fraction`` the fit returns.
FRACTION_FLOOR = 1e-3


def local_job_document(name: str, zoo: str, config: Any, parallelism: dict[str, Any], *,
                       batch: int = 32, optimizer: str | None = None, nodes: int = 1,
                       gpu: str = "cpu", devices: int = 8,
                       dtype: str = "float32") -> dict[str, Any]:
    """An AlpaJob document: ``zoo`` model ``config`` in ``dtype`` on ``nodes`` nodes
    that share this machine's ``devices`` of preset ``gpu`` (8 forced CPU devices by
    default; the runtime benchmarks build theirs with it too)."""
    training: dict[str, Any] = {"globalBatchSize": batch, "dtype": dtype}
    if optimizer is not None:
        training["optimizer"] = optimizer
    return {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": name},
            "spec": {"model": {"zoo": zoo, "config": config}, "training": training,
                     "cluster": {"gpu": gpu, "nodes": nodes, "gpusPerNode": devices // nodes},
                     "parallelism": parallelism}}


def _instruction_plans() -> dict[str, dict[str, Any]]:
    """The manual plans each model trains with (module docstring)."""

    def stages(count: int, micro: int, layers: int = 4) -> dict[str, Any]:
        return {"method": "manual", "numMicroBatches": micro, "numLayers": layers,
                "stages": [{"layers": [i * layers // count, (i + 1) * layers // count],
                            "submeshShape": [1, 8 // count]} for i in range(count)]}

    def one_stage(devices: int, micro: int) -> dict[str, Any]:
        return {"method": "manual", "numMicroBatches": micro, "numLayers": 1,
                "stages": [{"layers": [0, 1], "submeshShape": [1, devices]}]}

    return {"1x8, B=1": one_stage(8, 1), "1x8, B=4": one_stage(8, 4),
            "1x2, B=1": one_stage(2, 1), "2x4, B=4": stages(2, 4), "4x2, B=8": stages(4, 8)}


def measure_instructions(cluster: ClusterSpec, calibration: Calibration, *,
                         steps: int = 8, warmup: int = 3) -> dict[str, Any]:
    """Fit c and d on ``cluster`` (one node of 8 local devices) with the constants
    found so far; the plans' figures too."""
    import numpy as np

    from alpajob.planner.plan.make import make_plan, search_options
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import job_graph

    rows: list[dict[str, Any]] = []
    for label, (zoo, config) in INSTRUCTION_MODELS.items():
        graph = None
        for name, parallelism in _instruction_plans().items():
            job = parse_job(local_job_document("calibrate", zoo, config, parallelism))
            if graph is None:
                graph = job_graph(job)
            options = search_options(job.spec.parallelism, PLANNING)
            # The prediction is linear in c and d: its value at 0 and its two slopes.
            trials = [dataclasses.replace(calibration, instruction_overhead_seconds=c,
                                          kernel_overhead_seconds=d)
                      for c, d in ((0.0, 0.0), (1e-3, 0.0), (0.0, 1e-6))]
            base, with_c, with_d = (
                make_plan(graph, cluster, dataclasses.replace(options, calibration=trial))
                .plan.predicted_step_seconds for trial in trials)
            result = run(job, TrainOptions(steps=steps, planning=PLANNING))
            rows.append({"model": label, "plan": name,
                         "instructions": round((with_c - base) / 1e-3, 2),
                         "kernel_runs": round((with_d - base) / 1e-6),
                         "base_ms": round(base * 1e3, 2),
                         "measured_ms": round(
                             statistics.median(result.step_seconds[warmup:]) * 1e3, 2)})
    design = np.array([[r["instructions"], r["kernel_runs"]] for r in rows], dtype=float)
    excess = np.array([r["measured_ms"] - r["base_ms"] for r in rows]) / 1e3
    weights = 1.0 / np.array([r["measured_ms"] for r in rows])  # relative errors
    c, d = np.linalg.lstsq(design * weights[:, None], excess * weights, rcond=None)[0]
    c, d = max(0.0, float(c)), max(0.0, float(d))
    for r in rows:
        model_ms = r["base_ms"] + 1e3 * (c * r["instructions"] + d * r["kernel_runs"])
        r["fit_error"] = f"{(model_ms - r['measured_ms']) / r['measured_ms']:+.0%}"
    return {"device": {},
            "calibration": {"instruction_overhead_seconds": float(f"{c:.3g}"),
                            "kernel_overhead_seconds": float(f"{d:.3g}")},
            "measurements": {"instruction_plans": rows}}


def measure_update(cluster: ClusterSpec, calibration: Calibration, *,
                   steps: int = 8, warmup: int = 3) -> dict[str, Any]:
    """Fit ``update_fused_memory_fraction`` (module docstring) with the constants
    found so far; ``cluster``'s device is one of the 8 that update at once."""
    from alpajob.planner.graph.opgraph import Phase
    from alpajob.planner.intra_op.strategies import op_base_seconds
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import job_graph

    wide = {"hidden": 1024, "layers": 4, "inputDim": 1024, "outputDim": 1024}
    job = parse_job(local_job_document("calibrate", "mlp", wide, {"method": "data"},
                                     optimizer="adam"))
    result = run(job, TrainOptions(steps=steps, planning=PLANNING, exact_stage_times=True,
                                   stage_times_every=1))
    measured = statistics.median(t[0].update for t in result.stage_times[warmup:])
    graph = job_graph(job)
    update_ops = [op for op in graph.ops if op.phase is Phase.UPDATE]

    def predicted(fraction: float) -> float:
        cal = dataclasses.replace(calibration, update_fused_memory_fraction=fraction)
        return sum(op_base_seconds(op, graph, cluster.device, cal) * op.multiplier
                   for op in update_ops)

    # predicted() grows with the fraction. At the lower bound the update's arithmetic
    # alone explains the measured time: it runs in place (its buffers are donated), at
    # streaming rates that make its traffic negligible.
    low, high = FRACTION_FLOOR, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < measured else (low, mid)
    return {"device": {},
            "calibration": {"update_fused_memory_fraction": float(f"{high:.3g}")},
            "measurements": {"update": {
                "parameters": graph.num_parameters, "measured_ms": round(measured * 1e3, 2),
                "predicted_ms": round(predicted(high) * 1e3, 2),
                "at_floor": predicted(FRACTION_FLOOR) >= measured}}}
