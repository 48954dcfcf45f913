"""Benchmark 6: training for real on CPU devices: tokens/s, MFU and the loader's share.

The README's main job (``manifests/examples/text-gpt.yaml``: a byte-level GPT on the
Python standard library's sources) and the same job on a forced 2-stage pipeline, each
with the loader's prefetch thread on (2 batches) and off, interleaved ``--repeat``
times. Per run: median step time after the first, tokens/s, MFU (model FLOPs over the
``cpu`` preset's peak: the host's measured rate) and the time ``next(batch)`` took as a
share of the run's step time (the goal: under 2% with prefetch).

    python benchmarks/training.py --steps 40 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    import yaml

    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run

    document = yaml.safe_load((ROOT / "manifests" / "examples" / "text-gpt.yaml").read_text())
    two = {"method": "manual", "numLayers": 2, "numMicroBatches": 4,
           "stages": [{"layers": [0, 1], "submeshShape": [1, 4]}, {"layers": [1, 2], "submeshShape": [1, 4]}]}
    jobs = {"README job (auto plan)": parse_job(document),
            "2-stage pipeline, 4 micro-batches": parse_job(
                {**document, "spec": {**document["spec"], "parallelism": two}})}
    samples: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for _ in range(args.repeat):
        for name, job in jobs.items():
            for prefetch in (2, 0):
                result = run(job, TrainOptions(steps=args.steps, prefetch=prefetch,
                                               planning=PlanOptions(ilp_time_limit=5.0)))
                step = result.median_step_seconds()
                share = result.data_wait_seconds / sum(result.step_seconds)
                throughput = result.throughput
                samples.setdefault((name, prefetch), []).append(
                    (step, throughput.tokens_per_second(step), throughput.mfu(step), share))
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; {args.steps} steps, "
          f"medians of {args.repeat} interleaved runs")
    print("| job | prefetch | step (ms) | tokens/s | MFU (cpu preset peak) | data wait / step time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, prefetch), rows in samples.items():
        step, tokens, mfu, share = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {name} | {prefetch or 'off'} | {step * 1e3:.1f} | {tokens:,.0f} | {mfu:.1%} | {share:.2%} |")


if __name__ == "__main__":
    main()
