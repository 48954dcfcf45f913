"""The job's Ray cluster: who runs where, and how the processes start and find each other.

Naming: mesh ``i`` (the plan's stage ``i``) has one host per node of its submesh;
host ``j`` of mesh ``i`` joins the job's Ray cluster with the custom resource
``alpajob-mesh-<i>-host-<j>`` (one unit), and that mesh host's actor asks for it, so
Ray places it on exactly that process. The operator tells each pod its mesh, host and
the head's address through the runtime contract
(:class:`~alpajob.api.runtime.TrainerRuntime`); every flag of the entry points
defaults to it.

The entry points run ``ray start`` (blocking in the foreground, as a pod's main
process should) with a temp dir and no token auth inside the job's private network.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alpajob.api.errors import TransientError
from alpajob.api.plan import Plan
from alpajob.api.wording import counted
from alpajob.trainer_image.devices import with_host_devices


class JoinTimeoutError(TransientError):
    """Some mesh host never joined the job's Ray cluster."""


def host_resource(mesh: int, host: int) -> str:
    """The custom resource that pins mesh ``mesh``'s host ``host`` actor to its worker."""
    return f"alpajob-mesh-{mesh}-host-{host}"


@dataclass(frozen=True)
class MeshHostSpec:
    """One mesh host the plan needs: its mesh, its index there and its devices."""

    mesh: int
    host: int
    devices: int

    @property
    def resource(self) -> str:
        return host_resource(self.mesh, self.host)


def mesh_hosts(plan: Plan) -> list[MeshHostSpec]:
    """Every mesh host of ``plan``: a stage on an ``n x m`` submesh has ``n`` hosts of
    ``m`` devices each."""
    hosts: list[MeshHostSpec] = []
    for stage in plan.stages:
        nodes, per_node = stage.submesh_shape
        hosts.extend(MeshHostSpec(stage.index, j, per_node) for j in range(nodes))
    return hosts


def ray_env(devices: int | None = None) -> dict[str, str]:
    """The environment ``ray start`` (and so every worker it spawns) runs with. A node
    that gets SIGTERM (its pod deleted) stops at once instead of draining for 30 s
    (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, made for Ray Serve's replicas): a
    busy actor never finishes draining, and the driver recovers from a lost host on
    its own, so the drain only delays the restart (measured: 30 s per deleted pod)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    if devices is not None:
        env["XLA_FLAGS"] = with_host_devices(env.get("XLA_FLAGS", ""), devices)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def ray_binary() -> str:
    candidate = os.path.join(os.path.dirname(sys.executable), "ray")
    return candidate if os.path.exists(candidate) else "ray"


#: What every ``ray start`` leaves out: the dashboard (no one browses it; the trainer
#: serves Prometheus metrics itself), the log monitor (the driver runs with
#: ``log_to_driver=False``; logs stay in the session folder), usage statistics.
_LEAN = ["--include-log-monitor=false", "--disable-usage-stats"]


def _store(object_store_bytes: int | None) -> list[str]:
    """Ray's object store size: what the pod's memory-backed /dev/shm holds (else Ray
    sizes it from the node's memory, finds /dev/shm smaller, and falls back to disk)."""
    return [f"--object-store-memory={object_store_bytes}"] if object_store_bytes else []


def head_command(port: int, temp_dir: str | None, block: bool, num_cpus: int | None = 0,
                 object_store_bytes: int | None = None) -> list[str]:
    """``ray start --head``: the GCS and a raylet that runs no mesh actor (0 CPUs)."""
    command = [ray_binary(), "start", "--head", f"--port={port}", "--include-dashboard=false", *_LEAN,
               *_store(object_store_bytes)]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if temp_dir:
        command.append(f"--temp-dir={temp_dir}")
    if block:
        command.append("--block")
    return command


def worker_command(address: str, mesh: int, host: int, block: bool, num_cpus: int = 1,
                   object_store_bytes: int | None = None) -> list[str]:
    """``ray start --address``: a raylet offering this mesh host's resource."""
    resources = json.dumps({host_resource(mesh, host): 1})
    command = [ray_binary(), "start", f"--address={address}", f"--resources={resources}",
               f"--num-cpus={num_cpus}", *_LEAN, *_store(object_store_bytes)]
    if block:
        command.append("--block")
    return command


def run_command(command: Sequence[str], env: dict[str, str]) -> int:
    """Run ``command`` in the foreground, passing SIGTERM and SIGINT on to it (so that
    stopping the pod's main process stops Ray's); its exit code."""
    child = subprocess.Popen(list(command), env=env)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_hosts(
    hosts: Sequence[MeshHostSpec],
    available: Callable[[], dict[str, float]],
    timeout: float,
    poll: float = 0.5,
) -> None:
    """Wait until every host's resource is in the cluster; else raise naming the missing ones.

    ``available`` returns the cluster's resources (``ray.cluster_resources``).
    """
    deadline = time.monotonic() + timeout
    while True:
        have = available()
        missing = [h for h in hosts if have.get(h.resource, 0) < 1]
        if not missing:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"mesh {h.mesh} host {h.host} ({h.resource})" for h in missing)
            raise JoinTimeoutError(
                f"{counted(len(missing), 'mesh host')} did not join the Ray cluster within "
                f"{timeout:g} s: {names}; start them with `alpajob mesh-worker --mesh I "
                f"--host J` (or check that their pods are running and can reach the head)"
            )
        time.sleep(poll)
