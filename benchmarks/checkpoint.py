"""Benchmark 7: what a checkpoint costs the training loop, saved async against sync.

One GPT (``--config``, default 8 layers of hidden 512: 26M parameters, so with AdamW's
two moments 0.3 GB a checkpoint) trains ``--steps`` steps serially on one CPU device
with a checkpoint every ``--every`` steps, three ways, interleaved ``--repeat`` times:
no checkpoints, orbax saves waited for (sync), and orbax saves written in the
background (async). Per run: the median step time, the time the loop was blocked by
checkpointing (the goodput books' ``checkpoint`` bucket: fingerprints, the copy to host
memory, and for sync the write), per save; and the whole run's wall time. Then the
restore of the newest checkpoint (``--resume``), fingerprints checked.

    python benchmarks/checkpoint.py --steps 12 --every 4 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default='{"hidden": 512, "layers": 8, "heads": 8, "seqLen": 128, "vocab": 256}')
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="compute dtype (master weights stay float32)")
    args = parser.parse_args()

    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run

    job = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "ckpt-bench"},
        "spec": {"model": {"zoo": "gpt", "config": json.loads(args.config)},
                 "training": {"globalBatchSize": args.batch, "dtype": args.dtype, "optimizer": "adamw"},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 1}}})
    saves = args.steps // args.every
    modes = {"none": {}, "sync": {"sync_checkpoints": True}, "async": {}}
    samples: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in modes}
    restores: list[float] = []
    size = 0
    for _ in range(args.repeat):
        for mode, extra in modes.items():
            folder = Path(tempfile.mkdtemp(prefix="alpajob-ckpt-bench-"))
            options = TrainOptions(steps=args.steps, serial=True, **extra, **(
                {} if mode == "none" else {"checkpoint_dir": str(folder), "checkpoint_every": args.every}))
            began = time.perf_counter()
            result = run(job, options)
            wall = time.perf_counter() - began
            blocked = result.goodput["checkpoint_seconds"]
            samples[mode].append((result.median_step_seconds() or 0.0, blocked / saves if saves else 0.0, wall))
            if mode == "async":
                size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                resumed = run(job, TrainOptions(steps=args.steps + 1, serial=True, checkpoint_dir=str(folder),
                                                resume=True))
                restores.append(resumed.goodput["restore_seconds"])
            shutil.rmtree(folder, ignore_errors=True)
    import jax

    print(f"machine: {platform.node()}, {os.cpu_count()} cores, {jax.devices()[0].device_kind}; "
          f"GPT {args.config} ({args.dtype}), batch {args.batch}, "
          f"{args.steps} steps, a checkpoint every {args.every} ({saves} saves, keepLast 3: "
          f"{size / 2**30:.2f} GiB on disk); medians of {args.repeat} interleaved runs")
    print("| checkpoints | step (s) | loop blocked per save (s) | run wall time (s) | vs none |")
    print("| --- | --- | --- | --- | --- |")
    base = statistics.median(row[2] for row in samples["none"])
    for mode, rows in samples.items():
        step, blocked, wall = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {mode} | {step:.3f} | {blocked:.3f} | {wall:.1f} | {wall / base:.2f}x |")
    print(f"restore of the newest checkpoint (fingerprints checked): {statistics.median(restores):.2f} s")


if __name__ == "__main__":
    main()
