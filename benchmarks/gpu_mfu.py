"""Benchmark 5: single-device model FLOPs utilization of the trainer, against plain JAX.

On one accelerator, the same GPT in bfloat16, the same batches, three ways:

- ``plain``: what a JAX user writes: ``jax.jit`` of ``value_and_grad`` + ``optax.adamw``,
  parameters in bfloat16 (no master weights);
- ``trainer serial``: ``alpajob run --method serial``'s step: float32 master weights,
  bfloat16 compute, the same optimizer;
- ``trainer planned``: ``alpajob run`` on the one device: the planner's plan, run by
  the pipeline runtime (one stage).

MFU = model FLOPs per step (matrix products and convolutions, forward and backward, from
the traced step) / step time / the device's peak. The peak is measured here first: a
large bfloat16 matrix product, the best of several (``--peak`` gives one instead).

    python benchmarks/gpu_mfu.py --config 350m --batch 8 --steps 12
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax


def measured_peak(size: int = 8192, repeats: int = 10) -> float:
    """Dense bfloat16 matrix-product FLOP/s of device 0 (the best of ``repeats``)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - began)
    return 2 * size**3 / best


def plain_step_seconds(model, batches, steps: int, warmup: int) -> float:  # noqa: ANN001
    """Median step time of plain ``jax.jit`` + optax AdamW, bfloat16 parameters."""
    opt = optax.adamw(3e-4)
    params = model.init(jax.random.key(0))
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):  # noqa: ANN001, ANN202
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    times = []
    for i in range(steps):
        began = time.perf_counter()
        params, state, loss = step(params, state, batches[i % len(batches)])
        loss.block_until_ready()
        times.append(time.perf_counter() - began)
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="350m",
                        help="GPT size of the zoo (default 350m), or a JSON object of overrides")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak", type=float, help="the device's peak FLOP/s (default: measure it)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.step import graph_of
    from alpajob.trainer_image.throughput import model_flops
    from alpajob.trainer_image.zoo import resolve_model
    from alpajob.trainer_image.zoo.model import synthetic_batch

    config = json.loads(args.config) if args.config.startswith("{") else args.config
    device = jax.devices()[0]
    peak = args.peak or measured_peak()
    print(f"peak measured: {peak / 1e12:.0f} TFLOP/s", flush=True)
    plain_model = resolve_model("gpt", config, dtype="bfloat16")
    flops = model_flops(graph_of(plain_model, args.batch))
    batches = [synthetic_batch(plain_model, args.batch, seed=i) for i in range(4)]
    rows = {"plain jax.jit + optax (bf16 params)": plain_step_seconds(plain_model, batches, args.steps, args.warmup)}
    print(f"plain: {rows['plain jax.jit + optax (bf16 params)'] * 1e3:.1f} ms", flush=True)
    job = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "mfu"},
        "spec": {"model": {"zoo": "gpt", "config": config},
                 "training": {"globalBatchSize": args.batch, "steps": args.steps, "dtype": "bfloat16",
                              "optimizer": {"name": "adamw", "learningRate": 3e-4}},
                 "cluster": {"gpu": "h100-80gb", "nodes": 1, "gpusPerNode": 1}}})
    serial = run(job, TrainOptions(serial=True, devices=1))
    rows["trainer, serial (fp32 master weights)"] = statistics.median(serial.step_seconds[args.warmup:])
    print(f"serial: {rows['trainer, serial (fp32 master weights)'] * 1e3:.1f} ms", flush=True)
    planned = run(job, TrainOptions(devices=1, planning=PlanOptions(ilp_time_limit=10.0)))
    rows["trainer, planned (pipeline runtime)"] = statistics.median(planned.step_seconds[args.warmup:])
    tokens = args.batch * plain_model.config["seqLen"]
    print(f"device: {device.device_kind} ({platform.node()}), jax {jax.__version__}")
    print(f"GPT {args.config}, batch {args.batch} x {plain_model.config['seqLen']} tokens, bfloat16; "
          f"model FLOPs/step {flops:.3e}; measured peak {peak / 1e12:.0f} TFLOP/s")
    print("| run | step (ms) | tokens/s | MFU | vs plain |")
    print("| --- | --- | --- | --- | --- |")
    base = rows["plain jax.jit + optax (bf16 params)"]
    out = {}
    for name, seconds in rows.items():
        mfu = flops / seconds / peak
        out[name] = {"step_seconds": seconds, "tokens_per_second": tokens / seconds, "mfu": mfu}
        print(f"| {name} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {mfu:.1%} | {base / seconds:.2f}x |")
    print(f"planned: {len(planned.plan.stages)} stage(s), {planned.plan.num_micro_batches} micro-batch(es), "
          f"losses finite: {bool(np.isfinite(planned.losses).all())}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device.device_kind, "peak": peak, "flops": flops, "rows": out}, handle, indent=1)


if __name__ == "__main__":
    main()
