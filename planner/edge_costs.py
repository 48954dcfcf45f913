"""Resharding edges of the sharding ILP (the ``R[u, v]`` of Alpa's eq. 1).

Every tensor that one ILP node produces (or, for a boundary input, holds) and an op
of another node reads contributes a matrix: rows are the producer node's strategies,
columns the consumer node's, entry ``(i, j)`` the seconds to reshard the tensor from
its spec under ``i`` to the spec the consumer requires under ``j``
(:func:`~alpajob.planner.sharding.resharding_seconds`). Strategies giving the tensor
the same spec share a row (a *class*), so a matrix is ``#specs x #specs``, not
``#strategies x #strategies``. Several tensors between the same two nodes merge into
one edge over the product of their classes.

An *equality* contribution forbids (``allowed = False``) every pair whose specs
differ; it ties a parameter to its updated value. Costs are kept in two buckets:
per micro-batch (``comm``) and per step (``update``), as for nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from alpajob.planner.cost_model import LogicalMesh
from alpajob.planner.graph import OpGraph
from alpajob.planner.sharding import ShardSpec, resharding_seconds

INF = float("inf")


class SpecsPerStrategy(Protocol):
    """Distinct specs and, per strategy of a node, which one (see
    :class:`~alpajob.planner.intra_op_model.PerStrategy`)."""

    @property
    def values(self) -> tuple[ShardSpec, ...]: ...

    @property
    def index(self) -> np.ndarray: ...


@dataclass(frozen=True, eq=False)
class EdgeTables:
    """Costs between two nodes over classes of their strategies (see ilp.Edge)."""

    u: int
    v: int
    u_class: np.ndarray
    v_class: np.ndarray
    comm: np.ndarray
    update: np.ndarray
    allowed: np.ndarray


def _merge_classes(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Product partition of several class labelings of the same strategies.

    Returns (representative class ids per merged class: shape (n, len(columns)),
    merged class per strategy).
    """
    if len(columns) == 1:
        col = columns[0]
        n = int(col.max()) + 1 if col.size else 0
        return np.arange(n)[:, None], col
    key = np.zeros_like(columns[0])
    for col in columns:
        key = key * (int(col.max()) + 1) + col
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rep = np.stack([col[first] for col in columns], axis=1)
    return rep, inverse.reshape(-1)


class EdgeBuilder:
    """Accumulates resharding contributions between nodes; one per model build."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh) -> None:
        self.graph = graph
        self.mesh = mesh
        self.reshard_cache: dict[tuple, float] = {}
        self.matrix_cache: dict[tuple, np.ndarray] = {}
        self.contributions: dict[tuple[int, int], list[EdgeTables]] = {}

    def reshard(self, tensor_id: int, src: ShardSpec, dst: ShardSpec) -> float:
        if src == dst:
            return 0.0
        tensor = self.graph.tensors[tensor_id]
        key = (tensor.shape, tensor.dtype, src, dst)
        cost = self.reshard_cache.get(key)
        if cost is None:
            cost = resharding_seconds(tensor.shape, tensor.dtype, src, dst, self.mesh)
            self.reshard_cache[key] = cost
        return cost

    def reshard_row(
        self, tensor_id: int, src: SpecsPerStrategy, dst: SpecsPerStrategy
    ) -> np.ndarray:
        """Resharding seconds strategy by strategy, ``src[i]`` to ``dst[i]`` (two
        labelings of the same node's strategies)."""
        if src.values == dst.values and np.array_equal(src.index, dst.index):
            return np.zeros(len(src.index))
        costs: dict[tuple[int, int], float] = {}
        row = []
        for pair in zip(src.index.tolist(), dst.index.tolist(), strict=True):
            cost = costs.get(pair)
            if cost is None:
                cost = costs[pair] = self.reshard(
                    tensor_id, src.values[pair[0]], dst.values[pair[1]]
                )
            row.append(cost)
        return np.array(row)

    def contribute(
        self,
        u: int,
        v: int,
        tensor_id: int,
        src: SpecsPerStrategy,
        dst: SpecsPerStrategy,
        per_step: bool,
        equality: bool = False,
    ) -> None:
        """One tensor crossing from node ``u`` (specs ``src`` per strategy of ``u``) to
        node ``v`` (required specs ``dst`` per strategy of ``v``); each side's distinct
        specs are its classes."""
        tensor = self.graph.tensors[tensor_id]
        key = (tensor.shape, tensor.dtype, src.values, dst.values, equality)
        matrix = self.matrix_cache.get(key)
        if matrix is None:
            matrix = np.zeros((len(src.values), len(dst.values)))
            for a, sa in enumerate(src.values):
                for b, sb in enumerate(dst.values):
                    if equality:
                        matrix[a, b] = 0.0 if sa == sb else INF
                    else:
                        matrix[a, b] = self.reshard(tensor_id, sa, sb)
            self.matrix_cache[key] = matrix
        allowed = np.isfinite(matrix)
        cost = np.where(allowed, matrix, 0.0)
        zero = np.zeros_like(cost)
        comm, update = (zero, cost) if per_step else (cost, zero)
        u_class, v_class = src.index, dst.index
        if u > v:
            u, v, u_class, v_class = v, u, v_class, u_class
            comm, update, allowed = comm.T, update.T, allowed.T
        self.contributions.setdefault((u, v), []).append(
            EdgeTables(u, v, u_class, v_class, comm, update, allowed)
        )

    def edges(self) -> list[EdgeTables]:
        """Merge the contributions per node pair over the product of their classes."""
        merged = []
        for (u, v), parts in sorted(self.contributions.items()):
            if len(parts) == 1:
                merged.append(parts[0])
                continue
            u_rep, u_class = _merge_classes([p.u_class for p in parts])
            v_rep, v_class = _merge_classes([p.v_class for p in parts])
            shape = (len(u_rep), len(v_rep))
            comm, update = np.zeros(shape), np.zeros(shape)
            allowed = np.ones(shape, dtype=bool)
            for i, p in enumerate(parts):
                index = np.ix_(u_rep[:, i], v_rep[:, i])
                comm += p.comm[index]
                update += p.update[index]
                allowed &= p.allowed[index]
            merged.append(EdgeTables(u, v, u_class, v_class, comm, update, allowed))
        return merged
