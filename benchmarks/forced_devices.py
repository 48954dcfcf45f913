"""How many forced CPU devices to make: the count itself costs speed.

XLA reads ``--xla_force_host_platform_device_count`` once per process, so each count N
runs in a fresh process. For N = 1, 2, 4, 8 it measures:

- **chain**: one device (of the N) running 200 dependent small matmuls (128x512 by
  512x512, tanh between): how fast one device is while N exist;
- **plan**: the README job planned for exactly N devices (``--all-devices``) and trained
  ``--steps`` steps without the device trial (``--keep-plan``), its predicted and
  median measured step;
- **serial**: the README job's whole step on device 0 of the N.

    python benchmarks/forced_devices.py --steps 30          # 4 min, this machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNTS = (1, 2, 4, 8)


def chain_ms() -> float:
    """Best of 5 means of 5 runs of the 200-matmul chain, on device 0."""
    import time

    import jax
    import jax.numpy as jnp

    def body(a: jax.Array, w: jax.Array) -> jax.Array:
        for _ in range(200):
            a = jnp.tanh((a @ w) * 0.001)
        return a.sum()

    f = jax.jit(body)
    x, w = jnp.ones((128, 512)), jnp.ones((512, 512))
    f(x, w).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            f(x, w).block_until_ready()
        best = min(best, (time.perf_counter() - start) / 5)
    return best * 1e3


def child(count: int, steps: int) -> dict[str, object]:
    """The three measurements with ``count`` forced devices (this process only)."""
    from alpajob import load
    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.trainer_image.local_run import run

    job = load(ROOT / "manifests" / "examples" / "text-gpt.yaml")
    planned = run(job, TrainOptions(steps=steps, devices=count, keep_plan=True,
                                    planning=PlanOptions(all_devices=True, ilp_time_limit=5.0)))
    serial = run(job, TrainOptions(steps=steps, devices=count, serial=True))
    plan = planned.plan
    assert plan is not None
    shape = " + ".join(f"{s.submesh_shape[0]}x{s.submesh_shape[1]}" for s in plan.stages)
    return {"count": count, "chain_ms": chain_ms(),
            "plan": f"{plan.devices_used()} devices: {shape}, B={plan.num_micro_batches}",
            "predicted_ms": plan.predicted_step_seconds * 1e3,
            "plan_ms": (planned.median_step_seconds() or 0.0) * 1e3,
            "serial_ms": (serial.median_step_seconds() or 0.0) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    rows = []
    for count in COUNTS:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
                   JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, __file__, "--child", str(count), "--steps", str(args.steps)],
                             env=env, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{args.steps} steps per run\n")
    print("| forced devices | chain, one device (ms) | plan | predicted ms | measured ms "
          "| measured / predicted | serial on device 0 (ms) |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['count']} | {r['chain_ms']:.1f} | {r['plan']} | {r['predicted_ms']:.1f} | "
              f"{r['plan_ms']:.1f} | {r['plan_ms'] / r['predicted_ms']:.2f} | {r['serial_ms']:.1f} |")


if __name__ == "__main__":
    main()
