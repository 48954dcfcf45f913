"""Pipelines with fused executables against the same plan with every executable apart.

A pipeline stage runs as few executables as its messages allow: the last stage's
forward and backward of a micro-batch as one (``forward_backward``), and a stage's
last backward with its update (``backward_update``: every stage whose shared
parameters only later stages read). This script builds each plan twice from the same
parameters, once as ``alpajob run`` runs it and once with ``fuse=False`` (every
forward, backward and update an executable of its own, as before the fusions), and
runs their steps alternately, untimed as ``alpajob run``'s steps are. Both train the
same numbers (the losses of every pair are compared).

    python benchmarks/pipeline_fusion.py [--steps 12] [--warmup 3] [--repeat 2] [--batch 32]
        [--cases "2 stages, 1F1B"]

Per case: the median step of each and the median of the pairs' ratio (separate /
fused: above 1, fusing is faster) with its quartiles; the number of executables a
step launches either way. On 8 forced CPU devices sharing this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

#: GPT big enough that a step is compute rather than dispatch on two cores; its
#: embedding is tied to its output layer, so the first stage owns a parameter the
#: last stage reads too.
CONFIG = {"hidden": 256, "layers": 4, "heads": 8, "seqLen": 128, "vocab": 2048}


def _stages(count: int, micro: int, schedule: str) -> dict:
    return {"method": "manual", "numMicroBatches": micro, "numLayers": 4, "schedule": schedule,
            "stages": [{"layers": [i * 4 // count, (i + 1) * 4 // count], "submeshShape": [1, 8 // count]}
                       for i in range(count)]}


#: name -> spec.parallelism
CASES = {
    "2 stages, 1F1B, 4 micro-batches": _stages(2, 4, "1f1b"),
    "2 stages, GPipe, 4 micro-batches": _stages(2, 4, "gpipe"),
    "4 stages, 1F1B, 8 micro-batches": _stages(4, 8, "1f1b"),
}


def executables(num_stages: int, micro: int, fused: bool) -> int:
    """Executables one step launches: a forward and a backward per stage and micro-
    batch and an update per stage, less one per micro-batch on the last stage (its
    forward and backward are one) and one per stage (its last backward runs its
    update) when fused; this GPT's stages all fuse their updates."""
    total = num_stages * (2 * micro + 1)
    return total - micro - num_stages if fused else total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12, help="step pairs per case per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]

    import jax
    import numpy as np
    from local_jobs import FAST_PLANNING, job_document, paired_cells

    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.entrypoint import load_model
    from alpajob.trainer_image.planning import plan_job
    from alpajob.trainer_image.runtime.build import build_pipeline
    from alpajob.trainer_image.runtime.messages import fuses_update
    from alpajob.trainer_image.step import named_optimizer
    from alpajob.trainer_image.zoo.model import synthetic_batch

    print(f"8 forced CPU devices on {os.cpu_count()} cores; GPT {CONFIG}; global batch {args.batch}; "
          f"Adam, float32; {args.repeat} rounds of {args.steps} step pairs (separate, fused) after "
          f"{args.warmup} warm-up steps each")
    print("| plan | executables per step: separate, fused | separate ms | fused ms | ratio (quartiles) |")
    print("| --- | --- | --- | --- | --- |")
    runs = {}
    for case, parallelism in CASES.items():
        if wanted and case not in wanted:
            continue
        job = parse_job(job_document("fusion", "gpt", CONFIG, parallelism, batch=args.batch))
        model = load_model(job.spec.model, "float32")
        plan = plan_job(job, FAST_PLANNING).plan
        built = [build_pipeline(plan, model.loss, model.init(jax.random.key(0)), model.batch_shapes,
                                named_optimizer("adam", 1e-3), jax.devices(), fuse=fuse) for fuse in (False, True)]
        split = built[1].split
        assert all(fuses_update(split, s) for s in range(len(split.stages)))
        runs[case] = (built, len(plan.stages), plan.num_micro_batches)
    batches = [[np.asarray(x) for x in jax.tree.leaves(synthetic_batch(model, args.batch, seed=s))]
               for s in range(4)]
    samples: dict[str, list[tuple[float, float]]] = {case: [] for case in runs}
    for round_ in range(args.repeat):
        for case, (built, _, _) in runs.items():
            if round_ == 0:
                for i in range(args.warmup):
                    for executor in built:
                        executor.step(batches[i % len(batches)], timed=False)
            for i in range(args.steps):
                times, losses = [], []
                for executor in built:
                    start = time.perf_counter()
                    result = executor.step(batches[i % len(batches)], timed=False)
                    times.append(time.perf_counter() - start)
                    losses.append(result.loss)
                assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), (case, losses)
                samples[case].append((times[0], times[1]))
    for case, (_, stages, micro) in runs.items():
        print(f"| {case} | {executables(stages, micro, False)}, {executables(stages, micro, True)} | "
              f"{paired_cells(samples[case])} |", flush=True)


if __name__ == "__main__":
    main()
