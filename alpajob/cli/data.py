"""``alpajob data prepare MANIFEST --output DIR``: tokenize ``spec.data`` once, into token shards.

Writes ``DIR/train/`` and ``DIR/eval/`` (shards of at most ``--shard-size`` and an
``index.json`` each) in parallel processes, with a progress bar (files, ids, ids per
second, time left), then prints the ``spec.data`` that reads them (``format:
tokens``): paste it into the manifest, and later starts skip tokenizing. Run it again
after an interruption to resume: finished shards are kept.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from alpajob.api.errors import ManifestError
from alpajob.api.options import PrepareOptions, from_flags
from alpajob.api.resource import load_job


def _size(text: str) -> int:
    from kubernetes.utils import parse_quantity

    try:
        return int(parse_quantity(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 256Mi or 1Gi") from None


def add_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="prepare a job's training data")
    verbs = data.add_subparsers(dest="data_command", required=True)
    prepare = verbs.add_parser("prepare", help="tokenize spec.data once into token shards (resumable)")
    prepare.add_argument("manifest", help="AlpaJob YAML with spec.data")
    prepare.add_argument("--output", "-o", required=True,
                         help="the folder to write the shards to (run again with the same folder to resume)")
    prepare.add_argument("--shard-size", type=_size, default=None, metavar="SIZE",
                         help="the most bytes of ids per shard, as a quantity (default 256Mi)")
    prepare.add_argument("--workers", type=int, default=None,
                         help="tokenizing processes (default: one per core)")


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from alpajob.trainer_image.data.prepare import Tick, prepare

    job = load_job(args.manifest)
    if job.spec.data is None:
        raise ManifestError("spec.data", "the manifest has no spec.data to prepare")
    options = from_flags(PrepareOptions, {"output": args.output, "shard_size": args.shard_size,
                                          "workers": args.workers})
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TextColumn("{task.fields[files]} files  {task.fields[tokens]:,} ids  {task.fields[rate]}"),
               TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(tick: Tick) -> None:
            if tick.split not in tasks:
                tasks[tick.split] = bar.add_task(f"tokenizing {tick.split}", total=tick.bytes, files="",
                                                 tokens=0, rate="")
            task = tasks[tick.split]
            elapsed = bar.tasks[task].elapsed or 0.0
            rate = f"{tick.tokens / elapsed:,.0f} ids/s" if elapsed > 0 else ""
            bar.update(task, completed=tick.bytes_done, tokens=tick.tokens, rate=rate,
                       files=f"{tick.files_done}/{tick.files}")

        spec = prepare(job.spec.data, options, progress)
    out.print(f"token shards written to {args.output}; read them with:", highlight=False, soft_wrap=True)
    out.print(yaml.safe_dump({"spec": {"data": spec}}, sort_keys=False).rstrip(), highlight=False,
              soft_wrap=True)
    return 0
