"""The ``alpajob`` console script.

Subcommands:

- ``alpajob plan MANIFEST``: trace the manifest's model, plan it on the manifest's
  cluster (or ``--nodes/--gpus-per-node/--gpu``), print the plan as a table,
  optionally beside the baselines (``--baselines``) and write it (``--output``).
- ``alpajob run MANIFEST``: plan for this machine's devices (or read ``--plan``) and
  train ``--steps`` steps on synthetic data, with a progress bar and a summary of
  measured against predicted step time; ``--method serial`` runs the same job on one
  device.
- ``alpajob ray-head`` / ``mesh-worker`` / ``driver``: the distributed runtime's
  processes inside a job's Ray cluster (:mod:`alpajob.cli_ray`).
- ``alpajob models``: the zoo's named configurations.
- ``alpajob schema``: the Plan document's JSON schema.

User errors (a bad manifest, an impossible cluster, a model that does not fit) print one
line naming the problem and the fix and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from alpajob.cli_ray import add_parsers as add_ray_parsers
from alpajob.cli_ray import dispatch as dispatch_ray
from alpajob.operator import main as operator_main
from alpajob.planner.cluster import ClusterSpec, cluster_from_preset, preset_names
from alpajob.planner.errors import AlpaJobError, ClusterError, ManifestError
from alpajob.planner.manifest import AlpaJobManifest, Method, load_manifest
from alpajob.planner.plan import Plan, plan_json_schema, write_plan

GIB = 1024**3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alpajob",
        description="Alpa's automatic inter- and intra-operator parallelism on stock JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan an AlpaJob manifest and print the plan")
    plan.add_argument("manifest", help="AlpaJob YAML (the same file you kubectl apply)")
    plan.add_argument("--nodes", type=int, help="override spec.cluster.nodes")
    plan.add_argument("--gpus-per-node", type=int, help="override spec.cluster.gpusPerNode")
    plan.add_argument("--gpu", help=f"override the device preset ({', '.join(preset_names())})")
    plan.add_argument("--output", "-o", help="write the Plan document (JSON) here")
    plan.add_argument("--output-configmap", metavar="NAMESPACE/NAME",
                      help="also write the Plan into this ConfigMap as plan.json (the planning pod of a job)")
    plan.add_argument("--schedule", action="store_true",
                      help="also print every stage's instruction list (F3: forward of micro-batch 3, "
                           "B: backward, U: the update)")
    plan.add_argument("--baselines", action="store_true",
                      help="also cost data parallel, ZeRO-2, Megatron 3-D and the ablations")
    plan.add_argument("--ilp-time-limit", type=float, default=10.0,
                      help="seconds allowed to each intra-op ILP solve (default 10)")
    run = sub.add_parser("run", help="plan (or read --plan) and train on this machine's devices")
    run.add_argument("manifest", help="AlpaJob YAML (the same file you kubectl apply)")
    run.add_argument("--plan", help="a Plan file from `alpajob plan --output` (default: plan now)")
    run.add_argument("--steps", type=int, help="steps to train (default spec.training.steps)")
    run.add_argument("--seed", type=int, help="parameter and data seed (default spec.training.seed)")
    run.add_argument("--devices", type=int,
                     help="how many local devices to use (on CPU: sets the forced device count; default 8)")
    run.add_argument("--method", choices=[*[m.value for m in Method], "serial"],
                     help="override spec.parallelism.method; serial: the whole step on one device")
    run.add_argument("--metrics-out", help="write per-step losses and step seconds (JSON) here")
    run.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    run.add_argument("--stage-times-every", type=int, default=10, metavar="N",
                     help="time every N-th step per stage (compute, idle, communication); timing "
                          "costs that step 15-20%% on a busy CPU host (default 10; 1: every step)")
    run.add_argument("--exact-stage-times", action="store_true",
                     help="timed steps wait for every instruction before issuing the next: exact "
                          "per-stage compute, communication and idle times, but no overlap (slower)")
    run.add_argument("--checkpoint-dir", help="save sharded checkpoints here")
    run.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (and at the end)")
    run.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    run.add_argument("--ilp-time-limit", type=float, default=10.0,
                     help="seconds allowed to each intra-op ILP solve (default 10)")
    add_ray_parsers(sub)
    operator_main.add_parser(sub)
    sub.add_parser("models", help="list the zoo's named model configurations")
    sub.add_parser("schema", help="print the Plan document's JSON schema")
    return parser


def cluster_for(manifest: AlpaJobManifest, args: argparse.Namespace) -> ClusterSpec:
    """The cluster from ``spec.cluster`` with command-line overrides applied."""
    spec = manifest.spec.cluster
    preset = args.gpu or spec.preset()
    if preset is None:
        raise ClusterError(
            "spec.cluster.gpu",
            "not set, and spec.cluster.nodeSelector has no known nvidia.com/gpu.product; "
            f"set it (or pass --gpu) to one of: {', '.join(preset_names())}",
        )
    nodes = args.nodes if args.nodes is not None else spec.nodes
    per_node = args.gpus_per_node if args.gpus_per_node is not None else spec.gpus_per_node
    field = "--nodes" if args.nodes is not None else "spec.cluster.nodes"
    if nodes < 1:
        raise ClusterError(field, f"must be at least 1, got {nodes}")
    return cluster_from_preset(preset, nodes, per_node)


def plan_options(manifest: AlpaJobManifest, args: argparse.Namespace):  # noqa: ANN201
    """PlanOptions from ``spec.parallelism`` (imported late: keeps `alpajob models` fast)."""
    from alpajob.planner.planning import ManualStageOption, PlanOptions
    from alpajob.planner.schedules import Schedule

    par = manifest.spec.parallelism
    method = getattr(args, "method", None)
    if method is not None and method != "serial":
        par = par.model_copy(update={"method": Method(method)})
    manual = ()
    if isinstance(par.stages, list):
        manual = tuple(
            ManualStageOption(s.layers[0], s.layers[1], s.submesh_shape, s.logical_mesh_shape)
            for s in par.stages
        )
    num_layers = None if par.num_layers == "auto" else int(par.num_layers)
    if manual and num_layers is None:
        num_layers = max(s.end for s in manual)
    return PlanOptions(
        method=par.method,
        schedule=Schedule(par.schedule),
        num_micro_batches=None if par.num_micro_batches == "auto" else int(par.num_micro_batches),
        num_layers=num_layers,
        manual_stages=manual,
        ilp_time_limit_s=args.ilp_time_limit,
        baselines=getattr(args, "baselines", False),
    )


def _mesh(shape: Sequence[int]) -> str:
    return "x".join(str(v) for v in shape)


def plan_table(plan: Plan) -> Table:
    """The plan as a table: one row per stage."""
    title = (
        f"{plan.model.name}: {plan.model.num_parameters / 1e9:.2f}B params on "
        f"{plan.cluster['num_nodes']}x{plan.cluster['devices_per_node']} "
        f"{plan.cluster['preset']}, {plan.num_micro_batches} micro-batches, {plan.schedule}"
    )
    table = Table(title=title, caption="mesh: logical mesh; t/µbatch: forward+backward per "
                  "micro-batch; update: per step; WUS: weight-update-sharded params")
    for column in ("stage", "layers", "submesh", "mesh", "t/µbatch", "update", "memory",
                   "WUS"):
        table.add_column(column, justify="right" if column != "layers" else "left")
    for stage in plan.stages:
        table.add_row(
            str(stage.index),
            f"[{stage.layers[0]}, {stage.layers[1]})",
            _mesh(stage.submesh_shape),
            _mesh(stage.logical_mesh_shape),
            f"{stage.predicted_seconds * 1e3:.2f} ms",
            f"{stage.update_seconds * 1e3:.2f} ms",
            f"{stage.peak_memory_bytes / GIB:.2f} GiB",
            f"{len(stage.weight_update_sharded)}/{len(stage.param_shardings)}",
        )
    return table


def schedule_table(plan: Plan) -> Table:
    """Each stage's instruction list, in the order the stage runs it."""
    from alpajob.planner.schedules import Direction, Schedule, instruction_list

    p, m = len(plan.stages), plan.num_micro_batches
    table = Table(title=f"{plan.schedule} schedule, {m} micro-batches",
                  caption="Fj / Bj: forward / backward of micro-batch j; U: the optimizer update")
    table.add_column("stage", justify="right")
    table.add_column("instructions")
    for i in range(p):
        program = instruction_list(Schedule(plan.schedule), i, p, m)
        names = [f"{'F' if d is Direction.FORWARD else 'B'}{j}" for d, j in program]
        table.add_row(str(i), " ".join([*names, "U"]))
    return table


def _flops(pflops: float) -> str:
    """PFLOP/s, or TFLOP/s / GFLOP/s for small (CPU) figures."""
    if pflops >= 0.1:
        return f"{pflops:.3f} PFLOP/s"
    if pflops >= 1e-4:
        return f"{pflops * 1e3:.3f} TFLOP/s"
    return f"{pflops * 1e6:.3f} GFLOP/s"


def _summary(plan: Plan) -> str:
    stats = plan.solver
    return (
        f"predicted step time {plan.predicted_step_seconds:.4g} s, "
        f"{_flops(plan.predicted_pflops)}, bubble {plan.bubble_fraction:.1%}; "
        f"planned in {stats.planning_seconds:.1f} s ({stats.ilp_solves} ILPs, "
        f"{stats.ilp_seconds:.1f} s; DP {stats.dp_seconds:.2f} s); plan hash {plan.content_hash()}"
    )


def baseline_table(plan: Plan) -> Table:
    """Each baseline's predicted step time and our plan's speed-up over it."""
    table = Table(title="baselines (same cost model, same cluster)")
    for column in ("plan", "step time", "throughput", "ours is faster by"):
        table.add_column(column, justify="right")
    ours = plan.predicted_step_seconds
    table.add_row("alpajob", f"{ours:.4g} s", _flops(plan.predicted_pflops), "-")
    for name, seconds in (plan.baselines or {}).items():
        if seconds is None:
            table.add_row(name, "does not fit", "-", "-")
        else:
            pflops = plan.model.flops_per_step / seconds / 1e15
            table.add_row(name, f"{seconds:.4g} s", _flops(pflops), f"{seconds / ours:.2f}x")
    return table


def cmd_plan(args: argparse.Namespace, out: Console, err: Console) -> int:
    manifest = load_manifest(args.manifest)
    cluster = cluster_for(manifest, args)
    options = plan_options(manifest, args)
    from alpajob.planner.extract import extract_model
    from alpajob.planner.planning import make_plan
    from alpajob.trainer.entrypoint import load_model

    training = manifest.spec.training
    model = load_model(manifest.spec.model, training.dtype)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(f"tracing {model.name}", total=None)
        start = time.perf_counter()
        graph = extract_model(
            model, training.global_batch_size, optimizer=training.optimizer,
            learning_rate=training.learning_rate,
        )
        extract_seconds = time.perf_counter() - start

        def progress(what: str, done: int, total: int | None) -> None:
            bar.update(task, description=f"{what} ({done} done)" if done else what)

        result = make_plan(graph, cluster, options, progress=progress,
                           extract_seconds=extract_seconds)
    plan = result.plan
    out.print(plan_table(plan))
    out.print(_summary(plan))
    if args.schedule:
        out.print(schedule_table(plan))
    if plan.baselines is not None:
        out.print(baseline_table(plan))
    if args.output:
        write_plan(plan, args.output)
        out.print(f"plan written to {args.output}")
    if args.output_configmap:
        from alpajob.trainer.publish import write_plan_configmap

        write_plan_configmap(plan.to_json(), args.output_configmap)
        out.print(f"plan written to ConfigMap {args.output_configmap}")
    return 0


def _force_devices(count: int | None) -> None:
    """Ask XLA for ``count`` host (CPU) devices; must run before JAX is imported."""
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules or (count is None and flag in flags):
        return
    kept = " ".join(f for f in flags.split() if not f.startswith(flag))
    os.environ["XLA_FLAGS"] = f"{kept} {flag}={count or 8}".strip()


def cmd_run(args: argparse.Namespace, out: Console, err: Console) -> int:
    manifest = load_manifest(args.manifest)
    training = manifest.spec.training
    steps = args.steps if args.steps is not None else training.steps
    if steps < 1:
        raise ManifestError("--steps", f"must be at least 1, got {steps}")
    if args.devices is not None and args.devices < 1:
        raise ManifestError("--devices", f"must be at least 1, got {args.devices}")
    if args.plan and args.method:
        raise ManifestError("--method", "a --plan file already fixes the method; pass one of the two")
    _force_devices(args.devices)
    from alpajob.trainer.local_run import RunOptions, run

    options = RunOptions(
        steps=steps,
        seed=args.seed if args.seed is not None else training.seed,
        devices=args.devices,
        serial=args.method == "serial",
        plan_path=args.plan,
        plan_options=plan_options(manifest, args),
        metrics_out=args.metrics_out,
        metrics_port=args.metrics_port,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        exact_stage_times=args.exact_stage_times,
        stage_times_every=args.stage_times_every,
    )
    batch = training.global_batch_size
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("starting", total=steps, status="")

        def on_phase(what: str) -> None:
            bar.update(task, description=what)

        def on_step(step: int, loss: float, seconds: float) -> None:
            bar.update(task, completed=step, description="training",
                       status=f"loss {loss:.4f}  {batch / seconds:,.1f} samples/s")

        result = run(manifest, options, on_step=on_step, on_phase=on_phase)
    if result.plan is not None:
        out.print(plan_table(result.plan))
    out.print(run_summary(result, batch, exact=args.exact_stage_times))
    return 0


def run_summary(result: Any, batch: int, exact: bool = False) -> Table:
    """Steps, loss, measured against predicted step time, and per-stage time split
    (``exact``: the run waited for every instruction, so the split is exact)."""
    table = Table(title="training summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    steps = len(result.losses)
    table.add_row("steps", f"{result.start_step + 1}..{result.start_step + steps}")
    if steps:
        table.add_row("loss (first, last)", f"{result.losses[0]:.5f}, {result.losses[-1]:.5f}")
        timed = result.step_seconds[1:] or result.step_seconds  # the first step compiles
        measured = sorted(timed)[len(timed) // 2]
        table.add_row("step time (median, after the first)", f"{measured:.4g} s")
        table.add_row("samples/s", f"{batch / measured:,.1f}")
        if result.plan is not None:
            predicted = result.plan.predicted_step_seconds
            table.add_row("predicted step time", f"{predicted:.4g} s")
            table.add_row("measured / predicted", f"{measured / predicted:.2f}")
        if result.stage_times:
            first = result.start_step + 1  # compiles
            timed = list(zip(result.stage_time_steps, result.stage_times, strict=True))
            recent = [t for step, t in timed if step != first] or result.stage_times
            for index in range(len(recent[0])):
                mean = [sum(getattr(t[index], k) for t in recent) / len(recent)
                        for k in ("compute", "idle", "communication")]
                table.add_row(f"stage {index} compute / idle / comm",
                              " / ".join(f"{v * 1e3:.1f} ms" for v in mean))
            table.caption = f"stage times: mean of {len(recent)} timed step(s) (--stage-times-every)"
            if not exact:
                table.caption += ("; from completion stamps, rough on CPU devices, exact with "
                                  "--exact-stage-times")
    return table


def cmd_models(out: Console) -> int:
    from alpajob.trainer.zoo import list_models

    for name in list_models():
        out.print(name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; returns the exit status."""
    args = _parser().parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    try:
        if args.command == "plan":
            return cmd_plan(args, out, err)
        if args.command == "run":
            return cmd_run(args, out, err)
        if args.command == "models":
            return cmd_models(out)
        if args.command == "operator":
            return operator_main.run(args)
        done = dispatch_ray(args, out)
        if done is not None:
            return done
        if args.command == "schema":
            print(json.dumps(plan_json_schema(), indent=2))
            return 0
    except AlpaJobError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        return error.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Method", "main"]
