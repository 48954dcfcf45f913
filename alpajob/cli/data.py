"""``alpajob data prepare MANIFEST --output DIR``: tokenize ``spec.data`` once.

Writes ``DIR/train.npy``, ``DIR/eval.npy`` and ``DIR/tokens.json`` with a progress bar,
then prints the ``spec.data`` that reads them (``format: tokens``): paste it into the
manifest, and later starts skip tokenizing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from alpajob.api.errors import ManifestError
from alpajob.api.resource import load_job


def add_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="prepare a job's training data")
    verbs = data.add_subparsers(dest="data_command", required=True)
    prepare = verbs.add_parser("prepare", help="tokenize spec.data once into token files")
    prepare.add_argument("manifest", help="AlpaJob YAML with spec.data")
    prepare.add_argument("--output", "-o", required=True, help="the folder to write the token files to")


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from alpajob.trainer_image.data.prepare import prepare

    job = load_job(args.manifest)
    if job.spec.data is None:
        raise ManifestError("spec.data", "the manifest has no spec.data to prepare")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(split: str, done: int, total: int) -> None:
            if split not in tasks:
                tasks[split] = bar.add_task(f"tokenizing {split}", total=total)
            bar.update(tasks[split], completed=done)

        spec = prepare(job.spec.data, Path(args.output), progress)
    out.print(f"token files written to {args.output}; read them with:", highlight=False, soft_wrap=True)
    out.print(yaml.safe_dump({"spec": {"data": spec}}, sort_keys=False).rstrip(), highlight=False,
              soft_wrap=True)
    return 0
