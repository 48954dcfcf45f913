"""The job's Ray cluster: who runs where, and how the processes start and find each other.

Naming: mesh ``i`` (the plan's stage ``i``) has one host per node of its submesh;
host ``j`` of mesh ``i`` joins the job's Ray cluster with the custom resource
``alpajob-mesh-<i>-host-<j>`` (one unit), and that mesh host's actor asks for it, so
Ray places it on exactly that process. The operator tells each pod its mesh, host and
the head's address through the runtime contract
(:class:`~alpajob.api.runtime.TrainerRuntime`); every flag of the entry points
defaults to it.

The entry points run ``ray start`` (blocking in the foreground, as a pod's main
process should) with a temp dir. In a job's pods Ray requires the attempt's token
(``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``: the operator's ``<job>-<a>-ray``
Secret) of every connection: its GCS, raylets, the dashboard agent's job API and Ray
Client answer nothing without it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
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
    its own, so the drain only delays the restart (measured: 30 s per deleted pod).

    The GCS (on the head) declares a node dead after :data:`HEALTH_CHECK` (a node
    whose pod was killed, and that never said goodbye): with Ray's defaults, a check
    every 3 s, 10 s to answer, 5 failures, it took 10-14 s here, and until then Ray
    offers the lost node's resource as if it were there (the driver places a
    replacement on the node that joined instead: :func:`host_node`). Each variable
    may be set to override it."""
    env = dict(os.environ)
    # Token authentication whenever a token is given (a job's pods: the attempt's
    # Secret); without one (a developer's own `alpajob ray-head`), none.
    token = env.get("RAY_AUTH_TOKEN_PATH") or env.get("RAY_AUTH_TOKEN")
    env.setdefault("RAY_AUTH_MODE", "token" if token else "disabled")
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    for name, value in HEALTH_CHECK.items():
        env.setdefault(name, value)
    if devices is not None:
        env["XLA_FLAGS"] = with_host_devices(env.get("XLA_FLAGS", ""), devices)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


#: How the GCS tells a lost node: a check every second, five misses in a row (a
#: killed node given up in 9 s, 17 s with Ray's defaults: ``benchmarks/ray_node_start.py``).
#: A check misses only when unanswered for 3 s: a
#: busy raylet still answers (its gRPC threads do not wait for the trainer), and a
#: starved one has 15 s before it is given up.
HEALTH_CHECK = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
}


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
    """``ray start --address``: a raylet offering this mesh host's resource. Its
    dashboard agent's HTTP server takes a free port rather than Ray's fixed 52365: a
    raylet waits for its agent, and an agent that finds the port taken (another
    raylet on the same machine: ``alpajob run``, the tests' kubelet) retries for
    about 4 s before it gives up on it (measured, ``benchmarks/ray_node_start.py``: a
    node joins in 6.4 s, 3.7 s with a free port)."""
    resources = json.dumps({host_resource(mesh, host): 1})
    command = [ray_binary(), "start", f"--address={address}", f"--resources={resources}",
               f"--num-cpus={num_cpus}", "--dashboard-agent-listen-port=0", *_LEAN, *_store(object_store_bytes)]
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
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Wait until every host's resource is in the cluster; else raise naming the missing ones.

    ``available`` returns the cluster's resources (``ray.cluster_resources``); the wait
    also ends, without an error, once ``stopped()`` (the driver got SIGTERM).
    """
    deadline = time.monotonic() + timeout
    while True:
        have = available()
        missing = [h for h in hosts if have.get(h.resource, 0) < 1]
        if not missing or stopped():
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"mesh {h.mesh} host {h.host} ({h.resource})" for h in missing)
            raise JoinTimeoutError(
                f"{counted(len(missing), 'mesh host')} did not join the Ray cluster within "
                f"{timeout:g} s: {names}; start them with `alpajob mesh-worker --mesh I "
                f"--host J` (or check that their pods are running and can reach the head)"
            )
        time.sleep(poll)


def raylet_answers(address: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a raylet listens at ``address:port`` (a TCP connect within ``timeout``)."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def host_node(
    resource: str,
    lost: set[str],
    nodes: Callable[[], list[dict]],
    timeout: float,
    answers: Callable[[str, int], bool] = raylet_answers,
    poll: float = 0.2,
) -> str:
    """The Ray node to place a replaced mesh host's actor on: one that offers
    ``resource`` and is not among ``lost`` (the nodes of the failed mesh), as soon as
    one has joined; or a node of ``lost`` whose raylet still answers (its actor alone
    died: a hung or killed worker process, not its pod). ``nodes`` is
    ``ray.nodes``.

    Without this choice Ray places the new actor on the lost node itself: a killed
    pod's node stays alive for the GCS until its health checks fail, and the actor
    dies with it when the GCS gives the node up (measured: 10.5 s after the kill, 3 s
    after the new node had joined).
    Raises :class:`JoinTimeoutError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        offering = [n for n in nodes() if n.get("Alive") and (n.get("Resources") or {}).get(resource, 0) >= 1]
        new = [n["NodeID"] for n in offering if n["NodeID"] not in lost]
        if new:
            return str(new[0])
        for node in offering:  # the old node, if it lives on
            if answers(str(node.get("NodeManagerAddress")), int(node.get("NodeManagerPort") or 0)):
                return str(node["NodeID"])
        if time.monotonic() >= deadline:
            raise JoinTimeoutError(
                f"no live Ray node offers {resource} within {timeout:g} s: the mesh host's pod was not "
                "made again, or its raylet cannot reach the head")
        time.sleep(poll)
