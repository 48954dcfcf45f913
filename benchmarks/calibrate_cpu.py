"""Calibrate the planner's ``cpu`` preset from micro-benchmarks on this machine.

The ``cpu`` preset describes XLA's forced host devices: K devices that share one
host's cores and memory. So the preset stores the *host's* rates and is marked
``shared_host``; :func:`alpajob.planner.cost.cluster.cluster_from_preset` gives each of a
node's devices its 1/K share (every device of a plan is busy at once in steady
state, so that share is what each gets).

What is measured, with all K local devices busy at once (one ``shard_map`` over all
of them, every device running the same kernel on its own data):

- **matmul**: float32 and bfloat16 ``dot`` at the shapes a transformer layer uses;
  the best aggregate rate is the host's peak FLOP/s, the median over shapes divided
  by it is ``matmul_efficiency``;
- **vector arithmetic**: an Adam-like update chain (multiply, add, square root,
  divide: most of a step's non-matmul ops are the optimizer's) on cache-sized
  arrays: its FLOP rate over the peak is ``vector_flops_fraction``;
- **memory**: a streaming elementwise op on arrays far larger than cache: bytes read
  and written per second is ``memory_bandwidth`` (``memory_efficiency`` 1);
- **collectives**: all-reduce and all-gather over 2, 4 and K devices at 64 KiB to
  4 MiB; a least-squares fit of the cost model's alpha-beta forms
  (all-reduce ``alpha + 2 beta (n-1)/n B``, all-gather ``alpha + beta (n-1)/n B``)
  gives ``intra_node_latency`` (alpha) and ``intra_node_bandwidth`` (1/beta), with
  ``comm_bandwidth_efficiency`` 1 and no extra collective overhead;
- **pipeline instructions and kernels** (``--instructions``, measured on its own):
  two models with almost no arithmetic, MLP-tiny (4 layers of width 32) and a small
  GPT (hidden 48, 4 layers, sequence 16), trained by the real local runtime under
  1 stage of 8 devices with 1 and 4 micro-batches, 1 stage of 2 devices, 2 stages of
  4 devices (B=4) and 4 stages of 2 (B=8). Their step time is almost all fixed host
  cost: per pipeline instruction (launching a stage's executable, moving its
  inputs, the hand-off between stage threads) and per kernel that each device runs
  (XLA's CPU runtime dispatching it; elementwise ops fuse into kernels and cost
  nothing extra). The planner's prediction is linear in both constants, so each
  plan is planned three times (both at 0, then each alone) for its value and two
  slopes, and a least-squares fit (relative errors) of the measured times gives
  ``instruction_overhead_seconds`` c and ``kernel_overhead_seconds`` d.

- **matmul operands** (``--matmul``, measured on its own): with all K devices busy,
  ``rows x inner @ inner x outer`` for rows 64, 256, 1024 and four weight shapes from
  128 x 512 to 512 x 2048. A matmul's time is not proportional to its FLOPs: small
  ones run far below the rate of big ones, because the CPU kernel first copies
  (packs) both operands into cache-sized blocks. Each shape's time is the lowest of
  three medians. A least-squares fit (relative errors) of
  ``t = a + K F / R + K x (lhs + rhs bytes) / memory_bandwidth`` gives the rate R and
  ``matmul_operand_traffic`` x (a, the call's launch, is the instruction overhead's
  part in training and is not stored). ``matmul_efficiency`` is R over the stored float32
  peak; where R passes it, R becomes the peak (efficiency 1) and
  ``vector_flops_fraction`` and ``conv_efficiency`` are rescaled to keep their rates.

- **the optimizer update** (``--update``, measured on its own): a wide MLP (4 layers
  of 1024, 4.2 M parameters, Adam) trained by the real local runtime with a
  data-parallel plan, every device updating every parameter. The runtime times the
  update executable; ``update_fused_memory_fraction`` is the fraction of the update
  ops' unfused traffic at which the cost model predicts that time (bisection). The
  micro-benchmarks above price the update's ops one by one, at the forward pass's
  fusion guess; XLA fuses each parameter's whole Adam chain into one loop.

    python benchmarks/calibrate_cpu.py            # print the fitted values
    python benchmarks/calibrate_cpu.py --write    # and store them in planner/cost/data/
    python benchmarks/calibrate_cpu.py --instructions [--write]   # c and d only
    python benchmarks/calibrate_cpu.py --update [--write]         # the update's fraction only
    python benchmarks/calibrate_cpu.py --matmul [--write]         # the matmul line only

Run them in the order ``--write``, ``--matmul``, ``--update``, ``--instructions``:
each fits what the ones before it leave unexplained, c and d last.

Each measurement is the median of several timed runs after a warm-up (compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

DATA = Path(__file__).resolve().parent.parent / "planner" / "cost" / "data"


def _median_seconds(fn: Any, *args: Any, reps: int = 7) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _per_device_seconds(mesh: Any, fn: Any, *shapes: tuple[tuple[int, ...], Any],
                        reps: int = 7) -> float:
    """Seconds for every device of ``mesh`` to run ``fn`` on its own arrays of
    ``shapes`` (each device's shape; one ``shard_map`` over all of them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    k = mesh.size
    specs = tuple(P("d") for _ in shapes)
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("d")))
    args = [
        jax.device_put(jnp.ones((k * s[0], *s[1:]), dtype), NamedSharding(mesh, P("d")))
        for s, dtype in shapes
    ]
    return _median_seconds(mapped, *args, reps=reps)


def measure() -> dict[str, Any]:
    """Run every micro-benchmark; returns raw rates and the fitted constants."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    k = len(devices)
    mesh = Mesh(np.array(devices), ("d",))

    def per_device(fn: Any, *shapes: tuple[tuple[int, ...], Any]) -> float:
        return _per_device_seconds(mesh, fn, *shapes)

    matmul: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    shapes = [(512, 256, 1024), (512, 1024, 256), (1024, 1024, 1024), (2048, 512, 512)]
    for dtype_name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        for m, kk, n in shapes:
            seconds = per_device(lambda a, b: a @ b[0], ((m, kk), dtype), ((1, kk, n), dtype))
            matmul[dtype_name].append(k * 2 * m * kk * n / seconds)
    peak = {name: max(rates) for name, rates in matmul.items()}
    matmul_efficiency = statistics.median(matmul["float32"]) / peak["float32"]

    elements = 1 << 18  # 1 MiB per array per device: arithmetic, not memory, bound

    def adam_like(p: Any, g: Any, m: Any, v: Any) -> Any:  # 14 FLOPs per element
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 0.001 * (m / 0.1) / (jnp.sqrt(v / 0.001) + 1e-8)

    vector_seconds = per_device(adam_like, *[((elements,), jnp.float32)] * 4)
    vector_rate = k * 14 * elements / vector_seconds
    stream = 1 << 23  # 32 MiB per device: far beyond any cache
    stream_seconds = per_device(lambda x: x * 2.0 + 1.0, ((stream,), jnp.float32))
    memory_bandwidth = k * 2 * 4 * stream / stream_seconds

    samples = []  # (factor * (n-1)/n * bytes, seconds)
    for n in sorted({2, 4, k}):
        if n > k:
            continue
        sub = Mesh(np.array(devices[:n]), ("d",))
        for nbytes in (1 << 16, 1 << 20, 1 << 22):
            shard = nbytes // 4 // n
            x = jax.device_put(jnp.ones((n * shard,), jnp.float32), NamedSharding(sub, P("d")))
            reduce = jax.jit(jax.shard_map(
                lambda v, n=n: jax.lax.psum(jnp.tile(v, n), "d"), mesh=sub, in_specs=P("d"), out_specs=P("d")))
            gather = jax.jit(jax.shard_map(
                lambda v: jax.lax.all_gather(v, "d", tiled=True), mesh=sub, in_specs=P("d"), out_specs=P("d")))
            samples.append((2 * (n - 1) / n * nbytes, _median_seconds(reduce, x), "all-reduce", n, nbytes))
            samples.append(((n - 1) / n * nbytes, _median_seconds(gather, x), "all-gather", n, nbytes))
    # least squares t = alpha + beta * x, both non-negative
    xs = np.array([s[0] for s in samples])
    ts = np.array([s[1] for s in samples])
    design = np.stack([np.ones_like(xs), xs], axis=1)
    # relative error matters (small collectives are as common as big ones): weight 1/t
    weights = 1.0 / ts
    alpha, beta = np.linalg.lstsq(design * weights[:, None], ts * weights, rcond=None)[0]
    alpha, beta = max(float(alpha), 1e-6), max(float(beta), 1e-12)
    fit_errors = [(alpha + beta * x - t) / t for x, t, *_ in samples]

    return {
        "devices": k,
        "matmul_flops": {name: [round(r / 1e9, 1) for r in rates] for name, rates in matmul.items()},
        "vector_flops": vector_rate,
        "memory_bandwidth": memory_bandwidth,
        "collectives": [
            {"op": op, "devices": n, "bytes": nbytes, "ms": round(t * 1e3, 3)}
            for _x, t, op, n, nbytes in samples
        ],
        "collective_fit_error": [round(e, 3) for e in fit_errors],
        "preset": {
            "peak_flops": {
                "float32": round(peak["float32"], -6),
                "bfloat16": round(peak["bfloat16"], -6),
                "float16": round(peak["bfloat16"], -6),
            },
            "memory_bandwidth": round(memory_bandwidth, -6),
            "intra_node_bandwidth": round(1.0 / beta, -6),
            "intra_node_latency": float(f"{alpha:.3g}"),
        },
        "calibration": {
            "matmul_efficiency": round(matmul_efficiency, 3),
            "vector_flops_fraction": round(min(1.0, vector_rate / peak["float32"]), 4),
            "memory_efficiency": 1.0,
            "comm_bandwidth_efficiency": 1.0,
            "collective_overhead_seconds": 0.0,
        },
    }


def measure_matmul() -> dict[str, Any]:
    """Fit ``matmul_efficiency`` and ``matmul_operand_traffic`` (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    k = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    shapes = [(rows, inner, outer)
              for inner, outer in ((128, 512), (256, 1024), (1024, 256), (512, 2048))
              for rows in (64, 256, 1024)]
    best: dict[tuple[int, int, int], float] = {}
    for _sweep in range(3):  # the lowest of 3 medians: a burst of host noise hits one
        for rows, inner, outer in shapes:
            t = _per_device_seconds(mesh, lambda a, b: a @ b[0], ((rows, inner), jnp.float32),
                                    ((1, inner, outer), jnp.float32), reps=9)
            best[rows, inner, outer] = min(t, best.get((rows, inner, outer), t))
    preset = json.loads((DATA / "presets.json").read_text())["cpu"]
    calibration = json.loads((DATA / "calibration.json").read_text())["cpu"]
    bandwidth = preset["memory_bandwidth"] * calibration.get("memory_efficiency", 1.0)
    flops = np.array([2.0 * r * i * o for r, i, o in best])
    operands = np.array([4.0 * (r * i + i * o) for r, i, o in best])  # f32 lhs + rhs bytes
    seconds = np.array(list(best.values()))
    # t = a + K F / R + K x (lhs + rhs) / bandwidth: the last two per device at a 1/K
    # share; a is the call's own launch (the pipeline's instruction overhead covers it
    # in training), fitted and left out of the model.
    design = np.stack([np.ones_like(flops), k * flops, k * operands / bandwidth], axis=1)
    weights = 1.0 / seconds  # relative errors: the small matmuls matter as much
    launch, inv_rate, traffic = np.linalg.lstsq(design * weights[:, None], seconds * weights,
                                                rcond=None)[0]
    rate, traffic = 1.0 / inv_rate, max(0.0, float(traffic))
    fitted = design @ np.array([launch, 1.0 / rate, traffic])
    peak = preset["peak_flops"]["float32"]
    result: dict[str, Any] = {
        "matmul": [f"{r}x{i}x{o}: {k * f / t / 1e9:.0f} GFLOP/s (host), fit {100 * (p - t) / t:+.0f}%"
                   for (r, i, o), f, t, p in zip(best, flops, seconds, fitted, strict=True)],
        "launch_ms": round(float(launch) * 1e3, 3),
        "calibration": {"matmul_efficiency": round(min(1.0, rate / peak), 3),
                        "matmul_operand_traffic": round(traffic, 3)},
    }
    if rate > peak:
        # Big matmuls beat the stored peak (measured at fewer shapes): the fitted rate
        # becomes the float32 peak, and the fractions of that peak that other ops run
        # at are rescaled so their rates stay what they were.
        result["preset"] = {"peak_flops": {**preset["peak_flops"], "float32": round(rate, -6)}}
        for name in ("vector_flops_fraction", "conv_efficiency"):  # their rates stay
            result["calibration"][name] = round(calibration[name] * peak / round(rate, -6), 4)
    return result


#: The models ``--instructions`` trains: MLP-tiny (almost no arithmetic, few kernels
#: per layer) and a small GPT that is not a benchmark configuration (many kernels per
#: layer, none of them big).
INSTRUCTION_MODELS = {
    "mlp-tiny": ("mlp", "tiny"),
    "gpt-48x4": ("gpt", {"hidden": 48, "layers": 4, "heads": 3, "seqLen": 16, "vocab": 128}),
}


def _instruction_plans() -> dict[str, dict]:
    """The plans ``--instructions`` trains each model with: 1 stage of 8 devices with
    1 and 4 micro-batches, 1 stage of 2 devices, 2 stages of 4 and 4 stages of 2."""

    def stages(count: int, micro: int, layers: int = 4) -> dict:
        return {"method": "manual", "numMicroBatches": micro, "numLayers": layers,
                "stages": [{"layers": [i * layers // count, (i + 1) * layers // count],
                            "submeshShape": [1, 8 // count]} for i in range(count)]}

    def one_stage(devices: int, micro: int) -> dict:
        return {"method": "manual", "numMicroBatches": micro, "numLayers": 1,
                "stages": [{"layers": [0, 1], "submeshShape": [1, devices]}]}

    return {"1x8, B=1": one_stage(8, 1), "1x8, B=4": one_stage(8, 4), "1x2, B=1": one_stage(2, 1),
            "2x4, B=4": stages(2, 4), "4x2, B=8": stages(4, 8)}


def measure_instructions(steps: int = 8, warmup: int = 3) -> dict[str, Any]:
    """Fit ``instruction_overhead_seconds`` c and ``kernel_overhead_seconds`` d
    (module docstring); the plans' figures too."""
    import dataclasses

    import numpy as np
    from local_jobs import FAST_PLANNING, job_document, job_plan_options

    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.planner.cost.model import load_calibration
    from alpajob.planner.plan.make import make_plan
    from alpajob.trainer_image.local_run import local_cluster, local_devices, run
    from alpajob.trainer_image.planning import job_graph

    stored = load_calibration("cpu")
    rows = []
    for label, (zoo, config) in INSTRUCTION_MODELS.items():
        graph = None
        for name, parallelism in _instruction_plans().items():
            m = parse_job(job_document("calib", zoo, config, parallelism))
            if graph is None:
                graph = job_graph(m)
            cluster = local_cluster(m, local_devices(8))
            options = job_plan_options(m)
            # The prediction is linear in c and d: its value at 0 and its two slopes.
            trials = [dataclasses.replace(stored, instruction_overhead_seconds=c,
                                          kernel_overhead_seconds=d)
                      for c, d in ((0.0, 0.0), (1e-3, 0.0), (0.0, 1e-6))]
            base, with_c, with_d = (
                make_plan(graph, cluster, dataclasses.replace(options, calibration=trial))
                .plan.predicted_step_seconds for trial in trials)
            per_c = (with_c - base) / 1e-3  # instructions
            per_d = (with_d - base) / 1e-6  # kernel launches x devices
            result = run(m, TrainOptions(steps=steps, planning=FAST_PLANNING))
            rows.append({"model": label, "plan": name, "instructions": round(per_c, 2),
                         "kernel_runs": round(per_d), "base_ms": round(base * 1e3, 2),
                         "measured_ms": round(statistics.median(result.step_seconds[warmup:]) * 1e3, 2)})
    design = np.array([[r["instructions"], r["kernel_runs"]] for r in rows], dtype=float)
    excess = np.array([r["measured_ms"] - r["base_ms"] for r in rows]) / 1e3
    weights = 1.0 / np.array([r["measured_ms"] for r in rows])  # relative errors
    c, d = np.linalg.lstsq(design * weights[:, None], excess * weights, rcond=None)[0]
    c, d = max(0.0, float(c)), max(0.0, float(d))
    for r in rows:
        model_ms = r["base_ms"] + 1e3 * (c * r["instructions"] + d * r["kernel_runs"])
        r["fit_error"] = f"{(model_ms - r['measured_ms']) / r['measured_ms']:+.0%}"
    return {"plans": rows,
            "calibration": {"instruction_overhead_seconds": float(f"{c:.3g}"),
                            "kernel_overhead_seconds": float(f"{d:.3g}")}}


#: The smallest ``update_fused_memory_fraction`` the fit returns.
FRACTION_FLOOR = 1e-3


def measure_update(steps: int = 8, warmup: int = 3) -> dict[str, Any]:
    """Fit ``update_fused_memory_fraction`` (module docstring)."""
    import dataclasses

    from local_jobs import FAST_PLANNING, job_document

    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.cost.model import load_calibration
    from alpajob.planner.graph.opgraph import Phase
    from alpajob.planner.intra_op.strategies import op_base_seconds
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import job_graph

    wide = {"hidden": 1024, "layers": 4, "inputDim": 1024, "outputDim": 1024}
    m = parse_job(job_document("calib", "mlp", wide, {"method": "data"}, optimizer="adam"))
    result = run(m, TrainOptions(steps=steps, planning=FAST_PLANNING, exact_stage_times=True,
                                 stage_times_every=1))
    measured = statistics.median(t[0].update for t in result.stage_times[warmup:])

    graph = job_graph(m)
    device = cluster_from_preset("cpu", 1, 8).device  # a 1/8 share: all 8 devices update
    calibration = load_calibration("cpu")
    update_ops = [op for op in graph.ops if op.phase is Phase.UPDATE]

    def predicted(fraction: float) -> float:
        cal = dataclasses.replace(calibration, update_fused_memory_fraction=fraction)
        return sum(op_base_seconds(op, graph, device, cal) * op.multiplier for op in update_ops)

    # predicted() grows with the fraction. At the lower bound the update's arithmetic
    # alone explains the measured time: it runs in place (its buffers are donated),
    # at streaming rates that make its traffic negligible.
    low, high = FRACTION_FLOOR, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < measured else (low, mid)
    fraction = high
    before = calibration.update_fused_memory_fraction or calibration.fused_memory_fraction
    return {
        "update": {"parameters": graph.num_parameters, "measured_ms": round(measured * 1e3, 2),
                   "predicted_ms_before": round(predicted(before) * 1e3, 2),
                   "predicted_ms_after": round(predicted(fraction) * 1e3, 2),
                   "at_floor": predicted(FRACTION_FLOOR) >= measured},
        "calibration": {"update_fused_memory_fraction": float(f"{fraction:.3g}")},
    }


def _number(value: Any) -> str:
    return format(value, ".4g") if isinstance(value, float) else json.dumps(value)


def _entry(entry: dict[str, Any]) -> str:
    """One preset entry in the files' style: a field per line, dicts on one line."""
    lines = []
    for key, value in entry.items():
        if isinstance(value, dict):
            text = "{" + ", ".join(f"{json.dumps(k)}: {_number(v)}" for k, v in value.items()) + "}"
        else:
            text = _number(value)
        lines.append(f"    {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n  }"


def write(result: dict[str, Any]) -> None:
    """Replace the ``cpu`` entries of planner/cost/data/presets.json and calibration.json
    that ``result`` holds (the other presets' text is left as it is)."""
    for name, key in (("presets.json", "preset"), ("calibration.json", "calibration")):
        if key not in result:
            continue
        path = DATA / name
        text = path.read_text()
        entry = json.loads(text)["cpu"]
        entry.update(result[key])
        start = text.index('"cpu": {') + len('"cpu": ')
        end = text.index("\n  }", start) + len("\n  }")
        path.write_text(text[:start] + _entry(entry) + text[end:])
        json.loads(path.read_text())  # still valid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="store the fit in planner/cost/data/")
    parser.add_argument("--instructions", action="store_true",
                        help="measure only the per-instruction and per-kernel host overheads of the runtime")
    parser.add_argument("--update", action="store_true",
                        help="measure only the optimizer update's fused memory traffic")
    parser.add_argument("--matmul", action="store_true",
                        help="measure only the matmul rate and its operand traffic (small matmuls)")
    args = parser.parse_args()
    if args.instructions + args.update + args.matmul > 1:
        parser.error("--instructions, --update and --matmul are separate runs: pass one of them")
    result = (measure_instructions() if args.instructions
              else measure_update() if args.update
              else measure_matmul() if args.matmul else measure())
    print(json.dumps(result, indent=1))
    if args.write:
        write(result)
        print(f"written to {DATA}/presets.json and calibration.json ('cpu' entries)")


if __name__ == "__main__":
    main()
