"""The planner's predicted step against the measured one on the GPU
at hand, with the stored constants and with the ones ``alpajob calibrate`` fitted here.

Each model is trained by the real local runtime on one device (one stage, one
micro-batch: the plan both constants price), in bfloat16 with AdamW; the prediction is
:func:`~alpajob.planner.plan.make.make_plan`'s for that plan, once with the preset's
stored constants and once refined by ``--calibration`` (as ``alpajob plan|run
--calibration FILE`` plans). The models are not the ones the calibration's fusion
step fits on (other sizes, other depths), so this is a held-out check.

    alpajob calibrate -o cal.json        # on the GPU machine first
    JAX_DEFAULT_PRNG_IMPL=rbg python benchmarks/gpu_prediction.py --calibration cal.json

One model per process (``--model``), so a model's buffers never crowd the next.
"""

from __future__ import annotations

import argparse
import json
import statistics

#: The held-out models: GPT-350M's layers at two depths, a GPT-1.3B-wide slice and a
#: MoE-1.3B-like slice (Alpa's configurations, cut to fit one device).
MODELS = {
    "gpt-350m": ("gpt", "350m", 8),
    "gpt-1024x8": ("gpt", {"hidden": 1024, "layers": 8, "heads": 16, "seqLen": 1024,
                           "vocab": 51200}, 8),
    "gpt-2048x6": ("gpt", {"hidden": 2048, "layers": 6, "heads": 32, "seqLen": 1024,
                           "vocab": 51200}, 8),
    "moe-768x8": ("moe", {"hidden": 768, "layers": 8, "heads": 16, "seqLen": 1024,
                          "vocab": 32000, "experts": 16, "expertGroupSize": 2048,
                          "capacityFactor": 2.0}, 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--calibration", required=True, help="a file `alpajob calibrate` wrote")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--json", help="append the row to this JSON-lines file")
    args = parser.parse_args()

    import jax

    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.plan.make import make_plan, search_options
    from alpajob.trainer_image.calibration.fusion import ONE_DEVICE
    from alpajob.trainer_image.calibration.overheads import local_job_document
    from alpajob.trainer_image.calibration.run import device_preset
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import job_graph, measured_constants

    devices = jax.devices()[:1]
    preset = device_preset(devices)
    zoo, config, batch = MODELS[args.model]
    job = parse_job(local_job_document("predict", zoo, config, ONE_DEVICE, batch=batch,
                                       optimizer="adamw", gpu=preset, devices=1,
                                       dtype="bfloat16"))
    planning = PlanOptions(ilp_time_limit=10.0)
    graph = job_graph(job)
    cluster = cluster_from_preset(preset, 1, 1)
    search = search_options(job.spec.parallelism, planning)
    stored = make_plan(graph, cluster, search).plan.predicted_step_seconds
    refined_cluster, refined_search = measured_constants(args.calibration, cluster, search)
    calibrated = make_plan(graph, refined_cluster, refined_search).plan.predicted_step_seconds
    result = run(job, TrainOptions(steps=args.steps, devices=1, planning=planning))
    measured = statistics.median(result.step_seconds[args.warmup:])
    row = {"model": args.model, "device": devices[0].device_kind, "jax": jax.__version__,
           "parameters": graph.num_parameters, "batch": batch,
           "measured_ms": round(measured * 1e3, 2),
           "stored_ms": round(stored * 1e3, 2), "calibrated_ms": round(calibrated * 1e3, 2),
           "stored_over_measured": round(stored / measured, 3),
           "calibrated_over_measured": round(calibrated / measured, 3)}
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
