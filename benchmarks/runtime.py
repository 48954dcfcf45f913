"""Runtime benchmark (BENCHMARKS.md sections 2 and 3) on 8 forced CPU devices.

For several plans of one model: measured step time against the plan's prediction
(plan fidelity), against the ideal its schedule allows, and against single-device
(serial) and plain data-parallel training of the same model. Then cross-mesh
transfer throughput against a plain memory copy of the same bytes.

Each plan runs twice: as ``alpajob run`` runs it (the measured step), and with
``--exact-stage-times``, which waits for every instruction, for each instruction's
own time. From those times, two ideals with free communication:

- **independent devices**: the schedule replayed with each instruction's time
  (``replay``: stage compute plus the bubble, as if every stage had devices of its
  own);
- **shared host**: at least the sum of every instruction's time as well, since the
  8 forced devices share this machine's cores and an instruction measured alone had
  all of them (the planner's ``shared_host`` pricing makes the same argument).

    python benchmarks/runtime.py [--steps 10] [--warmup 3] [--model gpt] [--config tiny|JSON]
        [--batch 32] [--cases "data parallel,auto"] [--no-transfer] [--repeat 3]

Step times are the median of the steps after the first ``--warmup`` (the first step
compiles; the next one or two still allocate and run slower: a plan's second step
measured 1.7 s against 0.95 s from the fourth on). On a 2-core machine a plan's median
still moves by ~10% from one run to the next: ``--repeat N`` runs every plan (and the
serial baseline) N times, interleaved, and reports the median run with the range of
its errors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cases", default="", help="comma-separated plan names to run (default all)")
    parser.add_argument("--no-transfer", action="store_true", help="skip the transfer table")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every plan this many times, interleaved; report the median "
                             "run and the range of the errors")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    config = json.loads(args.config) if args.config.startswith("{") else args.config

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from local_jobs import FAST_PLANNING, job_document

    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.api.spec import Schedule
    from alpajob.planner.inter_op.schedules import replay
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.runtime.transport import move

    def manifest(parallelism: dict) -> object:
        return parse_job(job_document("bench", args.model, config, parallelism, batch=args.batch))

    def stages(*shapes: tuple[int, int]) -> list[dict]:
        return [{"layers": [i, i + 1], "submeshShape": list(s)} for i, s in enumerate(shapes)]

    cases = {
        "data parallel": {"method": "data"},
        "shard (ILP)": {"method": "shard"},
        "auto": {"method": "auto"},
        "2 stages 1f1b m=4": {"method": "manual", "numMicroBatches": 4, "numLayers": 2,
                              "stages": stages((1, 4), (1, 4))},
        "4 stages 1f1b m=8": {"method": "manual", "numMicroBatches": 8, "numLayers": 4,
                              "stages": stages((1, 2), (1, 2), (1, 2), (1, 2))},
        "4 stages gpipe m=8": {"method": "manual", "numMicroBatches": 8, "numLayers": 4,
                               "schedule": "gpipe", "stages": stages((1, 2), (1, 2), (1, 2), (1, 2))},
    }
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    chosen = {name: par for name, par in cases.items() if not wanted or name in wanted}

    def measure(par: dict) -> tuple[int, int, float, float, float, float]:
        """(stages, micro-batches, predicted, measured, ideal on independent devices,
        ideal on the shared host) of one run of a plan."""
        m = manifest(par)
        options = TrainOptions(steps=args.steps, planning=FAST_PLANNING)
        result = run(m, options)
        exact = run(m, options.model_copy(update={"exact_stage_times": True, "stage_times_every": 1}))
        plan = result.plan
        measured = statistics.median(result.step_seconds[args.warmup:])
        independent, shared = [], []
        for t in exact.stage_times[args.warmup:]:
            ideal = (replay(Schedule(plan.schedule), [x.forward for x in t], [x.backward for x in t]).makespan
                     + max(x.update for x in t))
            independent.append(ideal)
            shared.append(max(ideal, sum(sum(x.forward) + sum(x.backward) + x.update for x in t)))
        return (len(plan.stages), plan.num_micro_batches, plan.predicted_step_seconds, measured,
                statistics.median(independent), statistics.median(shared))

    serials: list[float] = []
    runs: dict[str, list[tuple[int, int, float, float, float, float]]] = {name: [] for name in chosen}
    for _ in range(args.repeat):  # interleaved: every plan sees the same spread of machine states
        serial = run(manifest({}), TrainOptions(steps=args.steps, serial=True))
        serials.append(statistics.median(serial.step_seconds[args.warmup:]))
        for name, par in chosen.items():
            runs[name].append(measure(par))
    t_serial = statistics.median(serials)
    rows = []
    for name, samples in runs.items():
        n, mb, pred = samples[0][:3]
        measured, independent, shared = (statistics.median(x[k] for x in samples) for k in (3, 4, 5))
        errors = [(pred - x[3]) / x[3] for x in samples]
        rows.append((name, n, mb, pred, measured, independent, shared, min(errors), max(errors)))
    t_data = next((row[4] for row in rows if row[0] == "data parallel"), None)
    print(f"model {args.model}-{args.config}, global batch {args.batch}, 8 CPU devices, "
          f"{args.steps} steps (median after the first {args.warmup})"
          + (f", median of {args.repeat} interleaved runs" if args.repeat > 1 else ""))
    print(f"serial (1 device): {t_serial * 1e3:.1f} ms/step")
    spread = " | error range" if args.repeat > 1 else ""
    print("| plan | stages | m | predicted ms | measured ms | error" + spread + " | ideal, independent "
          "devices ms | overhead | ideal, shared host ms | overhead | vs serial | vs data parallel |")
    print("| --- " * (12 + (args.repeat > 1)) + "|")
    for name, n, mb, pred, meas, independent, shared, low, high in rows:
        spread = f" | {low:+.0%}..{high:+.0%}" if args.repeat > 1 else ""
        print(f"| {name} | {n} | {mb} | {pred * 1e3:.2f} | {meas * 1e3:.1f} | "
              f"{(pred - meas) / meas:+.0%}{spread} | {independent * 1e3:.1f} | {meas / independent - 1:+.0%} | "
              f"{shared * 1e3:.1f} | {meas / shared - 1:+.0%} | "
              f"{t_serial / meas:.2f}x | " + (f"{t_data / meas:.2f}x |" if t_data else "- |"))

    if args.no_transfer:
        return
    devices = jax.devices()
    src = Mesh(np.array(devices[:4]).reshape(2, 2), ("x", "y"))
    dst = Mesh(np.array(devices[4:]).reshape(1, 4), ("x", "y"))
    print("\n| transfer (64 MiB f32) | move GB/s | memcpy GB/s | ratio |")
    print("| --- | --- | --- | --- |")
    data = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
    for a, b in [(P("x", None), P(None, "y")), (P("x", "y"), P("y")), (P("x"), P())]:
        array = jax.device_put(data, NamedSharding(src, a))
        target = NamedSharding(dst, b)
        # the copy baseline moves the bytes the destination holds (replicas included)
        nbytes = sum(s.data.nbytes for s in move(array, target).addressable_shards)
        copies = nbytes // data.nbytes
        moves, memcpys = [], []
        for _ in range(9):  # interleaved, so both see the same machine state; medians
            start = time.perf_counter()
            move(array, target).block_until_ready()
            moves.append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(copies):
                data.copy()
            memcpys.append(time.perf_counter() - start)
        moved, copied = statistics.median(moves), statistics.median(memcpys)
        print(f"| {a} -> {b} | {nbytes / moved / 1e9:.2f} | {nbytes / copied / 1e9:.2f} | "
              f"{copied / moved:.2f} |")


if __name__ == "__main__":
    main()
