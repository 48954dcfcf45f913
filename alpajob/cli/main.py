"""The ``alpajob`` console script.

Subcommands (one module each):

- ``alpajob plan MANIFEST`` (:mod:`.planning`): trace, plan, print the plan, write it;
- ``alpajob run MANIFEST`` (:mod:`.training`): plan for this machine and train;
- ``alpajob data prepare MANIFEST`` (:mod:`.data`): tokenize ``spec.data`` once;
- ``alpajob calibrate`` (:mod:`.calibrate`): measure this machine, write the cost
  model's constants (``plan``/``run --calibration FILE`` use them);
- ``alpajob ray-head`` / ``mesh-worker`` / ``driver`` (:mod:`.ray`): the distributed
  runtime's processes inside a job's Ray cluster;
- ``alpajob operator`` (:mod:`.operator`): the Kubernetes operator;
- ``alpajob models``: the zoo's named configurations;
- ``alpajob schema``: the Plan document's JSON schema;
- ``alpajob crd``: the AlpaJob CustomResourceDefinition (generated from the typed spec);
- ``alpajob dashboard``: the Grafana dashboard (built with Grafana's typed builders).

User errors (a bad manifest or flag, an impossible cluster, a model that does not fit)
print one line naming the problem and the fix and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from importlib import metadata

from rich.console import Console
from rich.text import Text

from alpajob.api.errors import AlpaJobError
from alpajob.cli import calibrate, data, planning, ray, training
from alpajob.cli import operator as operator_cli


def parser() -> argparse.ArgumentParser:
    """The ``alpajob`` command line: every subcommand's parser (the CLI reference page
    is generated from it)."""
    root = argparse.ArgumentParser(
        prog="alpajob",
        description="Alpa's automatic inter- and intra-operator parallelism on stock JAX.",
    )
    root.add_argument("--version", action="version", version=f"alpajob {metadata.version('alpajob')}",
                      help="print the installed version and exit")
    sub = root.add_subparsers(dest="command", required=True)
    planning.add_parser(sub)
    training.add_parser(sub)
    data.add_parser(sub)
    calibrate.add_parser(sub)
    ray.add_parsers(sub)
    operator_cli.add_parser(sub)
    sub.add_parser("models", help="list the zoo's named model configurations")
    sub.add_parser("schema", help="print the Plan document's JSON schema")
    crd = sub.add_parser("crd", help="print the AlpaJob CustomResourceDefinition (YAML)")
    crd.add_argument("--output", "-o", action="append",
                     help="write it to this file instead (repeatable: manifests/ and the chart)")
    board = sub.add_parser("dashboard", help="print the AlpaJob Grafana dashboard (JSON)")
    board.add_argument("--output", "-o", help="write it to this file instead "
                                              "(the chart's: charts/alpajob/files/grafana-dashboard.json)")
    return root


def _models(out: Console) -> int:
    from alpajob.trainer_image.zoo import list_models

    for name in list_models():
        out.print(name)
    return 0


def _crd(args: argparse.Namespace) -> int:
    from pathlib import Path

    from alpajob.api.crd import crd_yaml

    text = crd_yaml()
    for path in args.output or ():
        Path(path).write_text(text)
    if not args.output:
        sys.stdout.write(text)
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from pathlib import Path

    from alpajob.operator.dashboard import dashboard_json

    text = dashboard_json()
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _dispatch(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.command == "plan":
        return planning.run(args, out, err)
    if args.command == "run":
        return training.run(args, out, err)
    if args.command == "data":
        return data.run(args, out, err)
    if args.command == "calibrate":
        return calibrate.run(args, out, err)
    if args.command == "operator":
        return operator_cli.run(args)
    if args.command == "models":
        return _models(out)
    if args.command == "schema":
        from alpajob.api.plan import plan_json_schema

        print(json.dumps(plan_json_schema(), indent=2))
        return 0
    if args.command == "crd":
        return _crd(args)
    if args.command == "dashboard":
        return _dashboard(args)
    done = ray.dispatch(args, out)
    return 1 if done is None else done


def note_termination(line: str) -> None:
    """Write ``line`` as this container's termination message, where its pod names the
    file (:func:`~alpajob.trainer_image.publish.write_termination_message`): the
    kubelet reports it as the pod's message, which the job's condition and event lead
    with. Outside a pod, nothing."""
    from alpajob.trainer_image.publish import write_termination_message

    write_termination_message(line)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; returns the exit status."""
    args = parser().parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    from alpajob.trainer_image.stopping import Interrupted, SignalsRaise, interrupted

    try:
        with SignalsRaise():  # SIGTERM unwinds like Ctrl-C (trainer_image.stopping)
            return _dispatch(args, out, err)
    except AlpaJobError as error:
        # The message is plain text: "[n, 4]" in it must not be read as rich markup.
        err.print(Text.assemble(("error:", "bold red"), f" {error}"), highlight=False, soft_wrap=True)
        note_termination(f"error: {error}")
        return error.exit_code
    except (Interrupted, KeyboardInterrupt) as error:
        stop = interrupted(error, "")
        err.print(stop.line(), highlight=False, soft_wrap=True)
        note_termination(stop.line())
        return stop.exit_code
    except Exception as error:  # a bug: Python prints the traceback; the pod's message is its last line
        note_termination(f"error: {type(error).__name__}: {error}")
        raise


def entry() -> None:
    """The ``alpajob`` console script: :func:`main`, then exit without the final
    garbage collection. An interpreter that exits collects every object it still
    holds, and a command that planned holds the op graph and the ILP caches: about
    0.3 s of a tiny model's 3 s ``alpajob plan`` (measured on 2 cores), for memory
    the exit returns anyway. Frozen objects are left out of that collection;
    exit handlers still run. (Only here, never in :func:`main`: tests call it many
    times in one process.)"""
    status = main()
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    entry()
