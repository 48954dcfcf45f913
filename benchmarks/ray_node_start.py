"""A replaced mesh host's Ray parts, alone: a worker raylet's start, and a lost node's death.

On this machine, beside a head started with the project's flags (``head_command``,
``ray_env``): how long ``ray start --address`` takes until the node's resource is in
the cluster, with its dashboard agent on Ray's fixed port 52365 (taken by the head's
agent: every raylet on one machine, as in ``alpajob run`` and the tests' kubelet) and
on a free port (``worker_command``'s ``--dashboard-agent-listen-port=0``); then how
long the GCS takes to declare a SIGKILLed worker node dead (``ray.nodes()`` polled),
with Ray's health-check defaults and with the shipped :data:`HEALTH_CHECK`.

    python benchmarks/ray_node_start.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

from alpajob.trainer_image.distributed.cluster import (
    HEALTH_CHECK,
    head_command,
    ray_binary,
    ray_env,
    worker_command,
)
from alpajob.trainer_image.distributed.loopback import free_port

RESOURCE = "alpajob-mesh-0-host-0"


def _start_worker(address: str, env: dict[str, str], fixed_agent_port: bool) -> tuple[subprocess.Popen, float]:
    """A worker raylet (``worker_command``, optionally with Ray's fixed agent port) and
    the seconds until its resource is in the cluster."""
    import ray

    command = worker_command(address, 0, 0, block=True)
    if fixed_agent_port:
        command = [c for c in command if not c.startswith("--dashboard-agent-listen-port")]
    began = time.monotonic()
    worker = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    while ray.cluster_resources().get(RESOURCE, 0) < 1:
        time.sleep(0.05)
    return worker, time.monotonic() - began


def _death(worker: subprocess.Popen) -> float:
    """SIGKILL the worker's process group; seconds until the GCS says its node is dead."""
    import ray

    os.killpg(worker.pid, signal.SIGKILL)
    began = time.monotonic()
    while any(n["Alive"] and n["Resources"].get(RESOURCE) for n in ray.nodes()):
        time.sleep(0.1)
    return time.monotonic() - began


def measure(health_check: dict[str, str] | None) -> dict[str, float]:
    """One head with ``health_check`` (None: Ray's defaults), two worker starts, one death."""
    import ray

    env = ray_env()
    for name in HEALTH_CHECK:
        env.pop(name, None)
    env.update(health_check or {})
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ray-node-") as temp:
        subprocess.run(head_command(port, temp, block=False), env=env, check=True, capture_output=True)
        try:
            ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
            fixed, fixed_seconds = _start_worker(f"127.0.0.1:{port}", env, fixed_agent_port=True)
            os.killpg(fixed.pid, signal.SIGTERM)
            fixed.wait(30)
            while ray.cluster_resources().get(RESOURCE, 0) >= 1:
                time.sleep(0.05)
            free, free_seconds = _start_worker(f"127.0.0.1:{port}", env, fixed_agent_port=False)
            dead = _death(free)
        finally:
            ray.shutdown()
            subprocess.run([ray_binary(), "stop", "--force"], env=env, capture_output=True)
    return {"ray start, agent on 52365": fixed_seconds, "ray start, agent on a free port": free_seconds,
            "killed node declared dead": dead}


def main() -> None:
    rows = {"Ray's defaults": measure(None), "shipped": measure(HEALTH_CHECK)}
    print(json.dumps(rows, indent=2))
    print("\n| health check | " + " | ".join(next(iter(rows.values()))) + " |")
    print("| --- |" + " --- |" * len(next(iter(rows.values()))))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f} s" for v in row.values()) + " |")


if __name__ == "__main__":
    main()
