"""Resharding edges of the sharding ILP (the ``R[u, v]`` of Alpa's eq. 1).

Every tensor that one ILP node produces (or, for a boundary input, holds) and an op
of another node reads contributes a matrix: rows are the producer node's strategies,
columns the consumer node's, entry ``(i, j)`` the seconds to reshard the tensor from
its spec under ``i`` to the spec the consumer requires under ``j``
(:func:`~alpajob.planner.intra_op.sharding.resharding_seconds`). Strategies giving the tensor
the same spec share a row (a *class*), so a matrix is ``#specs x #specs``, not
``#strategies x #strategies``. Several tensors between the same two nodes merge into
one edge over the product of their classes.

An *equality* contribution forbids (``allowed = False``) every pair whose specs
differ; it ties a parameter to its updated value. Costs are kept in two buckets:
per micro-batch (``comm``) and per step (``update``), as for nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from alpajob.planner.intra_op.ilp import merge_classes


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


class EdgeBuilder:
    """Accumulates resharding contributions between nodes; one per model build.

    The matrices come from the caller (memoised per pair of spec sets by
    :class:`~alpajob.planner.intra_op.op_tables.TableCache`); they are never written to.
    """

    def __init__(self) -> None:
        self.contributions: dict[tuple[int, int], list[EdgeTables]] = {}

    def contribute(
        self,
        u: int,
        v: int,
        seconds: np.ndarray,
        allowed: np.ndarray,
        u_class: np.ndarray,
        v_class: np.ndarray,
        per_step: bool,
    ) -> None:
        """One tensor crossing from node ``u`` to node ``v``: ``seconds[a, b]`` to
        reshard it from its spec ``a`` (strategy ``i`` of ``u`` gives it spec
        ``u_class[i]``) into the spec ``b`` that strategy ``j`` of ``v`` requires
        (``v_class[j]``); ``allowed[a, b]`` False forbids the pair. Each side's
        distinct specs are its classes; ``per_step`` puts the seconds in the update
        bucket."""
        zero = np.zeros_like(seconds)
        comm, update = (zero, seconds) if per_step else (seconds, zero)
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
            u_rep, u_class = merge_classes([p.u_class for p in parts])
            v_rep, v_class = merge_classes([p.v_class for p in parts])
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
