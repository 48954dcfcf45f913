"""One-stage plans against the same step written by hand in plain JAX, side by side.

What a user compares AlpaJob with: the model's training step (``jax.value_and_grad``
of the loss, the optax update) under one ``jax.jit``, parameters and optimizer state
donated, ``NamedSharding`` s on the same mesh. For each case this script plans the
model (``alpajob run``'s planner), reads the plan's parameter and batch shardings,
and builds that hand-written step with exactly those shardings as its in- and out-
shardings; AlpaJob runs the plan as ``alpajob run`` does (its runner, untimed
steps). Both place the host batch every step and read the loss back (a training
loop that logs it), on the same devices, interleaved round after round.

Cases, on 8 forced CPU devices: one device (a one-stage plan on a 1x1 submesh, and
the trainer's serial path), data parallel over 8, and the ILP's choice on the 1x8
and 2x4 logical meshes (tensor, data or 2-D parallel: the table says how many
parameters it sharded).

    python benchmarks/handwritten.py [--models gpt,moe] [--steps 10] [--warmup 4] [--repeat 3]
        [--batch 32] [--cases "1 device,data parallel"]

The two steps of a case alternate, one hand-written step then one AlpaJob step, so
the machine's drift (two cores shared by eight forced devices drift by 5-10% over
seconds) hits both alike; cases take turns over ``--repeat`` rounds. Times are the
medians over every pair after the warm-up; ``ratio`` is the median of the pairs'
hand-written time / AlpaJob time (above 1: AlpaJob is faster), with its quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

#: Models big enough that a step is compute, not dispatch, on two cores.
CONFIGS = {
    "gpt": {"hidden": 256, "layers": 2, "heads": 8, "seqLen": 128, "vocab": 2048},
    "moe": {"hidden": 256, "layers": 2, "heads": 8, "seqLen": 128, "vocab": 2048, "experts": 8,
            "expertGroupSize": 512, "capacityFactor": 2.0},
}


def _one_stage(devices: int, logical: list[int] | None = None, micro: int = 1) -> dict:
    stage: dict = {"layers": [0, 1], "submeshShape": [1, devices]}
    if logical:
        stage["logicalMeshShape"] = logical
    return {"method": "manual", "numLayers": 1, "numMicroBatches": micro, "stages": [stage]}


#: name -> (devices the job is planned for, spec.parallelism)
CASES = {
    "1 device": (1, _one_stage(1)),
    "data parallel": (8, {"method": "data"}),
    "ILP, 1x8 mesh": (8, _one_stage(8, [1, 8])),
    "ILP, 2x4 mesh": (8, _one_stage(8, [2, 4])),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt,moe")
    parser.add_argument("--steps", type=int, default=10, help="step pairs per case per round")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from local_jobs import FAST_PLANNING, job_document, paired_cells

    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.entrypoint import load_model
    from alpajob.trainer_image.planning import plan_job
    from alpajob.trainer_image.runners import PipelineRunner, SerialRunner
    from alpajob.trainer_image.runtime.build import build_pipeline, param_names
    from alpajob.trainer_image.runtime.meshes import batch_spec, named, partition_spec
    from alpajob.trainer_image.step import init_optimizer_state, make_train_step, named_optimizer
    from alpajob.trainer_image.zoo.model import synthetic_batch

    def paired(hand: object, ours: object, batches: list, warm: bool) -> list[tuple[float, float]]:
        """Seconds of ``args.steps`` steps of each, alternating step by step (a drift of
        the machine's speed hits both alike); ``warm``: after ``args.warmup`` of each."""
        if not warm:
            for i in range(args.warmup):
                hand(batches[i % len(batches)])  # type: ignore[operator]
                ours(batches[i % len(batches)])  # type: ignore[operator]
        out = []
        for i in range(args.steps):
            times = []
            for step in (hand, ours):
                start = time.perf_counter()
                step(batches[i % len(batches)])  # type: ignore[operator]
                times.append(time.perf_counter() - start)
            out.append((times[0], times[1]))
        return out

    def handwritten(model: object, plan: object, executor: object) -> object:
        """The plain-JAX step with the plan's shardings on the plan's mesh."""
        stage_plan, stage = plan.stages[0], executor.stages[0]  # type: ignore[attr-defined]
        mesh = stage.mesh
        params = model.init(jax.random.key(0))  # type: ignore[attr-defined]
        names = param_names(params)
        leaves, tree = jax.tree.flatten(params)
        shardings = [named(mesh, partition_spec(stage_plan.param_shardings.get(n, [])), x.shape)
                     for n, x in zip(names, leaves, strict=True)]
        param_sh = jax.tree.unflatten(tree, shardings)
        params = jax.device_put(params, param_sh)
        optimizer = named_optimizer("adam", 1e-3)
        opt_state = jax.jit(lambda p: init_optimizer_state(optimizer, p))(params)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_sh = jax.tree.map(lambda x: x.sharding if x.sharding.device_set == set(mesh.devices.flat)
                              else replicated, opt_state)  # Adam's step count: on the mesh
        opt_state = jax.device_put(opt_state, opt_sh)
        abstract = model.batch_shapes(plan.global_batch_size)  # type: ignore[attr-defined]
        batch_leaves, batch_tree = jax.tree.flatten(abstract)
        batch_sh = []
        for k, aval in enumerate(batch_leaves):
            entries = stage_plan.batch_shardings.get(str(k))
            spec = partition_spec(entries) if entries is not None else batch_spec(aval.shape, mesh)
            batch_sh.append(named(mesh, spec, aval.shape))
        train = make_train_step(model.loss, optimizer)  # type: ignore[attr-defined]

        def step(p: object, o: object, b: object) -> tuple:
            loss, _, p, o = train(p, o, b)
            return loss, p, o

        jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, jax.tree.unflatten(batch_tree, batch_sh)),
                         out_shardings=(replicated, param_sh, opt_sh),
                         donate_argnums=(0, 1))
        state = {"p": params, "o": opt_state}

        def run(batch: list) -> float:
            placed = jax.device_put(jax.tree.unflatten(batch_tree, batch),
                                    jax.tree.unflatten(batch_tree, batch_sh))
            loss, state["p"], state["o"] = jitted(state["p"], state["o"], placed)
            return float(loss)

        return run

    print(f"8 forced CPU devices on {os.cpu_count()} cores; global batch {args.batch}; Adam, float32; "
          f"{args.repeat} rounds of {args.steps} step pairs (hand-written, AlpaJob) after {args.warmup} "
          f"warm-up steps each")
    print("| model | case | plan: micro-batches, sharded params | hand-written ms | AlpaJob ms "
          "| ratio (quartiles) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        config = CONFIGS[name]
        runs: dict[str, tuple[object, object, str]] = {}
        for case, (devices, parallelism) in CASES.items():
            if wanted and case not in wanted:
                continue
            job = parse_job(job_document("bench", name, config, parallelism, batch=args.batch, devices=devices))
            model = load_model(job.spec.model, "float32")
            plan = plan_job(job, FAST_PLANNING).plan
            optimizer = named_optimizer("adam", 1e-3)
            executor = build_pipeline(plan, model.loss, model.init(jax.random.key(0)), model.batch_shapes,
                                      optimizer, jax.devices())
            ours = PipelineRunner(executor, None)
            sharded = sum(any(e for e in entries) for entries in plan.stages[0].param_shardings.values())
            described = f"{plan.num_micro_batches}, {sharded}/{len(plan.stages[0].param_shardings)}"
            runs[case] = (handwritten(model, plan, executor), lambda b, r=ours: r.step(b, False), described)
            if case == "1 device":
                serial = SerialRunner(model, optimizer, model.init(jax.random.key(0)), jax.devices()[0],
                                      args.batch, None)
                runs["1 device, serial trainer"] = (runs[case][0], lambda b, r=serial: r.step(b, False),
                                                    "serial")
        batches = [[np.asarray(x) for x in jax.tree.leaves(synthetic_batch(model, args.batch, seed=s))]
                   for s in range(4)]
        samples: dict[str, list[tuple[float, float]]] = {case: [] for case in runs}
        for round_ in range(args.repeat):
            for case, (hand, ours_step, _) in runs.items():
                samples[case] += paired(hand, ours_step, batches, warm=round_ > 0)
        for case, (_, _, described) in runs.items():
            print(f"| {name} {json.dumps(config)} | {case} | {described} | {paired_cells(samples[case])} |",
                  flush=True)


if __name__ == "__main__":
    main()
