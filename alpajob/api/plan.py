"""The Plan document (contract 2): what the planner decided, for the trainer and operator.

One versioned JSON document. It is a pydantic model so that reading a plan file
validates it (unknown keys refused, types checked) and :func:`plan_json_schema` gives
its JSON schema; inside the planner it is built once, at the end, from plain results.

Stability: :meth:`Plan.content_hash` is a SHA-256 over the canonical JSON (sorted keys)
of everything except ``solver`` (wall times, which differ run to run) and ``baselines``.
The same model, cluster and options give the same plan and the same hash.

Sharding specs are written the way ``jax.sharding.PartitionSpec`` takes them: one entry
per tensor dimension, ``null`` (replicated), an axis name, or a list of axis names.
A plan never names a Kubernetes node: ``device_slots`` are (node index, device index)
pairs of the abstract N x M cluster, which the operator maps onto real nodes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from alpajob.api.errors import PlanFormatError

PLAN_VERSION = "alpajob.io/plan/v2"

#: One PartitionSpec entry: replicated (None), one mesh axis, or several.
SpecEntry = str | list[str] | None


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Doc):
    """The traced model: name, graph fingerprint, parameter count, FLOPs per step."""

    name: str
    fingerprint: str
    num_parameters: int
    flops_per_step: float
    dtype: str
    num_ops: int


class LayerInfo(_Doc):
    """One clustered layer: its forward ops [first, last+1) and FLOPs of all its ops."""

    index: int
    forward_ops: tuple[int, int]
    num_ops: int
    flops: float
    param_bytes: int


#: Forward primitives whose output sharding the plan records (:class:`PinnedOp`) and the
#: trainer pins with a sharding constraint: the ops where the ILP's choice matters
#: (how a matmul, convolution or lookup splits its work); GSPMD propagates the rest.
PINNED_PRIMITIVES: frozenset[str] = frozenset({"dot_general", "conv_general_dilated", "gather"})


class PinnedOp(_Doc):
    """The sharding the ILP chose for one forward op's output (at micro-batch size).

    ``op`` is the op's id in the planner's graph; ``primitive`` and ``shape`` let the
    trainer find the same equation in its own trace of the loss.
    """

    op: int
    primitive: str
    shape: list[int]
    sharding: list[SpecEntry]


class StagePlan(_Doc):
    """One pipeline stage: layers [first, last+1) on a submesh, sharded as decided."""

    index: int
    layers: tuple[int, int]
    submesh_shape: tuple[int, int]
    device_slots: list[tuple[int, int]]
    logical_mesh_shape: tuple[int, int]
    axis_names: tuple[str, str] = ("x", "y")
    pool: int | None = Field(None, description=(
        "a plan across GPU types: the index in cluster.pools of the pool this stage's GPUs "
        "are of (its device_slots count nodes across the pools, in their order); None in "
        "a plan of one type"))
    predicted_seconds: float = Field(description="forward+backward seconds per micro-batch")
    compute_seconds: float
    communication_seconds: float
    update_seconds: float = Field(description="per-step optimizer update and gradient sync")
    peak_memory_bytes: float
    weight_bytes: float
    activation_bytes: float = Field(description="per in-flight micro-batch")
    in_flight_micro_batches: int
    rematerialize: bool = Field(
        False, description="recompute each layer's forward before its backward (remat)"
    )
    param_layers: dict[str, int] = Field(
        default_factory=dict,
        description="the layer that first reads each parameter the stage reads; a "
        "rematerialised stage is recomputed one layer at a time, cut at these layers",
    )
    param_parts: dict[str, int] = Field(
        default_factory=dict,
        description="for a stage rematerialised by block parts (finer than a layer: "
        "attention, MLP, an expert FFN), the part, counted from the stage's first, whose "
        "forward first reads each parameter; the stage is recomputed one part at a time, "
        "cut at these parts. Empty: recomputed by whole layers (param_layers)",
    )
    param_shardings: dict[str, list[SpecEntry]]
    input_shardings: dict[str, list[SpecEntry]]
    output_shardings: dict[str, list[SpecEntry]]
    batch_shardings: dict[str, list[SpecEntry]] = Field(
        default_factory=dict, description="batch leaf index (flattened batch) -> its sharding"
    )
    weight_update_sharded: list[str]
    pinned_ops: list[PinnedOp] = Field(
        default_factory=list,
        description="output shardings of the stage's forward ops in PINNED_PRIMITIVES, by op id",
    )


class ReshardingTask(_Doc):
    """A tensor that crosses from one stage's mesh to another's, and how it moves."""

    src_stage: int
    dst_stage: int
    tensor: int
    direction: str  # "forward" (activation) or "backward" (gradient)
    shape: list[int]
    dtype: str
    bytes: int
    src_sharding: list[SpecEntry]
    dst_sharding: list[SpecEntry]
    strategy: str
    predicted_seconds: float


class SolverStats(_Doc):
    """How the plan was found; excluded from the hash (wall times vary).

    ``planning_seconds`` is the search (clustering, ILPs, DP), without tracing
    (``extract_seconds``) and without costing baselines.
    """

    planning_seconds: float
    extract_seconds: float = 0.0
    ilp_solves: int
    ilp_seconds: float
    ilp_max_variables: int
    ilp_solver: str
    dp_seconds: float
    dp_calls: int
    micro_batch_candidates: list[int]
    winner: str = Field("alpajob", description="which candidate won: the DP or a structured one")


class Plan(_Doc):
    """A whole plan: model, cluster, stages, resharding, predictions."""

    version: str = PLAN_VERSION
    method: str
    model: ModelInfo
    cluster: dict[str, Any]
    global_batch_size: int
    num_micro_batches: int
    schedule: str
    layers: list[LayerInfo]
    stages: list[StagePlan]
    resharding: list[ReshardingTask]
    predicted_step_seconds: float
    predicted_pflops: float
    bubble_fraction: float
    solver: SolverStats
    baselines: dict[str, float | None] | None = None

    def node_devices(self) -> list[int]:
        """Devices of each node of the cluster the plan was made for, in the slots' node
        numbering: a plan across GPU types numbers each pool's nodes from its
        ``first_node``, each with its own pool's devices per node (8 H100s on one node
        and 4 A100s on each of two: ``[8, 4, 4]``)."""
        pools = self.pools
        if not pools:
            return [int(self.cluster["devices_per_node"])] * int(self.cluster["num_nodes"])
        counts: list[int] = []
        for pool in sorted(pools, key=lambda p: int(p["first_node"])):
            counts += [int(pool["devices_per_node"])] * int(pool["num_nodes"])
        return counts

    def devices_offered(self) -> int:
        """Devices of the cluster the plan was made for (every slot a stage may name)."""
        return sum(self.node_devices())

    def device_index(self, node: int, slot: int) -> int:
        """Where slot ``(node, slot)`` is among the :meth:`devices_offered`, counting
        node by node (a run's devices in slot order)."""
        counts = self.node_devices()
        if not 0 <= node < len(counts) or not 0 <= slot < counts[node]:
            raise ValueError(f"slot ({node}, {slot}) is not a device of the plan's cluster "
                             f"(devices per node: {counts})")
        return sum(counts[:node]) + slot

    def cluster_label(self) -> str:
        """The cluster in words: ``2x8 h100-80gb`` or ``1x8 h100-80gb + 2x4 a100-40gb``."""
        parts = self.pools or [self.cluster]
        return " + ".join(f"{p['num_nodes']}x{p['devices_per_node']} {p['preset']}" for p in parts)

    def devices_used(self) -> int:
        """Devices the stages run on: all those offered, or fewer where the planner
        found fewer faster (forced CPU devices sharing one host)."""
        return sum(s.submesh_shape[0] * s.submesh_shape[1] for s in self.stages)

    @property
    def pools(self) -> list[dict[str, Any]]:
        """A plan across GPU types: each pool's cluster (``preset``, ``num_nodes``,
        ``devices_per_node``, ``first_node``); empty for a plan of one type."""
        return list(self.cluster.get("pools") or [])

    def content_hash(self) -> str:
        """SHA-256 (first 16 hex digits) of the plan without solver stats or baselines."""
        data = self._document(exclude={"solver", "baselines"})
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The document as pretty JSON, with its hash under ``hash``."""
        data = self._document()
        data["hash"] = self.content_hash()
        return json.dumps(data, indent=2, sort_keys=False)

    def _document(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """The JSON form; a stage's ``pool`` only in a plan across GPU types (a plan of
        one type reads, and hashes, as before pools existed)."""
        data = self.model_dump(mode="json", exclude=exclude)
        for stage in data["stages"]:
            if stage.get("pool") is None:
                stage.pop("pool", None)
        return data


def plan_from_json(text: str, source: str = "plan") -> Plan:
    """Parse and validate a Plan document; :class:`PlanFormatError` names the problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanFormatError(f"{source}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise PlanFormatError(f"{source}: a plan is a JSON object")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanFormatError(
            f"{source}: version {version!r} is not {PLAN_VERSION!r}; re-run `alpajob plan`"
        )
    stored_hash = data.pop("hash", None)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PlanFormatError(f"{source}: field {where}: {first['msg']}") from None
    if stored_hash is not None and stored_hash != plan.content_hash():
        raise PlanFormatError(
            f"{source}: hash {stored_hash} does not match the content ({plan.content_hash()}); "
            "the file was edited or truncated"
        )
    return plan


def read_plan(path: str | Path) -> Plan:
    """Read a Plan document from ``path``."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise PlanFormatError(f"{path}: cannot read the plan: {error.strerror}") from None
    return plan_from_json(text, str(path))


def write_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` to ``path`` atomically (a temp file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(plan.to_json() + "\n")
    tmp.replace(path)


def plan_json_schema() -> dict[str, Any]:
    """The JSON schema of the Plan document."""
    schema = Plan.model_json_schema()
    schema["$id"] = PLAN_VERSION
    return schema


def path_name(path: Sequence[Any]) -> str:
    """A pytree key path as a parameter's name in a plan: ``"layers/0/attn/q/kernel"``.

    ``path`` is what ``jax.tree_util.tree_flatten_with_path`` gives (entries with a
    ``key``, ``idx`` or ``name``); the planner names parameters so when it reads a traced
    step, and the trainer so when it places and checkpoints them.
    """
    parts = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)
