"""The collectives a sharding performs, and how many XLA runs once it combines them.

A :class:`Collective` is one collective over some mesh axes: an op's strategy makes
all-reduces and reduce-scatters (partial sums of a split contracting or reduced
dim), a resharding between ops makes all-gathers and all-to-alls
(:func:`~alpajob.planner.intra_op.sharding.reshard_collectives`), and weight-update
sharding turns a gradient's all-reduce into a reduce-scatter plus an all-gather of
the new parameter. :class:`PlannedCollective` places one in the step: which op or
tensor, and whether it runs per micro-batch or once per step.

Counting (:func:`count_collectives`) follows what the compiled step contains, the
measure Alpa's tests assert on: XLA's all-reduce, reduce-scatter and all-gather
combiners merge independent collectives of one kind over the same devices, so the
once-per-step gradient synchronisations of one kind over one set of axes become a
single collective. Per micro-batch, given the graph, the combiner is followed
greedily in program order: a collective joins the open group of its kind and axes
unless its input depends on a member of that group (then it opens a new one).
BatchNorm's mean and mean of squares are one all-reduce; the all-reduces on a
Megatron data path, each waiting for the one before, stay apart. Without the graph
every per-micro-batch collective counts. All-reduces of scalars (the loss averaged
over a split batch) can be left out, as Alpa's ``ignore_scalar_all_reduce`` does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from alpajob.planner.graph.opgraph import OpGraph


class CollectiveKind(StrEnum):
    """A collective a sharding performs (an op's strategy: all-reduce, reduce-scatter;
    a resharding between ops: all-gather, all-to-all)."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class Collective:
    """One collective: over mesh ``axes``, ``nbytes`` per device group, ``seconds``."""

    kind: CollectiveKind
    axes: tuple[int, ...]
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class PlannedCollective:
    """A collective in the step: made by op ``op`` (its strategy) or on its input
    ``tensor`` (a resharding; ``op`` None for a gradient resharded to its parameter
    or a parameter gathered after a sharded update), per micro-batch or per step."""

    collective: Collective
    op: int | None
    tensor: int | None
    per_step: bool
    #: Elements of the tensor the collective produces (0 unknown); 1 for a scalar.
    elements: int = 0


def count_collectives(
    collectives: Iterable[PlannedCollective],
    graph: OpGraph | None = None,
    *,
    ignore_scalar_all_reduce: bool = False,
) -> Counter[CollectiveKind]:
    """How many collectives of each kind the compiled step runs (module docstring):
    per-step ones of one kind over the same axes count once; per-micro-batch ones
    combine when independent (given ``graph``), else each counts."""
    counts: Counter[CollectiveKind] = Counter()
    merged: set[tuple[CollectiveKind, tuple[int, ...]]] = set()
    on_path: list[PlannedCollective] = []
    for planned in collectives:
        c = planned.collective
        if (ignore_scalar_all_reduce and c.kind is CollectiveKind.ALL_REDUCE
                and planned.elements == 1):
            continue
        if planned.per_step or planned.op is None:
            key = (c.kind, c.axes)
            if key not in merged:
                merged.add(key)
                counts[c.kind] += 1
        elif graph is None:
            counts[c.kind] += 1
        else:
            on_path.append(planned)
    counts.update(_combined(on_path, graph) if graph is not None else Counter())
    return counts


_Key = tuple[CollectiveKind, tuple[int, ...]]


def _combined(collectives: list[PlannedCollective], graph: OpGraph) -> Counter[CollectiveKind]:
    """Greedy combining in program order (ops are topologically ordered): each tensor
    knows, per kind and axes, the latest group it depends on; a collective whose
    input depends on the open group of its key opens a new group."""
    at_op: dict[int, list[PlannedCollective]] = {}
    for planned in collectives:
        if planned.op is not None:
            at_op.setdefault(planned.op, []).append(planned)
    depends: dict[int, dict[_Key, int]] = {}
    open_group: dict[_Key, int] = {}
    counts: Counter[CollectiveKind] = Counter()

    def join(key: _Key, seen: dict[_Key, int]) -> int:
        if key not in open_group or seen.get(key) == open_group[key]:
            open_group[key] = open_group.get(key, -1) + 1
            counts[key[0]] += 1
        return open_group[key]

    for op in graph.ops:
        seen: dict[_Key, int] = {}
        for t in op.inputs:
            for key, group in depends.get(t, {}).items():
                seen[key] = max(seen.get(key, -1), group)
        here = at_op.get(op.id, ())
        # Reshardings of the inputs run before the op, its own collectives after them.
        for planned in sorted(here, key=lambda p: p.tensor is None):
            key = (planned.collective.kind, planned.collective.axes)
            source = depends.get(planned.tensor, {}) if planned.tensor is not None else seen
            seen[key] = max(seen.get(key, -1), join(key, source))
        if seen:
            for t in op.outputs:
                depends[t] = seen
    return counts
