"""``alpajob run MANIFEST``: plan for this machine's devices (or read ``--plan``) and train.

The flags become one :class:`~alpajob.api.options.TrainOptions` (an invalid one exits
2 naming it), the training runs in :func:`alpajob.trainer_image.local_run.run` with a
progress bar, and the run ends with the plan and a summary of measured against
predicted step time. ``--method serial`` runs the same job on one device (the
reference every parallel run must equal).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as ProgressBar

from alpajob.api.options import PlanOptions, TrainOptions, from_flags
from alpajob.api.progress import Progress
from alpajob.api.resource import load_job
from alpajob.api.spec import Method
from alpajob.cli.paths import directory, writable_file
from alpajob.cli.tables import plan_table, progress_line, run_summary
from alpajob.trainer_image.devices import force_host_devices

SERIAL = "serial"


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="plan (or read --plan) and train on this machine's devices")
    run.add_argument("manifest", help="AlpaJob YAML (the same file you kubectl apply)")
    run.add_argument("--plan", help="a Plan file from `alpajob plan --output` (default: plan now)")
    run.add_argument("--steps", type=int, help="steps to train (default spec.training.steps)")
    run.add_argument("--seed", type=int, help="parameter and data seed (default spec.training.seed)")
    run.add_argument("--devices", type=int,
                     help="how many local devices to use (on CPU: sets the forced device count; default 8)")
    run.add_argument("--method", choices=[*[m.value for m in Method], SERIAL],
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
    run.add_argument("--prefetch", type=int, default=2, metavar="N",
                     help="batches of spec.data a background thread keeps ready (default 2; 0: none)")
    run.add_argument("--ilp-time-limit", type=float, default=10.0,
                     help="seconds allowed to each intra-op ILP solve (default 10)")


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The flags as :class:`TrainOptions`; an invalid one is an error naming it."""
    serial = args.method == SERIAL
    planning = from_flags(PlanOptions, {
        "method": None if serial else args.method, "ilp_time_limit": args.ilp_time_limit})
    options = from_flags(TrainOptions, {
        "steps": args.steps, "seed": args.seed, "devices": args.devices, "serial": serial or None,
        "plan_file": args.plan, "planning": planning, "metrics_out": args.metrics_out,
        "metrics_port": args.metrics_port, "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every, "resume": args.resume or None,
        "exact_stage_times": args.exact_stage_times or None,
        "stage_times_every": args.stage_times_every, "prefetch": args.prefetch,
    })
    if options.metrics_out:
        writable_file(options.metrics_out, "--metrics-out")
    if options.checkpoint_dir:
        directory(options.checkpoint_dir, "--checkpoint-dir")
    return options


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    job = load_job(args.manifest)
    options = train_options(args)
    force_host_devices(options.devices)  # before JAX is imported
    from alpajob.trainer_image.local_run import run as train

    steps = options.steps or job.spec.training.steps
    batch = job.spec.training.global_batch_size
    with ProgressBar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("starting", total=steps, status="")

        def on_phase(what: str) -> None:
            if what.startswith("data: "):  # what the run trains on stays on the screen
                bar.console.print(what, highlight=False)
            bar.update(task, description=what)

        def on_step(report: Progress) -> None:
            bar.update(task, completed=report.step, description="training",
                       status=progress_line(report, steps=False))

        result = train(job, options, on_step=on_step, on_phase=on_phase)
    if result.plan is not None:
        out.print(plan_table(result.plan))
    out.print(run_summary(result, batch, exact=options.exact_stage_times))
    return 0
