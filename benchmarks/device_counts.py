"""Fewer devices than offered: on one host whose 8 forced CPU
devices share its cores, the planner may use any number of them. Is its pick right?

For each job (the README's byte-level GPT, and GPT-tiny from ``local-gpt.yaml``):

- **auto**: the planner's own plan with all 8 devices offered (it may use fewer);
- **k of 8**: the best plan on exactly k devices (``--all-devices`` on the first k of
  the 8 forced devices), k = 8, 4, 2, 1;
- **serial**: the whole step on one device, no pipeline runtime (``--method serial``).

Each trains ``--steps`` steps (the plan as planned: no device trial), interleaved
``--repeat`` times; the table gives the predicted and the median measured step and
their ratio. The planner's pick is right when no k-device plan measures faster.

    python benchmarks/device_counts.py --steps 30 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parent.parent
JOBS = {"README job": "text-gpt.yaml", "GPT-tiny": "local-gpt.yaml"}
COUNTS = (8, 4, 2, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--calibration", help="a file `alpajob calibrate` wrote")
    args = parser.parse_args()

    from alpajob import load
    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.trainer_image.local_run import run

    planning = {"ilp_time_limit": 5.0, "calibration": args.calibration}
    runs: dict[str, TrainOptions] = {
        "auto": TrainOptions(planning=PlanOptions(**planning), keep_plan=True)}
    for k in COUNTS:
        runs[f"{k} of 8"] = TrainOptions(devices=k, keep_plan=True,
                                         planning=PlanOptions(all_devices=True, **planning))
    runs["serial"] = TrainOptions(serial=True)
    samples: dict[tuple[str, str], list[float]] = {}
    predicted: dict[tuple[str, str], tuple[float, str]] = {}
    for _ in range(args.repeat):
        for job_name, manifest in JOBS.items():
            job = load(ROOT / "manifests" / "examples" / manifest)
            for run_name, options in runs.items():
                result = run(job, options.model_copy(update={"steps": args.steps}))
                samples.setdefault((job_name, run_name), []).append(
                    result.median_step_seconds() or 0.0)
                plan = result.plan
                if plan is not None:
                    used = plan.devices_used()
                    shape = " + ".join(f"{s.submesh_shape[0]}x{s.submesh_shape[1]}"
                                       for s in plan.stages)
                    predicted[(job_name, run_name)] = (
                        plan.predicted_step_seconds,
                        f"{used} devices: {shape}, B={plan.num_micro_batches}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{args.steps} steps per run, median of {args.repeat} interleaved runs\n")
    print("| job | run | plan | predicted ms | measured ms | measured / predicted |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for (job_name, run_name), values in samples.items():
        measured = statistics.median(values)
        seconds, shape = predicted.get((job_name, run_name), (None, "one device, no pipeline"))
        ratio = f"{measured / seconds:.2f}" if seconds else ""
        print(f"| {job_name} | {run_name} | {shape} | "
              f"{seconds * 1e3 if seconds else float('nan'):.1f} | {measured * 1e3:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
