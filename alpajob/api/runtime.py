"""What the operator gives a trainer pod, and how the trainer reads it back.

Every pod of a job (the planner, the head with the Ray head and the driver, one pod
per mesh host) runs the trainer image with an environment built from one
:class:`TrainerRuntime`: the operator calls :meth:`TrainerRuntime.to_env`, the
``alpajob`` commands in the pod call :meth:`TrainerRuntime.from_env`, and a test
builds each kind of pod with the operator's own builders and reads it back whole.
Every flag of ``alpajob plan``, ``driver``, ``mesh-worker`` and ``ray-head`` defaults
to the field here, so a command line in a pod can stay short.

=========================  ===========  ===========================================
variable                   pods         meaning
=========================  ===========  ===========================================
``ALPAJOB_ROLE``           all          planner, head or mesh
``ALPAJOB_JOB``            all          the AlpaJob's name
``ALPAJOB_NAMESPACE``      all          its namespace
``ALPAJOB_ATTEMPT``        head, mesh   0, then one more per restart of the whole job
``ALPAJOB_MANIFEST``       all          path of the job's manifest (``<job>-config``)
``ALPAJOB_PLAN``           head, mesh   path of the Plan document (``<job>-plan``)
``ALPAJOB_PLAN_CONFIGMAP`` planner      ``namespace/name`` the planner writes the plan to
``ALPAJOB_PROGRESS_CONFIGMAP`` head     ``namespace/name`` the driver keeps progress in
``ALPAJOB_GPU``            planner      the device preset of the node pool
``ALPAJOB_NODES``          planner      nodes of the pool the plan may use
``ALPAJOB_GPUS_PER_NODE``  planner      devices of each of them
``ALPAJOB_POOLS``          planner      with ``spec.cluster.pools``: the usable nodes of each GPU type,
                                        as JSON (``[{"gpu": "h100-80gb", "nodes": 2}, ...]``)
``ALPAJOB_PLAN_CACHE``     planner      the plan cache's folder (on the checkpoint volume)
``ALPAJOB_CALIBRATION``    planner      the calibration file mounted from ``spec.planner.calibration``
``ALPAJOB_RAY_ADDRESS``    mesh         the Ray head's ``host:port``
``ALPAJOB_RAY_PORT``       head         the Ray head's GCS port
``ALPAJOB_METRICS_PORT``   head         the driver's Prometheus port
``ALPAJOB_MESH``           mesh         this pod's mesh (the plan's stage)
``ALPAJOB_HOST``           mesh         this pod's host index inside the mesh
``ALPAJOB_PROCESS_ID``     mesh         its process index in the mesh's JAX group
``ALPAJOB_PROCESS_COUNT``  mesh         processes (hosts) in the mesh's JAX group
``ALPAJOB_COORDINATOR``    mesh         ``host:port`` of the mesh's JAX coordinator
``ALPAJOB_DEVICES``        mesh         CPU pools only: host devices to force
``ALPAJOB_CHECKPOINT_DIR`` head         the shared checkpoint directory
``ALPAJOB_CHECKPOINT_EVERY`` head       steps between two checkpoints
``ALPAJOB_CHECKPOINT_VOLUME`` head      what holds it, for messages (``PersistentVolumeClaim x``)
``ALPAJOB_JOIN_TIMEOUT``   head         seconds the driver waits for every mesh host
``ALPAJOB_OBJECT_STORE_BYTES`` head, mesh  Ray's object store: what the pod's /dev/shm holds
``ALPAJOB_TRANSPORT``      head         ``object-store`` or ``collective`` (default by device)
=========================  ===========  ===========================================

Which transport (:class:`Transport`): the driver's ``--transport``, else
``ALPAJOB_TRANSPORT``, else ``spec.parallelism.transport``, else (``auto``)
:meth:`Transport.default_for` the pool's device: collectives on GPUs (NCCL, device
to device), the object store on CPU devices (no slower there, measured). Only the object
store's per-mesh groups use ``ALPAJOB_COORDINATOR``; the collective transport's
job-wide group (on mesh 0 host 0) and its checkpoint helpers' per-mesh groups (on each
mesh's host 0) listen on ports chosen at run time, so the pods of a job must reach each
other on any port (no NetworkPolicy narrower than the job).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationError

from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.api.names import Role
from alpajob.api.pools import GpuPool
from alpajob.api.schema import Contract

#: Every variable of the contract starts with this.
ENV_PREFIX = "ALPAJOB_"

#: What the head and mesh pods' commands run under: tini (Debian and Ubuntu's package, in
#: the trainer image) as PID 1 reaps the processes Ray orphans and passes signals on, so
#: `ray stop` never waits out its grace period for zombie raylets. An image of your own
#: for these pods needs tini on its PATH (`apt-get install tini`).
INIT_COMMAND = ("tini", "--")
#: Where every trainer container's termination message is read from (its
#: ``terminationMessagePath``, Kubernetes' default): an ``alpajob`` command that fails
#: writes its one-line reason there, so the pod's message, the job's condition and its
#: event lead with the cause, whatever Ray prints as it shuts down.
TERMINATION_LOG = "/dev/termination-log"
#: Not a pod variable: ``alpajob mesh-worker`` sets it for the Ray processes it starts.
#: The file it names appears when the driver releases the host at the end of a job
#: (``MeshHost.release``); the worker then stops Ray and exits 0, so a finished job's
#: mesh pods are Succeeded, not deleted while Running, and their logs stay.
RELEASE_FILE_ENV = "ALPAJOB_RELEASE_FILE"
#: Not a pod variable either: the file appears when the driver, stopped by SIGTERM (a
#: preemption, a suspension: every pod of the attempt deleted at once), asks its mesh
#: hosts to stay for the checkpoint of the step it is at (``MeshHost.hold``); the
#: worker then keeps Ray up after its own SIGTERM until the head is gone
#: (``alpajob mesh-worker``, :mod:`alpajob.trainer_image.distributed.raylet`).
HOLD_FILE_ENV = "ALPAJOB_HOLD_FILE"
#: The Ray head's GCS port (the head pod and its Service).
RAY_PORT = 6379
#: The driver's and the trainers' Prometheus port.
METRICS_PORT = 9090
#: The JAX coordinator port of a mesh's host 0.
COORDINATOR_PORT = 8476
#: Where the pods mount the job's ConfigMaps and checkpoint volume.
CONFIG_DIR = "/etc/alpajob"
PLAN_DIR = "/etc/alpajob/plan"
CHECKPOINT_DIR = "/checkpoints"
#: The planner's plan cache, on the checkpoint volume (a dot folder: no checkpoint).
PLAN_CACHE_DIR = f"{CHECKPOINT_DIR}/.alpajob/plans"
#: Where mesh pods keep JAX's compiled executables, on the job's volume: a new attempt,
#: a replaced mesh pod or a job applied again reads its stage executables back.
COMPILE_CACHE_DIR = f"{CHECKPOINT_DIR}/.alpajob/xla"
MANIFEST_PATH = f"{CONFIG_DIR}/manifest.yaml"
#: Where the planner pod mounts ``spec.planner.calibration``'s ConfigMap key.
CALIBRATION_DIR = f"{CONFIG_DIR}/calibration"
CALIBRATION_PATH = f"{CALIBRATION_DIR}/calibration.json"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
#: The attempt's Ray token (the ``<job>-<a>-ray`` Secret), mounted in the head and mesh
#: pods only; Ray reads it from ``RAY_AUTH_TOKEN_PATH`` with ``RAY_AUTH_MODE=token``.
RAY_TOKEN_DIR = "/var/run/alpajob/ray"
RAY_TOKEN_KEY = "token"
RAY_TOKEN_PATH = f"{RAY_TOKEN_DIR}/{RAY_TOKEN_KEY}"


class Transport(StrEnum):
    """How activations and gradients cross between meshes in the Ray runtime."""

    OBJECT_STORE = "object-store"
    COLLECTIVE = "collective"

    @classmethod
    def from_spec(cls, name: str) -> Transport | None:
        """``spec.parallelism.transport``'s value (camelCase) as a transport; None for auto."""
        return {"objectStore": cls.OBJECT_STORE, "collective": cls.COLLECTIVE}.get(name)

    @classmethod
    def default_for(cls, gpu: DevicePreset | str) -> Transport:
        """The transport of a job that names none, on devices ``gpu`` (a preset):
        collectives on a GPU pool (NCCL moves a message device to device, where the
        object store copies it through host memory on both ends), the object store on
        CPU devices: there collectives (gloo) move a message faster but made no step
        faster (benchmarks/RESULTS.md, *Transports and the Ray runtime*), and the object
        store needs no job-wide JAX group."""
        return cls.OBJECT_STORE if str(gpu) == DevicePreset.CPU.value else cls.COLLECTIVE


def _json(value: object) -> object:
    """A list field's variable holds JSON (:meth:`TrainerRuntime.to_env`)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at character {error.pos})") from None


class TrainerRuntime(Contract):
    """What one trainer pod is told (module docstring); unset fields are not sent."""

    role: Role | None = None
    job: str | None = None
    namespace: str | None = None
    attempt: int = Field(0, ge=0)
    manifest: str | None = None
    plan: str | None = None
    plan_configmap: str | None = None
    progress_configmap: str | None = None
    gpu: DevicePreset | None = None
    nodes: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=1)
    pools: Annotated[list[GpuPool], BeforeValidator(_json)] | None = None  # spec.cluster.pools as the pool has them
    plan_cache: str | None = None
    calibration: str | None = None  # the planner's calibration file (spec.planner.calibration)
    ray_address: str | None = None
    ray_port: int | None = Field(None, ge=1, le=65535)
    metrics_port: int | None = Field(None, ge=1, le=65535)
    mesh: int | None = Field(None, ge=0)
    host: int | None = Field(None, ge=0)
    process_id: int | None = Field(None, ge=0)
    process_count: int | None = Field(None, ge=1)
    coordinator: str | None = None
    devices: int | None = Field(None, ge=1)
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = Field(None, ge=1)
    checkpoint_volume: str | None = None
    join_timeout: float | None = Field(None, gt=0)
    object_store_bytes: int | None = Field(None, ge=78643200)  # Ray's least: 75 MiB
    transport: Transport | None = None
    termination_log: str | None = None  # the file a failing command writes its reason to
    compile_cache: str | None = None  # JAX's persistent compilation cache (mesh pods, with a volume)

    @staticmethod
    def env_name(field: str) -> str:
        """``process_id`` -> ``ALPAJOB_PROCESS_ID``."""
        return ENV_PREFIX + field.upper()

    def to_env(self) -> dict[str, str]:
        """The pod's environment: one variable per set field (the operator's side)."""
        values = self.model_dump(mode="json", by_alias=False, exclude_defaults=True)
        values["attempt"] = self.attempt
        return {self.env_name(k): self._as_json(k) if isinstance(v, list) else str(v)
                for k, v in values.items() if v is not None}

    def _as_json(self, field: str) -> str:
        """A list field as JSON, each entry whole and camelCase, as in a manifest."""
        return json.dumps([entry.model_dump(mode="json", by_alias=True) for entry in getattr(self, field)],
                          separators=(",", ":"))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrainerRuntime:
        """Read the contract back from ``env`` (the trainer's side); a malformed variable
        is a :class:`ManifestError` naming it. Variables of other programs are ignored."""
        names = {cls.env_name(field): field for field in cls.model_fields}
        values = {names[k]: v for k, v in env.items() if k in names and v != ""}
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            first = error.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else "role"
            raise ManifestError(cls.env_name(field),
                                f"{first['msg']}, got {env.get(cls.env_name(field))!r}") from None

    @classmethod
    def unknown_variables(cls, env: Mapping[str, str]) -> list[str]:
        """``ALPAJOB_*`` variables in ``env`` that are not part of the contract."""
        names = {cls.env_name(field) for field in cls.model_fields}
        return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in names)
