"""The ``alpajob`` subcommands that the trainer image runs in a cluster.

- ``alpajob ray-head``: start the job's Ray head (foreground, as a pod's main process);
- ``alpajob mesh-worker``: join the job's Ray cluster as host ``--host`` of mesh
  ``--mesh`` (foreground), offering the resource that pins that host's actor to it; a
  raylet that fails to start is started again (:mod:`~alpajob.trainer_image.distributed.raylet`);
- ``alpajob wait-for-head``: return once the job's Ray head accepts connections (a mesh
  pod's init container);
- ``alpajob driver [MANIFEST]``: wait for every mesh host, then train the plan across
  them (:mod:`alpajob.trainer_image.distributed.driver`).

Every flag defaults to the runtime contract the operator puts into the pod's
environment (:class:`~alpajob.api.runtime.TrainerRuntime`, read by ``from_env``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from alpajob.api.errors import ManifestError
from alpajob.api.names import Role
from alpajob.api.plan import Plan, read_plan
from alpajob.api.progress import Progress
from alpajob.api.resource import load_job
from alpajob.api.runtime import HOLD_FILE_ENV, RAY_PORT, RELEASE_FILE_ENV, TrainerRuntime, Transport
from alpajob.api.wording import counted
from alpajob.cli.tables import progress_line
from alpajob.trainer_image.distributed import cluster as ray_cluster

if TYPE_CHECKING:
    from alpajob.trainer_image.distributed.driver import DriverOptions

_ENV = TrainerRuntime.env_name


def add_parsers(sub: Any) -> None:
    """Register ray-head, mesh-worker and driver on the subparsers ``sub``."""
    head = sub.add_parser("ray-head", help="start the job's Ray head (foreground)")
    head.add_argument("--port", type=int, help=f"GCS port (default ${_ENV('ray_port')} or {RAY_PORT})")
    head.add_argument("--temp-dir", help="Ray's session directory (default Ray's own)")
    worker = sub.add_parser("mesh-worker", help="join the job's Ray cluster as one mesh host (foreground)")
    worker.add_argument("--address", help=f"the head's host:port (default ${_ENV('ray_address')})")
    worker.add_argument("--mesh", type=int, help=f"mesh index (default ${_ENV('mesh')})")
    worker.add_argument("--host", type=int, help=f"host index in the mesh (default ${_ENV('host')} or 0)")
    worker.add_argument("--devices", type=int,
                        help=f"on CPU: force this many host devices (default ${_ENV('devices')})")
    wait = sub.add_parser("wait-for-head", help="wait until the job's Ray head accepts connections "
                                                "(a mesh pod's init container)")
    wait.add_argument("--address", help=f"the head's host:port (default ${_ENV('ray_address')})")
    wait.add_argument("--timeout", type=float, default=600.0,
                      help="seconds to wait before failing (exit 3; default 600)")
    driver = sub.add_parser("driver", help="train a plan across the mesh hosts of the job's Ray cluster")
    driver.add_argument("manifest", nargs="?", help=f"AlpaJob YAML (default ${_ENV('manifest')})")
    driver.add_argument("--plan", help=f"the Plan file (`alpajob plan --output`; default ${_ENV('plan')})")
    driver.add_argument("--address", help=f"the head's host:port (default ${_ENV('ray_address')})")
    driver.add_argument("--head-port", type=int,
                        help="start the job's Ray head here first (port P) and drive through it; "
                             f"stop it at the end (the head pod of a job; default ${_ENV('ray_port')})")
    driver.add_argument("--steps", type=int, help="steps to train (default spec.training.steps)")
    driver.add_argument("--seed", type=int, help="parameter and data seed (default spec.training.seed)")
    driver.add_argument("--join-timeout", type=float,
                        help=f"seconds to wait for every mesh host (default ${_ENV('join_timeout')} or 120)")
    driver.add_argument("--metrics-out", help="write per-step losses and step seconds (JSON) here")
    driver.add_argument("--checkpoint-dir",
                        help=f"shared directory every mesh writes its checkpoint part to (default "
                             f"${_ENV('checkpoint_dir')}); a restart resumes from the newest "
                             "complete checkpoint there")
    driver.add_argument("--checkpoint-every", type=int,
                        help=f"checkpoint every N steps and at the end (default ${_ENV('checkpoint_every')})")
    driver.add_argument("--keep-last", type=int, metavar="N",
                        help="complete checkpoints kept (default spec.checkpoint.keepLast, else 3)")
    driver.add_argument("--sync-checkpoints", action="store_true",
                        help="training waits for every checkpoint save (default spec.checkpoint.asyncSave: "
                             "saved in the background)")
    driver.add_argument("--max-restarts", type=int, default=3,
                        help="restarts of every mesh after a host dies or hangs before the job fails (default 3)")
    driver.add_argument("--step-timeout", type=float, default=600.0,
                        help="seconds a step (or a checkpoint) may take before the hosts count as hung (default 600)")
    driver.add_argument("--transport", choices=[t.value for t in Transport],
                        help="how activations and gradients cross between meshes: the Ray object store, or "
                             "XLA collectives over one JAX process group of every mesh host (gloo on CPU, "
                             f"NCCL on GPU) (default ${_ENV('transport')}, else spec.parallelism.transport, else "
                             "collective on a GPU pool and object-store on cpu, where collectives make no "
                             "step faster)")
    driver.add_argument("--metrics-port", type=int,
                        help=f"serve Prometheus /metrics here (default ${_ENV('metrics_port')}; none if unset)")
    driver.add_argument("--status-configmap", metavar="NAMESPACE/NAME",
                        help=f"also keep the progress in this ConfigMap (default ${_ENV('progress_configmap')})")
    driver.add_argument("--status-file", help="keep the job's progress (JSON: phase, step, loss, samples/s, "
                                              "checkpoint step, restarts) in this file")


def _runtime() -> TrainerRuntime:
    return TrainerRuntime.from_env(os.environ)


def _address(args: argparse.Namespace, runtime: TrainerRuntime) -> str:
    address = args.address or runtime.ray_address
    if not address:
        raise ManifestError("--address", f"give the Ray head's host:port (or set ${_ENV('ray_address')})")
    return address


def cmd_ray_head(args: argparse.Namespace) -> int:
    runtime = _runtime()
    port = args.port or runtime.ray_port or RAY_PORT
    command = ray_cluster.head_command(port, args.temp_dir, block=True,
                                       object_store_bytes=runtime.object_store_bytes)
    return ray_cluster.run_command(command, ray_cluster.ray_env())


def worker_settings(args: argparse.Namespace, runtime: TrainerRuntime) -> tuple[str, int, int, int | None]:
    """The mesh worker's head address, mesh, host and forced device count: the flags,
    else the runtime contract."""
    mesh = args.mesh if args.mesh is not None else runtime.mesh
    if mesh is None or mesh < 0:
        raise ManifestError("--mesh", f"give this worker's mesh index >= 0 (or set ${_ENV('mesh')})")
    host = args.host if args.host is not None else (runtime.host or 0)
    devices = args.devices if args.devices is not None else runtime.devices
    if devices is not None and devices < 1:
        raise ManifestError("--devices", f"must be at least 1, got {devices}")
    return _address(args, runtime), mesh, host, devices


def check_mesh_data(runtime: TrainerRuntime, mesh: int, out: Console) -> None:
    """A mesh pod's pre-flight, before Ray starts: the data its stage reads (the first
    stage's inputs, the last stage's labels; a middle stage reads nothing) is there
    (:func:`~alpajob.trainer_image.data.corpus.check_present`). A ManifestError (exit
    2: the pod's first line, the job Failed) says which field names what is missing."""
    if not runtime.manifest or not Path(runtime.manifest).is_file():
        return  # started by hand: the driver's hosts say it when they read
    job = load_job(runtime.manifest)
    if job.spec.data is None:
        return
    if runtime.plan and Path(runtime.plan).is_file():
        last = len(read_plan(runtime.plan).stages) - 1
        if mesh not in (0, last):
            return
    from alpajob.trainer_image.data.corpus import check_present

    for warning in check_present(job.spec.data):
        out.print(f"warning: {warning}")


def cmd_mesh_worker(args: argparse.Namespace, out: Console) -> int:
    from alpajob.trainer_image.distributed.raylet import run_raylet

    runtime = _runtime()
    address, mesh, host, devices = worker_settings(args, runtime)
    check_mesh_data(runtime, mesh, out)  # what cannot succeed later fails now, before Ray starts
    command = ray_cluster.worker_command(address, mesh, host, block=True,
                                         object_store_bytes=runtime.object_store_bytes)
    released = Path(tempfile.gettempdir()) / f"alpajob-released-{os.getpid()}"
    hold = Path(tempfile.gettempdir()) / f"alpajob-hold-{os.getpid()}"
    for marker in (released, hold):
        marker.unlink(missing_ok=True)
    from alpajob.trainer_image.compile_cache import compile_cache_env

    cache = compile_cache_env(runtime.compile_cache, lambda line: out.print(f"warning: {line}"))
    env = {**ray_cluster.ray_env(devices), **cache, RELEASE_FILE_ENV: str(released), HOLD_FILE_ENV: str(hold)}
    try:
        return run_raylet(command, env, out.print, released=released, hold=hold, head=address)
    finally:
        for marker in (released, hold):
            marker.unlink(missing_ok=True)


def cmd_wait_for_head(args: argparse.Namespace, out: Console) -> int:
    from alpajob.trainer_image.distributed.raylet import wait_for_head

    if args.timeout <= 0:
        raise ManifestError("--timeout", f"must be positive, got {args.timeout}")
    address = _address(args, _runtime())
    waited = wait_for_head(address, args.timeout, out.print)
    out.print(f"the Ray head at {address} answers (after {waited:.1f} s)")
    return 0


@dataclass(frozen=True)
class DriverRun:
    """What ``alpajob driver`` will do: the job's manifest, its plan, the driver's
    options, and the port of a Ray head to start first (a job's head pod starts its own)."""

    manifest: str
    plan: Plan
    head_port: int | None
    options: DriverOptions


def driver_run(args: argparse.Namespace, runtime: TrainerRuntime) -> DriverRun:
    """The flags, else the runtime contract, as a :class:`DriverRun`; an invalid
    value is an error naming its flag."""
    from alpajob.trainer_image.distributed.driver import DriverOptions  # imports JAX and Ray

    manifest = args.manifest or runtime.manifest
    plan_path = args.plan or runtime.plan
    if not manifest:
        raise ManifestError("manifest", f"give the AlpaJob manifest (or set ${_ENV('manifest')})")
    if not plan_path:
        raise ManifestError("--plan", f"give the Plan file (or set ${_ENV('plan')})")
    job = load_job(manifest)
    training, saves = job.spec.training, job.spec.checkpoint
    plan = read_plan(plan_path)
    steps = args.steps if args.steps is not None else training.steps
    if steps < 1:
        raise ManifestError("--steps", f"must be at least 1, got {steps}")
    head_port = args.head_port or (runtime.ray_port if runtime.role is Role.HEAD else None)
    address = f"127.0.0.1:{head_port}" if head_port else _address(args, runtime)
    options = DriverOptions(
        address=address,
        steps=steps,
        seed=args.seed if args.seed is not None else training.seed,
        join_timeout=args.join_timeout or runtime.join_timeout or 120.0,
        step_timeout=args.step_timeout,
        metrics_out=args.metrics_out,
        checkpoint_dir=args.checkpoint_dir or runtime.checkpoint_dir,
        checkpoint_every=args.checkpoint_every if args.checkpoint_every is not None else runtime.checkpoint_every,
        checkpoint_keep_last=args.keep_last if args.keep_last is not None else (saves.keep_last if saves else 3),
        checkpoint_async=not args.sync_checkpoints and (saves.async_save if saves else True),
        max_restarts=args.max_restarts,
        metrics_port=args.metrics_port if args.metrics_port is not None else runtime.metrics_port,
        status_file=args.status_file,
        status_configmap=args.status_configmap or runtime.progress_configmap,
        transport=Transport(args.transport or runtime.transport or Transport.from_spec(job.spec.parallelism.transport)
                            or Transport.default_for(plan.cluster.get("preset") or job.spec.cluster.gpu or "cpu")),
        attempt=runtime.attempt if runtime.role is Role.HEAD else None,
        checkpoint_volume=runtime.checkpoint_volume,
        release_hosts=bool(head_port),  # this driver's head is the job's cluster: it ends with the job
    )
    if options.checkpoint_every is not None and options.checkpoint_every < 1:
        raise ManifestError("--checkpoint-every", f"must be at least 1, got {options.checkpoint_every}")
    if options.checkpoint_keep_last < 1:
        raise ManifestError("--keep-last", f"must be at least 1, got {options.checkpoint_keep_last}")
    if options.max_restarts < 0:
        raise ManifestError("--max-restarts", f"must be at least 0, got {options.max_restarts}")
    return DriverRun(manifest, plan, head_port, options)


def cmd_driver(args: argparse.Namespace, out: Console) -> int:
    from alpajob.trainer_image.distributed.driver import drive
    from alpajob.trainer_image.stopping import exit_code

    run = driver_run(args, _runtime())
    plan, options = run.plan, run.options
    if options.checkpoint_dir:  # what cannot succeed later fails now, before Ray starts
        from alpajob.trainer_image.checkpoint.lock import check_writable

        check_writable(options.checkpoint_dir, options.checkpoint_volume)

    def on_step(report: Progress) -> None:
        out.print(progress_line(report))

    def on_event(what: str) -> None:
        out.print(f"[yellow]{what}[/yellow]")

    if run.head_port:
        command = ray_cluster.head_command(run.head_port, None, block=False,
                                           object_store_bytes=_runtime().object_store_bytes)
        subprocess.run(command, env=ray_cluster.ray_env(), check=True)
    try:
        result = drive(Path(run.manifest).read_text(), plan, options, on_step=on_step, on_event=on_event)
    finally:
        if run.head_port:
            subprocess.run([ray_cluster.ray_binary(), "stop"], env=ray_cluster.ray_env(), check=False)
    if result.stopped:
        out.print(f"stopped by {result.stopped} after {counted(result.step, 'step')}; last checkpoint step "
                  f"{result.checkpoint_step} (a restart resumes from it)")
        return exit_code(result.stopped)
    out.print(f"done: {counted(result.step, 'step')}, final loss {result.losses[-1]:.4f}, "
              f"{counted(result.restarts, 'restart')}, last checkpoint step {result.checkpoint_step}")
    return 0


def dispatch(args: argparse.Namespace, out: Console) -> int | None:
    """Run the command if it is one of ours; None otherwise."""
    if args.command == "ray-head":
        return cmd_ray_head(args)
    if args.command == "mesh-worker":
        return cmd_mesh_worker(args, out)
    if args.command == "wait-for-head":
        return cmd_wait_for_head(args, out)
    if args.command == "driver":
        return cmd_driver(args, out)
    return None
