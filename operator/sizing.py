"""What each pod of a job asks the scheduler for, by default: sized from the plan.

A pod's requests decide where it fits. Fixed requests fit no one: a 2-CPU node cannot
place a 4-CPU mesh pod, and an 8-GPU node with 200 cores wastes them. So the defaults
follow the job (``spec.podTemplate.<role>.resources`` replaces any of them):

============  ===========================================  ================================
pod           CPU                                          memory
============  ===========================================  ================================
planner       ``500m``                                     ``2Gi`` (JAX tracing, the ILPs)
head          ``250m`` (it coordinates; the meshes work)   ``1Gi`` + twice the model's
                                                           parameters in float32 (the driver
                                                           assembles them at the end)
mesh, GPUs    one core per GPU (the host side of a step:   ``4Gi`` + per device its share of
              data, dispatch)                              the stage's weights (a checkpoint
                                                           is staged through host memory)
mesh, CPU     a tenth of a core per forced device: they    ``1Gi`` + per device its peak
              share the node's cores, so this is a         memory (a forced CPU device's
              scheduling share, not a speed                memory is the host's)
============  ===========================================  ================================

Every Ray pod (head and mesh) also gets a memory-backed ``/dev/shm`` for Ray's object
store (:func:`shm_bytes`), counted in its memory request, since a memory-backed
``emptyDir`` is charged to the pod. Limits are left unset (a user may set them): a
memory limit estimated too low kills a job, and CPU limits only throttle.

Example: the README's job (GPT, 3 stages on 2, 4 and 2 forced CPU devices) asks for
200m + 400m + 200m for the meshes and 250m for the head: it fits a 2-CPU node beside
the cluster's own pods.
"""

from __future__ import annotations

from dataclasses import dataclass

from alpajob.api.plan import Plan, StagePlan

MI = 1 << 20
GI = 1 << 30
#: Ray's object store needs at least this much (Ray refuses less than 75 MB).
MIN_SHM = 256 * MI
#: ... and gets at most this much by default (more through ``podTemplate.shmSize``).
MAX_SHM = 16 * GI


@dataclass(frozen=True)
class PodSize:
    """A pod's default requests (Kubernetes quantities) and its ``/dev/shm`` in bytes
    (None: a pod without Ray)."""

    cpu: str
    memory: str
    shm: int | None = None


def _mebibytes(size: float) -> str:
    return f"{max(1, -(-int(size) // MI))}Mi"


def _millicores(cores: float) -> str:
    return f"{max(1, round(cores * 1000))}m"


def shm_bytes(plan: Plan | None) -> int:
    """``/dev/shm`` of a Ray pod: the object store holds the activations and gradients
    crossing between meshes (every resharding task, for each micro-batch of a step:
    under GPipe all may be in flight), twice over (Ray keeps a copy while it transfers
    one); at least :data:`MIN_SHM` (the step's batch, Ray's own objects), at most
    :data:`MAX_SHM`."""
    if plan is None:
        return MIN_SHM
    crossing = sum(task.bytes for task in plan.resharding) * plan.num_micro_batches
    return int(min(max(2 * crossing, MIN_SHM), MAX_SHM) // MI * MI)


def planner_size() -> PodSize:
    return PodSize(cpu="500m", memory="2Gi")


def head_size(plan: Plan | None) -> PodSize:
    """The head pod (None: before there is a plan: no parameters counted)."""
    shm = shm_bytes(plan)
    parameters = plan.model.num_parameters * 4 if plan is not None else 0
    return PodSize(cpu="250m", memory=_mebibytes(GI + 2 * parameters + shm), shm=shm)


def mesh_size(plan: Plan | None, stage: StagePlan | None, devices: int, cpu: bool) -> PodSize:
    """One host of ``stage`` with ``devices`` devices (``cpu``: forced host devices;
    None: no plan to size memory from, only the base)."""
    shm = shm_bytes(plan)
    peak = stage.peak_memory_bytes if stage is not None else 0.0
    weights = stage.weight_bytes if stage is not None else 0.0
    if cpu:
        return PodSize(cpu=_millicores(0.1 * devices), memory=_mebibytes(GI + devices * peak + shm), shm=shm)
    return PodSize(cpu=str(devices), memory=_mebibytes(4 * GI + devices * weights + shm), shm=shm)
