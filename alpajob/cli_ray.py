"""The ``alpajob`` subcommands that the trainer image runs in a cluster.

- ``alpajob ray-head``: start the job's Ray head (foreground, as a pod's main process);
- ``alpajob mesh-worker``: join the job's Ray cluster as host ``--host`` of mesh
  ``--mesh`` (foreground), offering the resource that pins that host's actor to it;
- ``alpajob driver MANIFEST``: wait for every mesh host, then train the plan across
  them (:mod:`alpajob.trainer.distributed.driver`).

Every flag defaults to the environment variable the operator sets (listed in
:mod:`alpajob.trainer.distributed.cluster`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from alpajob.planner.errors import ManifestError
from alpajob.trainer.distributed import cluster as ray_cluster


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ManifestError(name, f"must be an integer, got {value!r}") from None


def add_parsers(sub: Any) -> None:
    """Register ray-head, mesh-worker and driver on the subparsers ``sub``."""
    head = sub.add_parser("ray-head", help="start the job's Ray head (foreground)")
    head.add_argument("--port", type=int, help=f"GCS port (default ${ray_cluster.ENV_PORT} or 6379)")
    head.add_argument("--temp-dir", help="Ray's session directory (default Ray's own)")
    worker = sub.add_parser("mesh-worker", help="join the job's Ray cluster as one mesh host (foreground)")
    worker.add_argument("--address", help=f"the head's host:port (default ${ray_cluster.ENV_ADDRESS})")
    worker.add_argument("--mesh", type=int, help=f"mesh index (default ${ray_cluster.ENV_MESH})")
    worker.add_argument("--host", type=int, help=f"host index in the mesh (default ${ray_cluster.ENV_HOST} or 0)")
    worker.add_argument("--devices", type=int,
                        help=f"on CPU: force this many host devices (default ${ray_cluster.ENV_DEVICES})")
    driver = sub.add_parser("driver", help="train a plan across the mesh hosts of the job's Ray cluster")
    driver.add_argument("manifest", help="AlpaJob YAML")
    driver.add_argument("--plan", required=True, help="the Plan file (`alpajob plan --output`)")
    driver.add_argument("--address", help=f"the head's host:port (default ${ray_cluster.ENV_ADDRESS})")
    driver.add_argument("--head-port", type=int,
                        help="start the job's Ray head here first (port P) and drive through it; "
                             "stop it at the end (the head pod of a job runs this)")
    driver.add_argument("--steps", type=int, help="steps to train (default spec.training.steps)")
    driver.add_argument("--seed", type=int, help="parameter and data seed (default spec.training.seed)")
    driver.add_argument("--join-timeout", type=float,
                        help=f"seconds to wait for every mesh host (default ${ray_cluster.ENV_JOIN_TIMEOUT} or 120)")
    driver.add_argument("--metrics-out", help="write per-step losses and step seconds (JSON) here")
    driver.add_argument("--checkpoint-dir",
                        help=f"shared directory every mesh writes its checkpoint part to (default ${ray_cluster.ENV_CHECKPOINT_DIR}); "
                             "a restart resumes from the newest complete checkpoint there")
    driver.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (and at the end)")
    driver.add_argument("--max-restarts", type=int, default=3,
                        help="restarts of every mesh after a host dies or hangs before the job fails (default 3)")
    driver.add_argument("--step-timeout", type=float, default=600.0,
                        help="seconds a step (or a checkpoint) may take before the hosts count as hung (default 600)")
    driver.add_argument("--transport", choices=["object-store", "collective"],
                        help="how activations and gradients cross between meshes: the Ray object store, or "
                             "XLA collectives over one JAX process group of every mesh host (gloo on CPU, "
                             f"NCCL on GPU; not yet run on a GPU) (default ${ray_cluster.ENV_TRANSPORT} "
                             "or object-store)")
    driver.add_argument("--metrics-port", type=int,
                        help=f"serve Prometheus /metrics here (default ${ray_cluster.ENV_METRICS_PORT}; none if unset)")
    driver.add_argument("--status-configmap", metavar="NAMESPACE/NAME",
                        help="also keep the progress in this ConfigMap (progress.json; a job's head pod)")
    driver.add_argument("--status-file", help="keep the job's progress (JSON: phase, step, loss, samples/s, "
                                              "checkpoint step, restarts) in this file")


def _address(args: argparse.Namespace) -> str:
    if getattr(args, "head_port", None):
        return f"127.0.0.1:{args.head_port}"
    address = args.address or os.environ.get(ray_cluster.ENV_ADDRESS)
    if not address:
        raise ManifestError("--address", f"give the Ray head's host:port (or set ${ray_cluster.ENV_ADDRESS})")
    return address


def _transport(value: str) -> Any:
    from alpajob.trainer.distributed.mesh_host import Transport

    try:
        return Transport(value)
    except ValueError:
        choices = ", ".join(t.value for t in Transport)
        raise ManifestError("--transport", f"unknown transport {value!r}; use one of {choices}") from None


def cmd_ray_head(args: argparse.Namespace) -> int:
    port = args.port or _env_int(ray_cluster.ENV_PORT) or 6379
    command = ray_cluster.head_command(port, args.temp_dir, block=True)
    return ray_cluster.run_command(command, ray_cluster.ray_env())


def cmd_mesh_worker(args: argparse.Namespace) -> int:
    mesh = args.mesh if args.mesh is not None else _env_int(ray_cluster.ENV_MESH)
    if mesh is None or mesh < 0:
        raise ManifestError("--mesh", f"give this worker's mesh index >= 0 (or set ${ray_cluster.ENV_MESH})")
    host = args.host if args.host is not None else (_env_int(ray_cluster.ENV_HOST) or 0)
    devices = args.devices if args.devices is not None else _env_int(ray_cluster.ENV_DEVICES)
    if devices is not None and devices < 1:
        raise ManifestError("--devices", f"must be at least 1, got {devices}")
    command = ray_cluster.worker_command(_address(args), mesh, host, block=True)
    return ray_cluster.run_command(command, ray_cluster.ray_env(devices))


def cmd_driver(args: argparse.Namespace, out: Console) -> int:
    from alpajob.planner.manifest import load_manifest
    from alpajob.planner.plan import read_plan
    from alpajob.trainer.distributed.driver import DriverOptions, drive

    manifest = load_manifest(args.manifest)
    training = manifest.spec.training
    plan = read_plan(args.plan)
    steps = args.steps if args.steps is not None else training.steps
    if steps < 1:
        raise ManifestError("--steps", f"must be at least 1, got {steps}")
    timeout = args.join_timeout
    if timeout is None:
        timeout = float(os.environ.get(ray_cluster.ENV_JOIN_TIMEOUT, "120"))
    options = DriverOptions(
        address=_address(args),
        steps=steps,
        seed=args.seed if args.seed is not None else training.seed,
        join_timeout=timeout,
        step_timeout=args.step_timeout,
        metrics_out=args.metrics_out,
        checkpoint_dir=args.checkpoint_dir or os.environ.get(ray_cluster.ENV_CHECKPOINT_DIR) or None,
        checkpoint_every=args.checkpoint_every,
        max_restarts=args.max_restarts,
        metrics_port=args.metrics_port if args.metrics_port is not None else _env_int(ray_cluster.ENV_METRICS_PORT),
        status_file=args.status_file,
        status_configmap=args.status_configmap,
        transport=_transport(args.transport or os.environ.get(ray_cluster.ENV_TRANSPORT) or "object-store"),
    )
    if options.checkpoint_every is not None and options.checkpoint_every < 1:
        raise ManifestError("--checkpoint-every", f"must be at least 1, got {options.checkpoint_every}")
    if options.max_restarts < 0:
        raise ManifestError("--max-restarts", f"must be at least 0, got {options.max_restarts}")
    batch = training.global_batch_size

    def on_step(step: int, loss: float, seconds: float) -> None:
        out.print(f"step {step}/{steps}  loss {loss:.4f}  {batch / seconds:,.1f} samples/s")

    def on_event(what: str) -> None:
        out.print(f"[yellow]{what}[/yellow]")

    if args.head_port:
        import subprocess

        command = ray_cluster.head_command(args.head_port, None, block=False)
        subprocess.run(command, env=ray_cluster.ray_env(), check=True)
    try:
        result = drive(Path(args.manifest).read_text(), plan, options, on_step=on_step, on_event=on_event)
    finally:
        if args.head_port:
            subprocess.run([ray_cluster.ray_binary(), "stop"], env=ray_cluster.ray_env(), check=False)
    out.print(f"done: {len(result.losses)} steps, final loss {result.losses[-1]:.4f}, "
              f"{result.restarts} restart(s), last checkpoint step {result.checkpoint_step}")
    return 0


def dispatch(args: argparse.Namespace, out: Console) -> int | None:
    """Run the command if it is one of ours; None otherwise."""
    if args.command == "ray-head":
        return cmd_ray_head(args)
    if args.command == "mesh-worker":
        return cmd_mesh_worker(args)
    if args.command == "driver":
        return cmd_driver(args, out)
    return None
