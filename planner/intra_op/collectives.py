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
single collective, while collectives on the data path (each waits for the one
before) stay apart. All-reduces of scalars (the loss averaged over a split batch)
can be left out, as Alpa's ``ignore_scalar_all_reduce`` does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


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
    collectives: Iterable[PlannedCollective], *, ignore_scalar_all_reduce: bool = False
) -> Counter[CollectiveKind]:
    """How many collectives of each kind the compiled step runs (module docstring):
    per-step ones of one kind over the same axes count once."""
    counts: Counter[CollectiveKind] = Counter()
    merged: set[tuple[CollectiveKind, tuple[int, ...]]] = set()
    for planned in collectives:
        c = planned.collective
        if (ignore_scalar_all_reduce and c.kind is CollectiveKind.ALL_REDUCE
                and planned.elements == 1):
            continue
        if planned.per_step:
            key = (c.kind, c.axes)
            if key in merged:
                continue
            merged.add(key)
        counts[c.kind] += 1
    return counts
