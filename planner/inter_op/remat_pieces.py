"""Block parts: the pieces a rematerialised layer is recomputed in, finer than a layer.

A rematerialised layer keeps its inputs between forward and backward, and while its
backward runs it holds all its residuals again (recomputed) plus the backward's own
working set. When one layer is big (a clustered layer of several transformer blocks,
an MoE block with its experts) that transient is what does not fit. Recomputing the
layer in smaller pieces, each one a block part (attention, MLP, an expert FFN, a
residual unit), holds one piece's residuals at a time, at the price of keeping each
piece's inputs too. The runtime already recomputes a stage as a chain of pieces
(:mod:`alpajob.trainer_image.runtime.remat`); this module chooses the pieces.

**Where a piece may start.** The runtime cuts a stage at parameters: the plan names
the piece that first reads each parameter, and the equations that read no parameter
go where the fewest bytes cross. So a piece starts at a forward op that reads a
parameter no earlier op of the layer read (a transformer block offers its layer
norms, q/k/v, the output projection, the MLP's two matmuls). The ``P`` stretches
between two such ops are the units; a piece is a run of units.

**What a cutting costs.** With every tensor unsharded, a piece ``(a, b)`` (units
``a .. b - 1``) has a transient ``T(a, b)``, its residuals plus its backward working
set (live while it recomputes, once per stage), and a keep ``K(a, b)``, the bytes its
forward reads from earlier pieces of the layer (kept per in-flight micro-batch and per
layer of the stage). A cutting costs ``max T + keep * sum K``, where ``keep`` is the
number of kept copies the cutting is chosen for. One piece is the whole layer (plain
per-layer remat); more pieces hold less at a time and keep more.

**The exact cutting.** For a cap ``c`` on ``T``, the least ``sum K`` over cuttings
whose pieces all have ``T <= c`` is a shortest path over unit boundaries,
``f(b) = min over a < b with T(a, b) <= c of f(a) + keep * K(a, b)``. Trying every
distinct ``T`` as the cap and taking the least ``c + keep * f(P)`` is exact: the best
cutting's largest ``T`` is one of the caps tried. Each piece also costs one byte, so
that among equal cuttings the fewest pieces win. ``P`` is 6 to 35 for the zoo's
layers, at most :data:`MAX_UNITS`: ``P^2 / 2`` pieces are analysed, once per layer
class per plan search (0.3 s for GPT-39B's three classes).

Which ``keep`` is right depends on the stage (its layers times its in-flight
micro-batches), which the per-layer tables cannot know, so the planner offers two
cuttings (:data:`~.stage_costs.MEMORY_LEVELS`): one for a stage that keeps many
copies (8: four layers with two micro-batches in flight, or one layer with eight)
and one for a stage that keeps one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpajob.planner.graph.opgraph import OpGraph, Phase, TensorRole
from alpajob.planner.graph.subset import GraphIndex, Subset, analyse_subset, busiest_bytes

#: Most units a layer is cut at (``P``): a layer of many blocks (a whole model
#: clustered as one layer) keeps every few allowed starts, evenly by position, so
#: that the ``P^2 / 2`` pieces analysed stay a few hundred.
MAX_UNITS = 32


@dataclass(frozen=True)
class PieceCosts:
    """Every piece one layer may be cut into, unsharded (module docstring).

    ``forward``: the layer's forward op ids in program order; ``starts``: the
    positions among them where a piece may start, then their count;
    ``transient[a, b]`` and ``kept[a, b]``: ``T`` and ``K`` of the piece of units
    ``a .. b - 1`` (``a < b``).
    """

    forward: tuple[int, ...]
    starts: tuple[int, ...]
    transient: np.ndarray
    kept: np.ndarray


@dataclass(frozen=True)
class LayerPieces:
    """One layer cut into pieces.

    ``cut``: where each piece starts, as positions among the layer's forward ops in
    program order, then their count (a layer of the same structure class is cut at
    the same positions). ``pieces[p]``: the sorted op ids of piece ``p``: a
    contiguous run of the layer's forward ops, with the ops anchored to them.
    ``subsets[p]``: :func:`~alpajob.planner.graph.subset.analyse_subset` of piece ``p``
    (its residuals and backward lifetimes). ``inner[p]``: the forward values piece
    ``p`` reads from earlier pieces of the layer (what it keeps).
    """

    cut: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    subsets: tuple[Subset, ...]
    inner: tuple[tuple[int, ...], ...]

    def memory(self, size: Callable[[int], float]) -> tuple[float, float]:
        """(transient, kept) bytes with tensor sizes ``size``: the largest piece's
        residuals plus its backward working set, and the values the pieces keep."""
        transient = max(
            sum(size(t) for t in subset.residuals) + busiest_bytes(subset.lifetimes, size)
            for subset in self.subsets
        )
        return transient, sum(size(t) for inner in self.inner for t in inner)


@dataclass
class PieceCutter:
    """Chooses the cut of every layer class once per plan search.

    The cut is chosen on ``graph`` as traced (the global batch), whatever micro-batch
    a :class:`~.stage_costs.LayerCoster` prices it at: residuals and working sets
    scale with the batch, so the choice barely depends on it, and choosing it once
    keeps every coster and every worker process on the same cut. ``layers``: op ids
    per layer, as in the costers.
    """

    graph: OpGraph
    layers: Sequence[Sequence[int]]
    _index: GraphIndex | None = None
    _costs: dict[int, PieceCosts] = field(default_factory=dict)
    _cuts: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def cut(self, layer: int, keep: int) -> tuple[int, ...]:
        """:func:`best_cut` of ``layer`` for ``keep`` kept copies (cached)."""
        if (layer, keep) not in self._cuts:
            if layer not in self._costs:
                if self._index is None:
                    self._index = GraphIndex.build(self.graph)
                self._costs[layer] = piece_costs(self.graph, self.layers[layer], self._index)
            self._cuts[(layer, keep)] = best_cut(self._costs[layer], keep)
        return self._cuts[(layer, keep)]

    def cuts(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """The cuts chosen so far, per (layer, kept copies) (to send to another process)."""
        return dict(self._cuts)

    def absorb(self, cuts: dict[tuple[int, int], tuple[int, ...]]) -> None:
        """Take the cuts another cutter of the same graph and layers chose (the choice
        is deterministic, so they are the ones this one would choose)."""
        for key, cut in cuts.items():
            self._cuts.setdefault(key, cut)


def piece_costs(graph: OpGraph, ops: Sequence[int], index: GraphIndex) -> PieceCosts:
    """``T`` and ``K`` of every piece of the layer of op ids ``ops``, unsharded."""
    forward = tuple(sorted(o for o in ops if graph.ops[o].phase is Phase.FORWARD))
    allowed = _piece_starts(graph, forward)
    if len(allowed) > MAX_UNITS:  # a layer of many blocks: every few allowed starts
        allowed = [allowed[len(allowed) * k // MAX_UNITS] for k in range(MAX_UNITS)]
    starts = (*allowed, len(forward))
    anchored = _anchored(graph, ops)
    made_at = _made_at(graph, forward)
    size = _size(graph)
    units = len(starts) - 1
    transient = np.full((units + 1, units + 1), np.inf)
    kept = np.zeros((units + 1, units + 1))
    for a in range(units):
        for b in range(a + 1, units + 1):
            run = forward[starts[a]:starts[b]]
            subset = analyse_subset(graph, [o for f in run for o in anchored.get(f, [f])], index)
            transient[a, b] = sum(map(size, subset.residuals)) + busiest_bytes(subset.lifetimes, size)
            kept[a, b] = sum(map(size, _read_from_before(graph, forward, made_at, starts[a], starts[b])))
    return PieceCosts(forward, starts, transient, kept)


def best_cut(costs: PieceCosts, keep: int) -> tuple[int, ...]:
    """The cutting of least ``max T + keep * sum K`` (module docstring), as the
    forward positions where its pieces start, then the layer's end."""
    units = len(costs.starts) - 1
    best: tuple[float, list[int]] | None = None
    for cap in np.unique(costs.transient[np.isfinite(costs.transient)]):
        allowed = costs.transient <= cap
        path = np.full(units + 1, np.inf)
        path[0] = 0.0
        back = np.zeros(units + 1, dtype=np.int64)
        for b in range(1, units + 1):
            options = np.where(allowed[:b, b], path[:b] + keep * costs.kept[:b, b] + 1.0, np.inf)
            back[b] = int(np.argmin(options))
            path[b] = options[back[b]]
        if not np.isfinite(path[units]):
            continue
        total = float(cap) + float(path[units])
        if best is None or total < best[0]:
            bounds = [units]
            while bounds[-1] > 0:
                bounds.append(int(back[bounds[-1]]))
            best = (total, bounds[::-1])
    assert best is not None  # the whole layer is always allowed at the largest cap
    return tuple(costs.starts[u] for u in best[1])


def layer_pieces(graph: OpGraph, ops: Sequence[int], cut: Sequence[int], index: GraphIndex) -> LayerPieces:
    """The layer of op ids ``ops`` cut before the forward positions ``cut`` (the first
    0, the last the layer's end): its pieces, their subsets and what each keeps."""
    forward = sorted(o for o in ops if graph.ops[o].phase is Phase.FORWARD)
    anchored = _anchored(graph, ops)
    made_at = _made_at(graph, forward)
    pieces, subsets, inner = [], [], []
    for a, b in zip(cut[:-1], cut[1:], strict=True):
        piece = tuple(sorted(o for f in forward[a:b] for o in anchored.get(f, [f])))
        pieces.append(piece)
        subsets.append(analyse_subset(graph, piece, index))
        inner.append(tuple(sorted(_read_from_before(graph, forward, made_at, a, b))))
    return LayerPieces(tuple(cut), tuple(pieces), tuple(subsets), tuple(inner))


def piece_of_forward(graph: OpGraph, ops: Sequence[int], cut: Sequence[int]) -> dict[int, int]:
    """Forward op id -> its piece, for the layer of op ids ``ops`` cut at ``cut``."""
    forward = sorted(o for o in ops if graph.ops[o].phase is Phase.FORWARD)
    return {op_id: piece for piece, (a, b) in enumerate(zip(cut[:-1], cut[1:], strict=True))
            for op_id in forward[a:b]}


def _piece_starts(graph: OpGraph, forward: Sequence[int]) -> list[int]:
    """Positions in ``forward`` where a piece may start: 0, and every op that reads a
    parameter no earlier op read."""
    params = set(graph.params)
    seen: set[int] = set()
    starts = [0]
    for position, op_id in enumerate(forward):
        new = {t for t in graph.ops[op_id].inputs if t in params} - seen
        if new and position > 0:
            starts.append(position)
        seen |= new
    return starts


def _anchored(graph: OpGraph, ops: Sequence[int]) -> dict[int, list[int]]:
    """Forward op id -> it and the backward and update ops anchored to it."""
    anchored: dict[int, list[int]] = {}
    for op_id in ops:
        anchored.setdefault(graph.ops[op_id].anchor, []).append(op_id)
    return anchored


def _size(graph: OpGraph) -> Callable[[int], float]:
    """A tensor's unsharded bytes."""
    return lambda t: graph.tensors[t].nbytes


def _made_at(graph: OpGraph, forward: Sequence[int]) -> dict[int, int]:
    """Tensor -> the position among ``forward`` of the op that makes it."""
    return {t: position for position, o in enumerate(forward) for t in graph.ops[o].outputs}


def _read_from_before(
    graph: OpGraph, forward: Sequence[int], made_at: dict[int, int], a: int, b: int
) -> set[int]:
    """Activations that the forward ops at positions ``a .. b - 1`` read and a forward
    op of the layer before position ``a`` made (``made_at``: :func:`_made_at`)."""
    return {t for o in forward[a:b] for t in graph.ops[o].inputs
            if made_at.get(t, a) < a and graph.tensors[t].role is TensorRole.ACTIVATION}
