"""``alpajob calibrate``: measure this machine and write the cost model's constants.

Runs the calibration steps (:mod:`alpajob.trainer_image.calibration`) on the devices
JAX sees here (8 forced CPU devices on a machine without GPUs, ``--devices`` to
change), prints the constants beside the preset's stored ones, and writes them with
the machine they came from to ``--output``; ``alpajob plan|run --calibration FILE``
then plans with them.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.cli.paths import writable_file


def add_parser(sub: Any) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine and write the cost model's "
                                           "constants (for plan/run --calibration)")
    cal.add_argument("--output", "-o", default="alpajob-calibration.json",
                     help="write the constants here (default alpajob-calibration.json)")
    cal.add_argument("--steps", help="comma-separated steps to run, in their order: "
                                     "kernels, matmul, host, update, instructions, fusion "
                                     "(default all; on GPUs: kernels,fusion)")
    cal.add_argument("--quick", action="store_true",
                     help="only the micro-benchmarks (kernels, and matmul on CPU devices): "
                          "no training runs")
    cal.add_argument("--preset", help="the preset the constants refine (default: the local "
                                      f"devices' own; {', '.join(p.value for p in DevicePreset)})")
    cal.add_argument("--devices", type=int, default=8,
                     help="forced CPU devices on a machine without GPUs (default 8)")


def _steps(args: argparse.Namespace) -> tuple[str, ...] | None:
    from alpajob.trainer_image.calibration import STEPS

    if args.quick and args.steps:
        raise ManifestError("--steps", "--quick already chooses the steps; pass one of the two")
    if args.quick:
        return None  # calibrate's quick steps for the platform
    if not args.steps:
        return None  # the platform's own (calibrate's default)
    chosen = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    unknown = [s for s in chosen if s not in STEPS]
    if unknown or not chosen:
        raise ManifestError("--steps", f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    return chosen


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from alpajob.trainer_image.devices import force_host_devices

    if args.devices < 1:
        raise ManifestError("--devices", f"{args.devices}: give at least 1 device")
    if args.preset is not None and args.preset not in {p.value for p in DevicePreset}:
        raise ManifestError("--preset", f"unknown preset {args.preset!r}; use one of: "
                                        f"{', '.join(p.value for p in DevicePreset)}")
    steps = _steps(args)
    target = writable_file(args.output, "--output")
    force_host_devices(args.devices)
    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.cost.model import load_calibration
    from alpajob.trainer_image.calibration import calibrate

    with err.status("calibrating") as status:

        def progress(what: str) -> None:
            # A spinner shows nothing in a log (a pod, CI): there, one line per part.
            if err.is_terminal:
                status.update(f"measuring: {what}")
            else:
                err.log(f"measuring: {what}")

        measured = calibrate(steps, args.preset, progress=progress, quick=args.quick)
    stored_cluster = cluster_from_preset(measured.preset, 1, measured.machine.devices)
    stored = load_calibration(measured.preset)
    share = stored_cluster.device.host_share
    table = Table(title=f"{measured.preset}: {measured.machine.describe()}")
    table.add_column("constant")
    table.add_column("stored", justify="right")
    table.add_column("measured", justify="right")
    for name, value in measured.device.items():
        if name == "peak_flops":
            for dtype, rate in value.items():
                table.add_row(f"peak_flops {dtype}",
                              f"{stored_cluster.device.peak(dtype) / share:.4g}", f"{rate:.4g}")
        else:
            before = (stored_cluster.device.memory_bandwidth / share if name == "memory_bandwidth"
                      else getattr(stored_cluster, name))
            table.add_row(name, f"{before:.4g}", f"{value:.4g}")
    for name, value in measured.calibration.items():
        before = getattr(stored, name)
        table.add_row(name, "-" if before is None else f"{before:.4g}", f"{value:.4g}")
    out.print(table)
    target.write_text(measured.to_json(), encoding="utf-8")
    out.print(f"constants written to {target}; plan with them: "
              f"alpajob plan MANIFEST --calibration {target}")
    return 0
