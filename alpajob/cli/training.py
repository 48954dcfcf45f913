"""``alpajob run MANIFEST``: plan for this machine's devices (or read ``--plan``) and train.

The flags become one :class:`~alpajob.api.options.TrainOptions` (an invalid one exits
2 naming it), the training runs in :func:`alpajob.trainer_image.local_run.run` with a
progress bar, and the run ends with the plan and a summary of measured against
predicted step time. ``--method serial`` runs the same job on one device (the
reference every parallel run must equal).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
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

from alpajob.api.errors import ManifestError
from alpajob.api.options import PlanOptions, TrainOptions, from_flags
from alpajob.api.plan import Plan
from alpajob.api.progress import Progress
from alpajob.api.resource import load_job
from alpajob.api.runtime import TrainerRuntime
from alpajob.api.spec import Method
from alpajob.cli.paths import (
    add_compile_cache_flags,
    add_plan_cache_flags,
    compile_cache_dir,
    directory,
    existing_file,
    plan_cache_dir,
    writable_file,
)
from alpajob.cli.planning import calibration_file
from alpajob.cli.tables import plan_summary, plan_table, progress_line, run_summary
from alpajob.trainer_image.devices import force_host_devices
from alpajob.trainer_image.forced_count import choose_cached, make_forced_devices, may_choose

SERIAL = "serial"


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="plan (or read --plan) and train on this machine's devices")
    run.add_argument("manifest", help="AlpaJob YAML (the same file you kubectl apply)")
    run.add_argument("--plan", help="a Plan file from `alpajob plan --output` (default: plan now)")
    run.add_argument("--steps", type=int, help="steps to train (default spec.training.steps)")
    run.add_argument("--seed", type=int, help="parameter and data seed (default spec.training.seed)")
    run.add_argument("--devices", type=int,
                     help="how many local devices to use (on CPU: the forced device count; default 8, "
                          "or for an auto job on a CPU host the count of up to 8 predicted fastest)")
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
    run.add_argument("--keep-plan", action="store_true",
                     help="on forced CPU devices, run an auto job's plan even if one device is "
                          "faster (by default a few steps of each are timed and the faster kept)")
    run.add_argument("--trace", metavar="FILE",
                     help="time the last step and write its measured timeline beside the plan's "
                          "predicted one (Chrome trace JSON: open it in ui.perfetto.dev)")
    run.add_argument("--checkpoint-dir", help="save sharded checkpoints here")
    run.add_argument("--checkpoint-every", type=int,
                     help="checkpoint every N steps and at the end (default spec.checkpoint.intervalSteps; "
                          "without spec.checkpoint, at the end only)")
    run.add_argument("--keep-last", type=int, metavar="N",
                     help="complete checkpoints kept (default spec.checkpoint.keepLast, else 3)")
    run.add_argument("--sync-checkpoints", action="store_true",
                     help="training waits for every checkpoint save (default: saved in the background)")
    run.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                     help="continue from the newest checkpoint in --checkpoint-dir (an error if there "
                          "is none); --resume=auto: if there is one, else start fresh")
    run.add_argument("--metrics-linger", type=float, metavar="S",
                     help="with --metrics-port: keep /metrics up S seconds after the last step, for "
                          "the final scrape (default 15)")
    run.add_argument("--log-every", type=int, default=10, metavar="N",
                     help="when stderr is not a terminal (a pod's log): one line every N steps "
                          "(default 10)")
    run.add_argument("--prefetch", type=int, default=2, metavar="N",
                     help="batches of spec.data a background thread keeps ready (default 2; 0: none)")
    run.add_argument("--all-devices", action="store_true",
                     help="plan on every device offered, even forced CPU devices where one is "
                          "predicted faster (Alpa's rule)")
    run.add_argument("--calibration", metavar="FILE",
                      help="plan with the constants `alpajob calibrate` measured (default: the "
                           "preset's stored ones)")
    run.add_argument("--plan-time-limit", type=float, default=1800.0, metavar="S",
                      help="seconds tracing and planning may take before they stop with an error "
                           "(default 1800)")
    run.add_argument("--ilp-time-limit", type=float, default=None, metavar="S",
                     help="seconds allowed to each intra-op ILP solve (default "
                           "spec.planner.ilpTimeLimitSeconds, 10 unless set)")
    add_plan_cache_flags(run)
    add_compile_cache_flags(run)


def metrics_linger(args: argparse.Namespace) -> float | None:
    """``--metrics-linger`` (default 15 s with ``--metrics-port``); given without a port
    it would do nothing, so it is an error."""
    if args.metrics_port is None:
        if args.metrics_linger is not None:
            raise ManifestError("--metrics-linger", "only keeps /metrics up, and there is no "
                                "--metrics-port; give one or drop --metrics-linger")
        return None
    return 15.0 if args.metrics_linger is None else args.metrics_linger


def train_options(args: argparse.Namespace, calibration: str | None = None) -> TrainOptions:
    """The flags as :class:`TrainOptions`; an invalid one is an error naming it;
    ``calibration``: the file of :func:`~.planning.calibration_file`."""
    serial = args.method == SERIAL
    planning = from_flags(PlanOptions, {
        "method": None if serial else args.method, "ilp_time_limit": args.ilp_time_limit,
        "plan_time_limit": args.plan_time_limit,
        "all_devices": args.all_devices or None,
        "calibration": calibration,
        "cache_dir": plan_cache_dir(args)})
    options = from_flags(TrainOptions, {
        "steps": args.steps, "seed": args.seed, "devices": args.devices, "serial": serial or None,
        "plan_file": args.plan, "planning": planning, "metrics_out": args.metrics_out,
        "metrics_port": args.metrics_port, "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every, "keep_last": args.keep_last,
        "sync_checkpoints": args.sync_checkpoints or None,
        "resume": {"yes": True, "auto": "auto"}.get(args.resume or ""),
        "metrics_linger": metrics_linger(args),
        "exact_stage_times": args.exact_stage_times or None,
        "stage_times_every": args.stage_times_every, "prefetch": args.prefetch,
        "trace": args.trace, "keep_plan": args.keep_plan or None,
        "compile_cache_dir": compile_cache_dir(args),
    })
    if options.plan_file:
        existing_file(options.plan_file, "--plan")
    if options.metrics_out:
        writable_file(options.metrics_out, "--metrics-out")
    if options.trace:
        writable_file(options.trace, "--trace")
    if options.checkpoint_dir:
        directory(options.checkpoint_dir, "--checkpoint-dir")
    return options


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    job = load_job(args.manifest)
    calibration, note = calibration_file(args, TrainerRuntime(), job)
    if note:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    options = train_options(args, calibration)
    if args.log_every < 1:
        raise ManifestError("--log-every", f"must be at least 1, got {args.log_every}")
    from alpajob.trainer_image.stopping import Interrupted, exit_code, interrupted

    if may_choose(job, options):  # forced CPU devices: as many as plan fastest
        try:
            choice = choose_cached(job, options, warn=lambda line: err.print(line, highlight=False, soft_wrap=True))
        except (Interrupted, KeyboardInterrupt) as error:
            raise interrupted(error, "choosing the forced device count") from None
        make_forced_devices(choice.devices)
        out.print(choice.line(), highlight=False, soft_wrap=True)
    force_host_devices(options.devices)  # before JAX is imported (else a no-op)
    from alpajob.trainer_image.local_run import run as train

    doing = ["starting"]  # what the run does (its phases), for a stop outside training

    def track(on_phase: Callable[[str], None]) -> Callable[[str], None]:
        def phase(what: str) -> None:
            if not what.startswith(("data: ", "plan: ", "trace: ", "compile cache: ")):  # reports, not activities
                doing[0] = what
            on_phase(what)

        return phase

    steps = options.steps or job.spec.training.steps
    batch = job.spec.training.global_batch_size

    def on_plan(plan: Plan) -> None:  # the plan before training, not after
        out.print(plan_table(plan))
        out.print(plan_summary(plan), highlight=False)

    if err.is_terminal:
        with ProgressBar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                         MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                         TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("starting", total=steps, status="")

            def on_phase(what: str) -> None:
                if what.startswith("data: "):  # what the run trains on stays on the screen
                    bar.console.print(what, highlight=False, soft_wrap=True)
                bar.update(task, description=what)

            def on_step(report: Progress) -> None:
                bar.update(task, completed=report.step, description="training",
                           status=progress_line(report, steps=False))

            try:
                result = train(job, options, on_step=on_step, on_phase=track(on_phase), on_plan=on_plan)
            except (Interrupted, KeyboardInterrupt) as error:
                raise interrupted(error, doing[0]) from None
    else:  # a pod's log, a pipe: plain lines, each flushed
        log = LogLines(err, args.log_every, steps)
        try:
            result = train(job, options, on_step=log.step, on_phase=track(log.phase), on_plan=on_plan)
        except (Interrupted, KeyboardInterrupt) as error:
            raise interrupted(error, doing[0]) from None
    out.print(run_summary(result, batch, exact=options.exact_stage_times))
    if result.stopped:
        saved = (f"checkpoint of step {result.last_checkpoint_step} in {options.checkpoint_dir}; continue "
                 "with --resume" if result.last_checkpoint_step else "no --checkpoint-dir, nothing saved")
        err.print(f"stopped by {result.stopped} after step {result.start_step + len(result.losses)}: {saved}",
                  highlight=False, soft_wrap=True)
        return exit_code(result.stopped)
    return 0


class LogLines:
    """Progress as plain lines (stderr not a terminal): every phase, and one line every
    ``every`` steps with the step, loss, eval loss, tokens/s, MFU and the time left."""

    def __init__(self, console: Console, every: int, steps: int) -> None:
        self.console, self.every, self.steps = console, every, steps
        self.started = time.monotonic()
        self.first: int | None = None

    def phase(self, what: str) -> None:
        self.console.print(what, highlight=False, soft_wrap=True)

    def step(self, report: Progress) -> None:
        if self.first is None:
            self.first, self.started = report.step, time.monotonic()
        if report.step % self.every and report.step != self.steps:
            return
        done = report.step - self.first + 1
        left = (time.monotonic() - self.started) / done * (self.steps - report.step)
        extra = [f"mfu {report.mfu:.1%}"] if report.mfu is not None else []
        if report.tokens_per_second is not None:
            extra.append(f"{report.tokens_per_second:,.0f} tokens/s")
        self.console.print(f"{progress_line(report)}  {'  '.join(extra)}  eta {left:,.0f} s",
                           highlight=False, soft_wrap=True)
