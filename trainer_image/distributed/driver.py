"""``alpajob driver``: train one plan across the mesh hosts of the job's Ray cluster.

On the head (a Ray client of the job's cluster):

1. wait until every mesh host of the plan has joined (its custom resource is in the
   cluster), or fail naming the missing ones (:func:`~.cluster.wait_for_hosts`);
2. start one :class:`~.mesh_host.MeshHost` actor per mesh host, pinned by its
   resource; each builds its stage on its own devices;
3. gather every stage's layout and hand all of them, with the actor handles, to
   every actor: from then on stages talk to each other directly (object store),
   not through the driver;
4. per step, ask every actor to run it and wait for all (a step's timeout bounds a
   hung worker); the loss is the mean of the loss stage's micro-batch losses;
5. at the end, collect the parameters and stop the actors.

Meshes spanning several hosts (one JAX process group per mesh) are not built yet:
such a plan is refused with a clear error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from alpajob.planner.errors import AlpaJobError
from alpajob.planner.plan import Plan
from alpajob.trainer.distributed.cluster import mesh_hosts, wait_for_hosts
from alpajob.trainer.distributed.mesh_host import MeshHost
from alpajob.trainer.metrics import write_metrics_json


@dataclass(frozen=True)
class DriverOptions:
    """How the driver runs: where the cluster is, how long, how patient."""

    address: str
    steps: int
    seed: int = 0
    join_timeout: float = 120.0
    step_timeout: float = 600.0
    metrics_out: str | None = None


@dataclass
class DriverResult:
    """Per-step losses and wall seconds, bytes sent between meshes, final parameters."""

    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)
    stage_times: list[list[dict[str, Any]]] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"losses": self.losses, "step_seconds": self.step_seconds,
                "sent_bytes": self.sent_bytes, "stage_times": self.stage_times}


def check_supported(plan: Plan) -> None:
    """Refuse what this runtime cannot run yet (meshes spanning several hosts)."""
    wide = [s.index for s in plan.stages if s.submesh_shape[0] > 1]
    if wide:
        raise AlpaJobError(
            f"stage(s) {wide} of the plan span several hosts; the Ray runtime runs one host "
            "per mesh so far: re-plan with meshes of at most one node each (for example "
            "method pipeshard with more stages), or run on one machine with `alpajob run`"
        )


def drive(
    manifest_yaml: str,
    plan: Plan,
    options: DriverOptions,
    on_step: Callable[[int, float, float], None] | None = None,
) -> DriverResult:
    """Train ``plan`` on the Ray cluster at ``options.address`` (see the module docstring)."""
    import ray

    check_supported(plan)
    hosts = mesh_hosts(plan)
    ray.init(address=options.address, log_to_driver=False, logging_level="WARNING")
    actors: list[Any] = []
    try:
        wait_for_hosts(hosts, ray.cluster_resources, options.join_timeout)
        remote = ray.remote(MeshHost)
        text = plan.to_json()
        for host in hosts:
            actors.append(
                remote.options(resources={host.resource: 1}, num_cpus=0, max_concurrency=16)
                .remote(manifest_yaml, text, host.mesh, options.seed)
            )
        ray.get([a.ready.remote() for a in actors], timeout=options.step_timeout)
        layouts = ray.get([a.layout.remote() for a in actors])
        ray.get([a.connect.remote(actors, layouts) for a in actors])
        result = DriverResult()
        for step in range(options.steps):
            began = time.perf_counter()
            replies = ray.get([a.step.remote(step) for a in actors], timeout=options.step_timeout)
            seconds = time.perf_counter() - began
            losses = [x for reply in replies for x in reply["losses"]]
            loss = float(np.mean(losses))
            result.losses.append(loss)
            result.step_seconds.append(seconds)
            result.sent_bytes.append(sum(int(r["sent_bytes"]) for r in replies))
            result.stage_times.append([r["times"] for r in replies])
            if on_step:
                on_step(step + 1, loss, seconds)
        for arrays in ray.get([a.named_arrays.remote() for a in actors]):
            result.params.update({k[len("params/"):]: v for k, v in arrays.items() if k.startswith("params/")})
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.shutdown()
    if options.metrics_out:
        write_metrics_json(options.metrics_out, result.to_json())
    return result
