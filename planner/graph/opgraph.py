"""The op graph: the planner's view of one training step, as plain data.

A training step (forward, backward, optimizer update) is traced by
:mod:`alpajob.planner.graph.extract` into an :class:`OpGraph`. Every JAX equation becomes an
:class:`Op` that reads and writes :class:`Tensor` s by id. Nothing here imports JAX, so
every solver downstream can be tested with hand-made graphs.

Conventions
-----------
- Ops are in program order, which is a topological order; ``Op.id`` is the position.
- ``Op.phase`` says which part of the step an op belongs to. ``Op.anchor`` is the id of
  the forward op it is attributed to: itself for a forward op; for a backward op, the
  forward op whose residuals it consumes (so the gradient of a layer lands in the
  layer); for an update op, the first forward op that reads its parameter. Layer
  clustering cuts the forward ops; every other op follows its anchor.
- Loop bodies (``scan``) are inlined once, with ``flops`` and ``bytes_accessed`` already
  multiplied by the trip count (``multiplier``).
- ``Tensor.batch_dim`` is the dimension that scales with the global batch (found by
  tracing at two batch sizes), or None. :func:`with_batch_size` rescales a graph to
  another (micro-)batch size without tracing again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

#: Bytes per element of the dtypes a training step uses.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class Phase(StrEnum):
    """Which part of the training step an op belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


class TensorRole(StrEnum):
    """What a tensor is, for memory accounting and sharding rules."""

    PARAM = "param"  # a model parameter (step input)
    OPT_STATE = "opt_state"  # optimizer state (step input), e.g. Adam moments
    BATCH = "batch"  # a batch input (step input)
    ACTIVATION = "activation"  # anything an op produces
    CONSTANT = "constant"  # a captured constant


@dataclass(frozen=True)
class Tensor:
    """One value of the step: its id, shape, dtype name and role."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    role: TensorRole
    batch_dim: int | None = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)  # 1 for a scalar

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) tensor."""
        return self.size * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class Op:
    """One equation of the step.

    ``params`` holds the sharding-relevant parameters of the primitive as sorted
    ``(name, value)`` pairs of plain ints/tuples/strings, for example for
    ``dot_general``: ``(("batch", ((0,), (0,))), ("contracting", ((2,), (1,))))``.
    See :mod:`alpajob.planner.graph.extract` for the list kept per primitive.
    """

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float
    bytes_accessed: float
    phase: Phase
    anchor: int
    params: tuple[tuple[str, Any], ...] = ()
    multiplier: int = 1

    def param(self, name: str, default: Any = None) -> Any:
        """The value of primitive parameter ``name`` (``default`` when absent)."""
        for key, value in self.params:
            if key == name:
                return value
        return default


@dataclass(frozen=True)
class OpGraph:
    """A traced training step.

    ``params``/``opt_state``/``batch`` are the ids of the step's input tensors;
    ``grads`` (aligned with ``params``) and ``loss`` are the values the backward pass
    produces; ``new_params`` (aligned with ``params``) are the updated parameters.
    ``batch_size`` is the global batch the shapes are given at.
    """

    name: str
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    params: tuple[int, ...]
    opt_state: tuple[int, ...]
    batch: tuple[int, ...]
    loss: int
    grads: tuple[int, ...]
    new_params: tuple[int, ...]
    batch_size: int
    param_names: tuple[str, ...] = ()

    def tensor(self, tensor_id: int) -> Tensor:
        """The tensor with id ``tensor_id``."""
        return self.tensors[tensor_id]

    @property
    def num_parameters(self) -> int:
        """Number of model parameters (elements)."""
        return sum(self.tensors[t].size for t in self.params)

    @property
    def total_flops(self) -> float:
        """FLOPs of one whole training step."""
        return float(sum(op.flops for op in self.ops))

    def forward_ops(self) -> list[Op]:
        """The forward ops, in program order."""
        return [op for op in self.ops if op.phase is Phase.FORWARD]

    def producers(self) -> dict[int, int]:
        """Map tensor id -> id of the op that produces it (step inputs are absent)."""
        return {t: op.id for op in self.ops for t in op.outputs}

    def fingerprint(self) -> str:
        """A stable hash of the graph's structure (ops, shapes, dtypes, flops).

        Equal for two traces of the same model at the same batch size; used by the
        trainer to refuse a plan made for another model.
        """
        digest = hashlib.sha256()
        for tensor in self.tensors:
            digest.update(f"{tensor.shape}{tensor.dtype}{tensor.role.value}".encode())
        for op in self.ops:
            digest.update(
                f"{op.primitive}{op.inputs}{op.outputs}{op.phase.value}{op.params}".encode()
            )
        digest.update(str(self.batch_size).encode())
        return digest.hexdigest()[:16]


def batch_size_problem(graph: OpGraph, batch_size: int) -> str | None:
    """Why ``graph`` cannot be rescaled to ``batch_size`` (see :func:`with_batch_size`),
    or None: every batch dimension must scale to a whole number of at least 1."""
    if batch_size <= 0:
        return f"batch_size must be positive, got {batch_size}"
    ratio = batch_size / graph.batch_size
    checked: set[int] = set()
    for tensor in graph.tensors:
        if tensor.batch_dim is None or tensor.shape[tensor.batch_dim] in checked:
            continue
        old = tensor.shape[tensor.batch_dim]
        checked.add(old)
        new = old * ratio
        if abs(new - round(new)) > 1e-9 or round(new) < 1:
            return (f"tensor {tensor.id} has batch dimension {old}, which batch size "
                    f"{batch_size} cannot scale from {graph.batch_size}")
    return None


def with_batch_size(graph: OpGraph, batch_size: int) -> OpGraph:
    """Rescale ``graph`` to another global (or micro-) batch size.

    Each tensor's ``batch_dim`` is multiplied by ``batch_size / graph.batch_size`` (it
    must divide evenly); FLOPs and bytes of an op that touches any batch-carrying
    tensor scale by the same ratio, the others (the optimizer update) stay. This is
    exact for the zoo's models, where every batch-dependent op is linear in the batch.

    Example: a graph traced at batch 1024 rescaled to 128 divides every activation's
    leading dimension by 8 and the FLOPs of every forward and backward op by 8.
    """
    if batch_size == graph.batch_size:
        return graph
    problem = batch_size_problem(graph, batch_size)
    if problem is not None:
        raise ValueError(problem)
    ratio = batch_size / graph.batch_size
    tensors = []
    for tensor in graph.tensors:
        if tensor.batch_dim is None:
            tensors.append(tensor)
            continue
        shape = list(tensor.shape)
        shape[tensor.batch_dim] = int(round(shape[tensor.batch_dim] * ratio))
        tensors.append(dataclasses.replace(tensor, shape=tuple(shape)))
    batched = {t.id for t in graph.tensors if t.batch_dim is not None}
    ops = []
    for op in graph.ops:
        if batched.intersection(op.inputs) or batched.intersection(op.outputs):
            op = dataclasses.replace(
                op, flops=op.flops * ratio, bytes_accessed=op.bytes_accessed * ratio
            )
        ops.append(op)
    return dataclasses.replace(graph, tensors=tuple(tensors), ops=tuple(ops), batch_size=batch_size)


def local_tensor_order(graph: OpGraph, op_ids: Iterable[int]) -> list[int]:
    """Tensor ids touched by ``op_ids``, in order of first appearance (inputs, then outputs).

    Two structurally identical layers list their tensors in corresponding order, so the
    i-th tensor of one plays the role of the i-th tensor of the other: this is how one
    ILP solution is reused across identical layers.
    """
    seen: dict[int, None] = {}
    for op_id in sorted(op_ids):
        op = graph.ops[op_id]
        for tensor_id in (*op.inputs, *op.outputs):
            seen.setdefault(tensor_id, None)
    return list(seen)


def subgraph_signature(graph: OpGraph, op_ids: Iterable[int]) -> str:
    """A hash of the structure of a set of ops, independent of tensor ids.

    Two transformer layers have the same signature, so one ILP solution serves both.
    Tensors are renumbered by :func:`local_tensor_order`; a tensor's role and whether
    it is produced inside the set are part of the structure.
    """
    op_ids = sorted(op_ids)
    index = {t: i for i, t in enumerate(local_tensor_order(graph, op_ids))}
    produced = {t for op_id in op_ids for t in graph.ops[op_id].outputs}

    def describe(tensor_id: int) -> tuple[int, tuple[int, ...], str, str, bool]:
        tensor = graph.tensors[tensor_id]
        return (index[tensor_id], tensor.shape, tensor.dtype, tensor.role.value,
                tensor_id in produced)

    parts = []
    for op_id in op_ids:
        op = graph.ops[op_id]
        parts.append(
            (
                op.primitive,
                op.phase.value,
                tuple(describe(t) for t in op.inputs),
                tuple(describe(t) for t in op.outputs),
                op.params,
                round(op.flops),
            )
        )
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
