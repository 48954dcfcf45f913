"""``alpajob plan MANIFEST``: plan a job and show the plan.

Traces the manifest's model, plans it on ``spec.cluster`` (or ``--nodes``,
``--gpus-per-node``, ``--gpu``), prints one row per stage and the predicted step
time, optionally the schedule (``--schedule``), the baselines (``--baselines``) and
a picture of the plan (``--svg``: :mod:`alpajob.cli.picture`),
or, with ``--what-if``, the job on each of several clusters (:mod:`alpajob.cli.what_if`),
and writes the Plan document (``--output``, or ``--output-configmap`` in a job's
planning pod). In a planning pod every flag defaults to the runtime contract
(:class:`~alpajob.api.runtime.TrainerRuntime`: the manifest's path, the node pool the
operator found, the ConfigMap to write).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.api.options import PlanOptions, from_flags
from alpajob.api.plan import write_plan
from alpajob.api.resource import AlpaJob, load_job
from alpajob.api.runtime import TrainerRuntime
from alpajob.cli import what_if
from alpajob.cli.paths import add_plan_cache_flags, existing_file, plan_cache_dir, writable_file
from alpajob.cli.tables import baseline_table, plan_summary, plan_table, schedule_table


def add_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="plan an AlpaJob manifest and print the plan")
    plan.add_argument("manifest", nargs="?",
                      help="AlpaJob YAML (the same file you kubectl apply; default $ALPAJOB_MANIFEST)")
    plan.add_argument("--nodes", type=int, help="override spec.cluster.nodes")
    plan.add_argument("--gpus-per-node", type=int, help="override spec.cluster.gpusPerNode")
    plan.add_argument("--gpu", help=f"override the device preset "
                                    f"({', '.join(p.value for p in DevicePreset)})")
    plan.add_argument("--output", "-o", help="write the Plan document (JSON) here")
    plan.add_argument("--output-configmap", metavar="NAMESPACE/NAME",
                      help="also write the Plan into this ConfigMap as plan.json (the planning pod "
                           "of a job; default $ALPAJOB_PLAN_CONFIGMAP)")
    plan.add_argument("--schedule", action="store_true",
                      help="also print every stage's instruction list (F3: forward of micro-batch "
                           "3, B: backward, U: the update)")
    plan.add_argument("--svg", metavar="FILE",
                      help="also draw the plan as an SVG picture: the submesh map and the "
                           "predicted timeline of one step (open it in a browser); with "
                           "--what-if, each option's cost and time and their Pareto front")
    plan.add_argument("--baselines", action="store_true",
                      help="also cost data parallel, ZeRO-2, Megatron 3-D and the ablations")
    plan.add_argument("--all-devices", action="store_true",
                      help="use every device offered, even forced CPU devices where one is "
                           "predicted faster (Alpa's rule; GPU plans always use every device)")
    plan.add_argument("--calibration", metavar="FILE",
                      help="plan with the constants `alpajob calibrate` measured (default: the "
                           "preset's stored ones)")
    plan.add_argument("--plan-time-limit", type=float, default=1800.0, metavar="S",
                      help="seconds tracing and planning may take before they stop with an error "
                           "(default 1800)")
    plan.add_argument("--ilp-time-limit", type=float, default=None, metavar="S",
                      help="seconds allowed to each intra-op ILP solve (default "
                           "spec.planner.ilpTimeLimitSeconds, 10 unless set)")
    add_plan_cache_flags(plan)
    what_if.add_flags(plan)


def calibration_file(args: argparse.Namespace, runtime: TrainerRuntime, job: AlpaJob) -> tuple[str | None, str]:
    """The calibration file to plan with, and a note to print (else ""): ``--calibration``,
    else in the planner pod the file the operator mounted from
    ``spec.planner.calibration``'s ConfigMap key (missing: an error naming the field).
    Outside a pod that ConfigMap is not at hand: the note says so."""
    if args.calibration:
        return str(existing_file(args.calibration, "--calibration")), ""
    ref = job.spec.planner.calibration
    if runtime.calibration:
        if not Path(runtime.calibration).is_file():
            where = f"ConfigMap {ref.config_map} key {ref.key}" if ref else "the calibration ConfigMap"
            raise ManifestError("spec.planner.calibration", (
                f"{where} is not there (no such ConfigMap in the job's namespace, or no such key); make it "
                f"with `kubectl create configmap {ref.config_map if ref else 'NAME'} "
                f"--from-file={ref.key if ref else 'KEY'}=alpajob-calibration.json` from the file "
                "`alpajob calibrate` wrote, then apply the job again"))
        return runtime.calibration, ""
    if ref is not None:
        return None, (f"spec.planner.calibration (ConfigMap {ref.config_map}, key {ref.key}) is read in the "
                      "planner pod on Kubernetes; here the preset's stored constants are used: give "
                      "--calibration FILE to plan with a file")
    return None, ""


def plan_options(args: argparse.Namespace, runtime: TrainerRuntime, calibration: str | None = None) -> PlanOptions:
    """The flags (else the runtime contract's pool) as :class:`PlanOptions`;
    ``calibration``: the file of :func:`calibration_file`."""
    return from_flags(PlanOptions, {
        "nodes": args.nodes if args.nodes is not None else runtime.nodes,
        "gpus_per_node": args.gpus_per_node if args.gpus_per_node is not None else runtime.gpus_per_node,
        "gpu": args.gpu or runtime.gpu,
        "pools": tuple(runtime.pools) if runtime.pools else None,
        "ilp_time_limit": args.ilp_time_limit, "plan_time_limit": args.plan_time_limit,
        "baselines": args.baselines or None,
        "all_devices": args.all_devices or None,
        "calibration": calibration,
        "cache_dir": plan_cache_dir(args, runtime.plan_cache),
    })


def pod_template_check(job: AlpaJob) -> None:
    """The webhook's check of ``spec.podTemplate``'s free-form parts against Kubernetes'
    types (:mod:`alpajob.operator.pod_shapes`), so ``alpajob plan`` refuses what
    ``kubectl apply`` would."""
    templates = job.spec.pod_template
    if templates.planner is None and templates.head is None and templates.mesh is None:
        return
    from alpajob.operator.pod_shapes import template_problems

    problems = template_problems(job.model_dump(mode="json", by_alias=True, exclude_none=True))
    if problems:
        field, _, message = problems[0].partition(": ")
        raise ManifestError(field, message)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from alpajob.api.options import TrainOptions
    from alpajob.trainer_image.forced_count import run_devices_line

    runtime = TrainerRuntime.from_env(os.environ)
    manifest = args.manifest or runtime.manifest
    if not manifest:
        raise ManifestError("manifest", "give the AlpaJob manifest to plan (or set $ALPAJOB_MANIFEST)")
    job = load_job(manifest)
    pod_template_check(job)
    calibration, note = calibration_file(args, runtime, job)
    if note:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    options = plan_options(args, runtime, calibration)
    if args.what_if:
        return what_if.run(args, job, options, out, err)
    for flag, given in (("--prices", args.prices), ("--json", args.json)):
        if given:
            raise ManifestError(flag, "prices and prints the options of --what-if; add --what-if SPEC...")
    if args.output:
        writable_file(args.output, "--output")
    if args.svg:
        writable_file(args.svg, "--svg")
    target = args.output_configmap or runtime.plan_configmap
    devices_line = run_devices_line(job, TrainOptions(planning=options))  # before JAX starts
    from alpajob.trainer_image.planning import plan_or_cached
    from alpajob.trainer_image.stopping import Interrupted, interrupted

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("planning", total=None)

        doing = ["planning"]

        def progress(what: str, done: int, total: int | None) -> None:
            doing[0] = what if what.startswith("tracing") else f"planning ({what})"
            bar.update(task, description=f"{what} ({done} done)" if done else what)

        try:
            planned = plan_or_cached(job, options, progress=progress,
                                     warn=lambda line: err.print(line, highlight=False, soft_wrap=True))
        except (Interrupted, KeyboardInterrupt) as error:
            raise interrupted(error, doing[0]) from None
    plan = planned.plan
    if planned.cached:
        err.print(f"plan: cached ({plan.content_hash()}) in {options.cache_dir}; --no-plan-cache plans again",
                  highlight=False, soft_wrap=True)
    out.print(plan_table(plan))
    out.print(plan_summary(plan))
    if devices_line:
        out.print(devices_line, highlight=False, soft_wrap=True)
    if options.calibration:
        from alpajob.planner.cost.measured import load_measured

        machine = load_measured(options.calibration).machine
        out.print(f"cost-model constants from {options.calibration}: {machine.describe()}",
                  soft_wrap=True)
    if args.schedule:
        out.print(schedule_table(plan))
    if plan.baselines is not None:
        out.print(baseline_table(plan))
    if args.svg:
        from alpajob.cli.picture import plan_svg
        from alpajob.planner.plan.timeline import predicted_timeline

        with open(args.svg, "w", encoding="utf-8") as f:
            f.write(plan_svg(plan, predicted_timeline(plan)))
        out.print(f"picture written to {args.svg}", soft_wrap=True)
    if args.output:
        write_plan(plan, args.output)
        out.print(f"plan written to {args.output}", soft_wrap=True)
    if target:
        from alpajob.trainer_image.publish import write_plan_configmap

        write_plan_configmap(plan.to_json(), target)
        out.print(f"plan written to ConfigMap {target}")
    return 0
