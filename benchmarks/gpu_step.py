"""One GPU: AlpaJob's step against plain JAX, GPT 350M and up, each run in a fresh process.

For every GPT configuration, in bfloat16 compute with float32 master weights and
AdamW (float32 moments), the same batches, five runs, each in a process of its own
(so no run inherits another's buffers, and a run that does not fit says so alone):

- ``peak``: the device's dense bfloat16 peak, the best of ten 8192^3 matrix products
  (MFU divides by it);
- ``plain``: what a JAX user writes, MaxText's way: ``jax.jit`` of
  ``value_and_grad`` + ``optax.adamw``, float32 parameters cast to bfloat16 where the
  model reads them, parameters and optimizer state donated;
- ``serial``: AlpaJob's serial trainer (``alpajob run --method serial``'s step);
- ``one stage``: AlpaJob's plan of one stage for the one GPU, run as ``alpajob run``
  runs it (the one-executable step);
- ``two stages``: a two-stage 1F1B pipeline (4 micro-batches) with both stages on
  the same GPU: what the pipeline runtime costs where no transfer does.

Per run: step time (median after the warm-up), tokens/s, MFU (model FLOPs per step,
matrix products forward and backward from the traced step, over the measured peak)
and the device's peak memory in use (``memory_stats``). Parameters are initialised
with the ``rbg`` PRNG (threefry's init of GPT-350M compiles for minutes on a GPU).

    python benchmarks/gpu_step.py [--configs 350m,1.3b] [--batch 8] [--steps 10] [--warmup 3]
        [--runs plain,serial,one-stage,two-stages] [--json out.json]
    python benchmarks/gpu_step.py --cpu-smoke     # the same, tiny, on CPU (a test runs it)

On one H100 the defaults take about 6 minutes (compiles included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

RUNS = ("plain", "serial", "one-stage", "two-stages")
TIMEOUT_S = 240  # a run that takes longer is reported as such


def _job(config: Any, batch: int, parallelism: dict[str, Any], devices: int, gpu: str) -> Any:
    from alpajob.api.resource import parse_job

    return parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "gpu-step"},
        "spec": {"model": {"zoo": "gpt", "config": config},
                 "training": {"globalBatchSize": batch, "dtype": "bfloat16",
                              "optimizer": {"name": "adamw", "learningRate": 3e-4}},
                 "cluster": {"gpu": gpu, "nodes": 1, "gpusPerNode": devices},
                 "parallelism": parallelism}})


def _timed(step: Any, batches: list[Any], steps: int, warmup: int) -> float:
    times = []
    for i in range(steps):
        began = time.perf_counter()
        step(batches[i % len(batches)])
        times.append(time.perf_counter() - began)
    return statistics.median(times[warmup:])


def measure(run: str, config: Any, batch: int, steps: int, warmup: int, gpu: str) -> dict[str, Any]:
    """One run in this process: its step seconds, model FLOPs and peak memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    if run == "peak":
        size = 8192 if device.platform == "gpu" else 512
        a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        mm = jax.jit(lambda x, y: x @ y)
        mm(a, a).block_until_ready()
        best = float("inf")
        for _ in range(10):
            began = time.perf_counter()
            mm(a, a).block_until_ready()
            best = min(best, time.perf_counter() - began)
        return {"peak": 2 * size**3 / best, "device": device.device_kind, "jax": jax.__version__}

    from alpajob.api.options import PlanOptions
    from alpajob.trainer_image.entrypoint import load_model
    from alpajob.trainer_image.planning import plan_job
    from alpajob.trainer_image.runners import PipelineRunner, SerialRunner
    from alpajob.trainer_image.runtime.build import build_pipeline
    from alpajob.trainer_image.step import (
        graph_of,
        init_optimizer_state,
        make_train_step,
        training_optimizer,
    )
    from alpajob.trainer_image.throughput import model_flops
    from alpajob.trainer_image.zoo.model import synthetic_batch

    job = _job(config, batch, {}, 1, gpu)
    model = load_model(job.spec.model, "bfloat16")  # float32 master weights, bfloat16 compute
    optimizer = training_optimizer(job.spec.training, steps)
    params = jax.jit(model.init)(jax.random.key(0, impl="rbg"))
    host_batches = [synthetic_batch(model, batch, seed=s) for s in range(2)]
    leaves = [[np.asarray(x) for x in jax.tree.leaves(b)] for b in host_batches]
    if run == "plain":
        train = make_train_step(model.loss, optimizer)
        opt_state = jax.jit(lambda p: init_optimizer_state(optimizer, p))(params)
        state = jax.device_put({"p": params, "o": opt_state}, device)  # committed: one compile

        def plain_step(p: Any, o: Any, b: Any) -> tuple[Any, Any, Any]:
            loss, _, p, o = train(p, o, b)
            return loss, p, o

        plain = jax.jit(plain_step, donate_argnums=(0, 1))

        def step(b: Any) -> None:
            loss, state["p"], state["o"] = plain(state["p"], state["o"], jax.device_put(b, device))
            float(loss)

        seconds = _timed(step, host_batches, steps, warmup)
    elif run == "serial":
        serial = SerialRunner(model, optimizer, params, device, batch, None)
        del params
        seconds = _timed(lambda b: serial.step(b, False), leaves, steps, warmup)
    else:
        stages = run == "two-stages"
        parallelism: dict[str, Any] = ({"method": "manual", "numLayers": 2, "numMicroBatches": 4,
                                        "stages": [{"layers": [0, 1], "submeshShape": [1, 1]},
                                                   {"layers": [1, 2], "submeshShape": [1, 1]}]}
                                       if stages else {"method": "shard"})
        planned = _job(config, batch, parallelism, 2 if stages else 1, gpu)
        plan = plan_job(planned, PlanOptions(ilp_time_limit=10.0)).plan
        executor = build_pipeline(plan, model.loss, params, model.batch_shapes, optimizer,
                                  [device, device] if stages else [device])
        del params
        runner = PipelineRunner(executor, None)
        seconds = _timed(lambda b: runner.step(b, False), leaves, steps, warmup)
    stats = device.memory_stats() or {}
    return {"seconds": seconds, "flops": model_flops(graph_of(model, batch)),
            "tokens": batch * model.config["seqLen"], "peak_bytes": stats.get("peak_bytes_in_use")}


def _in_fresh_process(run: str, config: Any, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--measure", run, "--config-json", json.dumps(config),
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--gpu", args.gpu]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"over {TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": "out of memory" if "RESOURCE_EXHAUSTED" in done.stderr else last[:160]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="350m,1.3b", help="GPT sizes of the zoo, comma-separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--gpu", default="h100-80gb", help="the cluster preset the plans are made for")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny GPT on the CPU, every run: checks the script, measures nothing")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a worker: one run, one JSON line
        print(json.dumps(measure(args.measure, json.loads(args.config_json), args.batch, args.steps,
                                 args.warmup, args.gpu)))
        return
    env = dict(os.environ)
    configs: list[Any] = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        configs = [{"hidden": 64, "layers": 2, "heads": 4, "seqLen": 32, "vocab": 256}]
        args.batch, args.steps, args.warmup, args.gpu = 4, 3, 1, "cpu"
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    peak = _in_fresh_process("peak", None, args, env)
    if "error" in peak:
        sys.exit(f"the peak matrix product failed: {peak['error']}")
    print(f"device {peak['device']}, jax {peak['jax']}; measured bf16 peak {peak['peak'] / 1e12:.1f} TFLOP/s; "
          f"batch {args.batch}; {args.steps} steps, median after {args.warmup}", flush=True)
    print("| GPT | run | step ms | tokens/s | MFU | peak memory GiB | vs plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    table: list[dict[str, Any]] = []
    for config in configs:
        plain_s = None
        for run in runs:
            result = _in_fresh_process(run, config, args, env)
            name = config if isinstance(config, str) else "tiny"
            table.append({"config": config, "run": run, **result})
            if "error" in result:
                print(f"| {name} | {run} | {result['error']} | | | | |", flush=True)
                continue
            seconds = result["seconds"]
            plain_s = seconds if run == "plain" else plain_s
            memory = f"{result['peak_bytes'] / 2**30:.1f}" if result.get("peak_bytes") else "-"
            versus = f"{plain_s / seconds:.2f}x" if plain_s else "-"
            print(f"| {name} | {run} | {seconds * 1e3:.1f} | {result['tokens'] / seconds:,.0f} | "
                  f"{result['flops'] / seconds / peak['peak']:.1%} | {memory} | {versus} |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"peak": peak, "rows": table}, handle, indent=1)


if __name__ == "__main__":
    main()
