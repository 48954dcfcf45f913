"""``alpajob plan JOB --what-if SPEC...``: the job planned on every option, one table.

The options and prices are :mod:`alpajob.api.what_if`'s; the planning is
:func:`alpajob.trainer_image.what_if.what_if`'s (one trace, every option through the
plan cache). This module checks the flags, shows a progress bar over the options and
prints the table, or ``--json``'s array of rows; ``--svg`` draws the options' cost and
time (:mod:`alpajob.cli.pareto`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from alpajob.api.errors import ManifestError
from alpajob.api.options import PlanOptions
from alpajob.api.resource import AlpaJob
from alpajob.api.what_if import Choice, WhatIfRow, load_prices, parse_options
from alpajob.cli.paths import writable_file

GIB = 1024**3
#: The table's width where the output is not a terminal.
TABLE_WIDTH = 132
#: Flags of ``alpajob plan`` that name one cluster or one plan's output: each option of
#: ``--what-if`` is its own cluster and plan.
_ONE_PLAN_FLAGS = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "gpu": "--gpu", "output": "--output",
                   "output_configmap": "--output-configmap", "schedule": "--schedule",
                   "baselines": "--baselines", "calibration": "--calibration"}


def add_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--what-if", nargs="+", metavar="SPEC",
                      help="plan the job on each option instead of spec.cluster and print one table: "
                           "PRESET:COUNT[,COUNT...] GPUs each, e.g. h100-80gb:8,16 a100-80gb:16; "
                           "PRESET:COUNT+PRESET:COUNT is one option across GPU types, e.g. "
                           "h100-80gb:8+a100-40gb:16")
    plan.add_argument("--prices", metavar="FILE",
                      help="with --what-if: a YAML of dollars per GPU-hour by preset (date, source, "
                           "perGpuHour) to price each option")
    plan.add_argument("--json", action="store_true", help="with --what-if: print the rows as JSON")


def check_flags(args: argparse.Namespace) -> list[Choice]:
    """The options, after checking that no flag of a single plan is given with them."""
    for name, flag in _ONE_PLAN_FLAGS.items():
        if getattr(args, name, None):
            raise ManifestError(flag, "names one cluster or one plan; leave it out with --what-if "
                                      "(each option is its own cluster)")
    return parse_options(args.what_if)


def run(args: argparse.Namespace, job: AlpaJob, options: PlanOptions, out: Console, err: Console) -> int:
    from alpajob.trainer_image.stopping import Interrupted, interrupted
    from alpajob.trainer_image.what_if import what_if

    choices = check_flags(args)
    prices = load_prices(args.prices, choices) if args.prices else None
    if args.svg:
        writable_file(args.svg, "--svg")
    doing = ["tracing the model"]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("tracing the model", total=len(choices))

        def progress(choice: Choice, index: int, total: int) -> None:
            doing[0] = f"planning {choice.label}"
            bar.update(task, completed=index, description=doing[0])

        try:
            rows = what_if(job, options, choices, prices, progress,
                           warn=lambda line: err.print(line, highlight=False, soft_wrap=True))
        except (Interrupted, KeyboardInterrupt) as error:
            raise interrupted(error, doing[0]) from None
    if args.svg:
        from alpajob.cli.pareto import pareto_svg

        title = f"{job.metadata.name}: {len(rows)} options, cost and time of the whole job"
        Path(args.svg).write_text(pareto_svg(rows, job.spec.training.steps, prices is not None, title),
                                  encoding="utf-8")
        err.print(f"picture written to {args.svg}", soft_wrap=True)
    if args.json:
        out.print_json(json.dumps([row.to_json() for row in rows]))
        return 0
    if not out.is_terminal:  # ten columns: a file or a pipe gets them all unwrapped
        out.width = max(out.width, TABLE_WIDTH)
    out.print(what_if_table(job, rows, priced=prices is not None))
    for row in rows:  # how a mixed option's plan uses its GPU types
        if row.layout:
            out.print(f"{row.option.label}: {row.layout}", highlight=False, soft_wrap=True)
    if prices is not None:
        out.print(f"prices: {args.prices} ({prices.source}, {prices.date})", highlight=False, soft_wrap=True)
    return 0


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _hours(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.01:
        return "<0.01"
    return f"{value:.2f}" if value < 10 else f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def what_if_table(job: AlpaJob, rows: Sequence[WhatIfRow], priced: bool) -> Table:
    """One row per option: devices, step time, throughput, MFU, memory, GPU-hours, dollars."""
    tokens = any(row.tokens_per_second for row in rows)
    steps = job.spec.training.steps
    table = Table(title=f"{job.metadata.name}: {steps} steps of {job.spec.training.global_batch_size} samples",
                  caption="as the planner predicts; memory: the busiest GPU's peak / what one has; "
                          f"GPU-h{' and $ job' if priced else ''}: every step of spec.training.steps")
    columns = ["option", "step", "tok/s" if tokens else "samples/s", "MFU", "memory", "fits", "GPU-h"]
    if priced:
        columns += ["$/h", "$/1e9 tok"] if tokens else ["$/h"]
        columns.append("$ job")
    for column in columns:
        table.add_column(column, justify="left" if column == "option" else "right", no_wrap=column == "option")
    for row in rows:
        option = row.option
        rate = row.tokens_per_second if tokens else row.samples_per_second
        peak = row.peak_memory_bytes if row.fits else row.required_bytes
        memory = f"{'' if row.fits else 'needs '}{(peak or 0.0) / GIB:.1f}/{row.memory_bytes / GIB:.0f} GiB"
        cells = [option.label, _seconds(row.step_seconds), _rate(rate),
                 _num(None if row.mfu is None else row.mfu * 100, ".1f", "%"), memory,
                 "yes" if row.fits else "no", _hours(row.gpu_hours)]
        if priced:
            cells.append(_num(row.dollars_per_hour, ",.2f"))
            if tokens:
                cells.append(_num(row.dollars_per_billion_tokens, ",.2f"))
            cells.append(_num(row.dollars, ",.2f"))
        table.add_row(*cells)
    return table
