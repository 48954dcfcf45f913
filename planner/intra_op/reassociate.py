"""Partial sums added before they are reduced (XLA's all-reduce reassociation).

A parameter used twice, such as a tied embedding (looked up by the ids, then
projected back onto the vocabulary), gets a gradient that is the sum of two
contributions. With the batch split, each contribution is a partial sum that its
op's strategy all-reduces (or reduce-scatters). XLA's ``AllReduceReassociate`` pass
rewrites ``all-reduce(a) + all-reduce(b)`` into ``all-reduce(a + b)``, so the step
runs one collective where the two strategies list two.

The ILP sees the two contributions on two nodes (each root op owns its strategy), so
the saving is a pairwise term: :func:`find_pairs` finds each ``add`` / ``add_any`` whose
two operands come, through layout-only followers (transpose, reshape, convert), from
root ops on different nodes; :func:`refund` is the edge between those nodes that gives
back one collective's seconds for every pair of strategies whose final reductions
match (same kind, axes and bytes, and the operands arrive in the same spec);
:func:`merged_reduction` says, for a chosen pair of strategies, whether the second
reduction is folded into the first (the realised step then lists one).

Only direct pairs are found: a sum of three contributions saves one collective, not
two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from alpajob.planner.graph.opgraph import Op, OpGraph
from alpajob.planner.intra_op.collectives import Collective, CollectiveKind
from alpajob.planner.intra_op.op_tables import PerStrategy
from alpajob.planner.intra_op.sharding import ShardSpec
from alpajob.planner.intra_op.strategies import OpKind, Strategy, op_kind

#: Followers that only move a partial sum's elements (so it stays a partial sum).
_LAYOUT = frozenset({OpKind.TRANSPOSE, OpKind.RESHAPE})
_LAYOUT_PRIMITIVES = frozenset({"convert_element_type", "copy", "copy_p"})
_SUMS = frozenset({"add", "add_any"})
_REDUCTIONS = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


class _NodeView(Protocol):
    """What the model builder knows about nodes (``nodes.ModelNodes``)."""

    op_node: dict[int, int]
    op_strategies: dict[int, PerStrategy[Strategy]]
    tensor_specs: dict[int, PerStrategy[ShardSpec]]


@dataclass(frozen=True)
class Pair:
    """``add_op`` sums ``tensors[0]`` and ``tensors[1]``, made (through layout ops) by
    root ops ``roots[0]`` and ``roots[1]`` on two nodes."""

    add_op: int
    roots: tuple[int, int]
    tensors: tuple[int, int]


def _root_of(t: int, producer: Mapping[int, Op]) -> int | None:
    """The root op a tensor is a layout-only view of, or None."""
    op = producer.get(t)
    while op is not None and len(op.inputs) == 1 and (
        op_kind(op.primitive) in _LAYOUT or op.primitive in _LAYOUT_PRIMITIVES
    ):
        op = producer.get(op.inputs[0])
    if op is None or op_kind(op.primitive).is_follower:
        return None
    return op.id


def find_pairs(graph: OpGraph, op_ids: Sequence[int], nodes: _NodeView) -> list[Pair]:
    """Every two-operand sum of ``op_ids`` whose operands are partial-sum candidates
    from root ops on different nodes (see the module docstring)."""
    producer = {t: graph.ops[o] for o in op_ids for t in graph.ops[o].outputs}
    pairs = []
    for op_id in op_ids:
        op = graph.ops[op_id]
        if op.primitive not in _SUMS or len(op.inputs) != 2:
            continue
        roots = [_root_of(t, producer) for t in op.inputs]
        if None in roots:
            continue
        a, b = (int(r) for r in roots if r is not None)
        if nodes.op_node[a] != nodes.op_node[b]:
            pairs.append(Pair(op_id, (a, b), (op.inputs[0], op.inputs[1])))
    return pairs


def final_reduction(strategy: Strategy) -> Collective | None:
    """The all-reduce or reduce-scatter that finishes a strategy's output, if any."""
    reductions = [c for c in strategy.collectives if c.kind in _REDUCTIONS]
    return reductions[-1] if reductions else None


def _keys(nodes: _NodeView, root: int, tensor: int) -> tuple[list[object], dict[object, float]]:
    """Per strategy of the root's node: (its final reduction, the operand's spec) as
    a key (None where nothing is reduced); and each key's seconds."""
    strategies, specs = nodes.op_strategies[root], nodes.tensor_specs[tensor]
    keys: list[object] = []
    seconds: dict[object, float] = {}
    for i in range(len(strategies)):
        c = final_reduction(strategies[i])
        key = None if c is None else (c.kind, c.axes, c.nbytes, specs[i])
        keys.append(key)
        if c is not None:
            seconds[key] = c.seconds
    return keys, seconds


def refund(pair: Pair, nodes: _NodeView) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """``(u, v, seconds, u_class, v_class)``: an edge between the two roots' nodes,
    over classes of equal keys, worth minus one reduction where the keys match."""
    (a, b), (ta, tb) = pair.roots, pair.tensors
    keys_a, _ = _keys(nodes, a, ta)
    keys_b, seconds = _keys(nodes, b, tb)
    classes: dict[object, int] = {}
    u_class = np.array([classes.setdefault(k, len(classes)) for k in keys_a], dtype=np.int64)
    v_class = np.array([classes.setdefault(k, len(classes)) for k in keys_b], dtype=np.int64)
    saved = np.zeros(len(classes))
    for key, c in classes.items():
        if key is not None and key in seconds and key in keys_a:
            saved[c] = seconds[key]
    return nodes.op_node[a], nodes.op_node[b], -np.diag(saved), u_class, v_class


def merged_reduction(first: Strategy, second: Strategy, first_spec: ShardSpec,
                     second_spec: ShardSpec) -> Collective | None:
    """The second strategy's reduction when the pair's chosen strategies reduce alike
    (XLA then runs the first one on the sum), else None."""
    a, b = final_reduction(first), final_reduction(second)
    if a is None or b is None or first_spec != second_spec:
        return None
    if (a.kind, a.axes, a.nbytes) != (b.kind, b.axes, b.nbytes):
        return None
    return b
