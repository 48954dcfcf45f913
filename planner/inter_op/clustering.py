"""Layer clustering (Alpa eq. 6): cut the forward ops into L balanced layers.

The stage DP (:mod:`alpajob.planner.inter_op.stage_dp`) works on "layers", so the op
sequence is first cut into ``L`` contiguous groups of forward ops. Alpa's eq. 6
chooses the cuts that minimise the largest communication into any one layer,

    G(k, r) = min over i <= k of  max(G(i - 1, r - 1), C(i, k))
              subject to  FLOP(i..k) <= (1 + eps) * FLOP_total / L

where ``G(k, r)`` is the best bottleneck for cutting ops ``1..k`` into ``r`` layers and
``C(i, k)`` is the bytes of activations that ops ``i..k`` read from ops before ``i``.
Among the cuttings with the least bottleneck, Alpa prefers balanced FLOPs; here
that second objective is the sum of squared layer FLOPs (the variance, as the
total and L are fixed). The lexicographic pair is solved exactly in two passes:
the bottleneck DP above gives the optimum ``C*``, then an additive DP minimises the
sum of squares using only layers with ``C <= C*`` (a one-pass DP on the pair would
not be exact: a prefix with a lower bottleneck but worse balance can lose once a
later layer sets the bottleneck).

Worked example: 4 ops with FLOPs 1, 1, 1, 1, L = 2, eps = 0.5 (cap 3). Crossing
bytes are 8 into op 2, 2 into op 3 and 8 into op 4 (a layer starting at op 1 reads
nothing): cutting before op 3 costs 2, the others 8, so the layers are {1, 2}, {3, 4}.

What the FLOPs and bytes are
----------------------------
- A forward op's FLOPs include those of the backward and update ops anchored to it
  (:attr:`~alpajob.planner.graph.opgraph.Op.anchor`), so layers balance the whole training
  step's work, which is what a pipeline stage's latency follows.
- ``C`` counts each activation once per layer: a tensor produced by a forward op
  before the layer and read by a forward op inside it. Parameters and batch inputs
  are step inputs, not activations, and are not counted.

Coarsening (why it stays fast)
------------------------------
With K forward ops the DP is O(K^2 L); GPT-39B has K ~ 5000. Cuts are therefore only
allowed at one position between any two consecutive heavy ops (``dot_general``,
``conv_general_dilated``): the position where the fewest activation bytes are live
(produced before, read at or after), typically right after a residual add. Long
heavy-free stretches are split into pieces of at most ``ceil(K / (8 L))`` positions,
each offering its best position too. The units between allowed cuts (a few hundred
for a transformer: about one heavy op each) are what :func:`cluster_kernel`
partitions, with the crossing bytes of every unit range precomputed in O(E + P^2)
by a 2-D difference array (E = producer/consumer pairs, P = units).

If no cutting into L layers meets the FLOP cap (one unit heavier than the cap, such
as an LM head bigger than 1.5 transformer blocks), epsilon is doubled until one does,
keeping L. Only when fewer units than layers exist is L lowered: the result may then
have fewer layers than asked. L = 1 always succeeds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from alpajob.planner.graph.opgraph import OpGraph, Phase

#: Primitives whose positions delimit allowed cuts, and which define model blocks.
HEAVY_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})

#: Most layers :func:`default_num_layers` proposes (the stage DP is sized for 48).
MAX_DEFAULT_LAYERS = 48

_REL_TOL = 1e-9


def cluster_kernel(
    flops: np.ndarray,
    cross_bytes: np.ndarray | Callable[[int, int], float],
    num_layers: int,
    epsilon: float,
) -> tuple[int, ...] | None:
    """Cut ``P`` units into ``num_layers`` contiguous groups by eq. 6 (pure numpy).

    ``flops[u]``: work of unit ``u``. ``cross_bytes[a, b]`` (or ``cross_bytes(a, b)``),
    for ``a < b``: bytes entering the group of units ``a..b-1`` from earlier units.
    Every group must have FLOPs ``<= (1 + epsilon) * sum(flops) / num_layers``.
    Returns boundaries ``(0, b_1, ..., P)`` (group g is units ``b_g .. b_{g+1} - 1``)
    minimising first the largest group's crossing bytes, then the sum of squared
    group FLOPs; None when no cutting into exactly ``num_layers`` groups meets the cap.

    Example: flops [1, 1, 1, 1], cross[a, b] = 8 except cross[2, b] = 2 and
    cross[0, b] = 0, L = 2 -> (0, 2, 4).
    """
    flops = np.asarray(flops, dtype=np.float64)
    num_units = flops.size
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if num_layers > num_units:
        return None
    if callable(cross_bytes):
        fn = cross_bytes
        cross = np.zeros((num_units + 1, num_units + 1))
        for a in range(num_units):
            for b in range(a + 1, num_units + 1):
                cross[a, b] = fn(a, b)
    else:
        cross = np.asarray(cross_bytes, dtype=np.float64)
        if cross.shape != (num_units + 1, num_units + 1):
            raise ValueError(
                f"cross_bytes must have shape {(num_units + 1, num_units + 1)}, got {cross.shape}"
            )
    total = float(flops.sum())
    scale = total if total > 0 else 1.0
    prefix = np.r_[0.0, np.cumsum(flops)] / scale
    group = prefix[None, :] - prefix[:, None]  # group[a, b] = share of units a..b-1
    cap = (1 + epsilon) * (total / scale) / num_layers
    allowed = np.triu(np.ones((num_units + 1, num_units + 1), dtype=bool), k=1)
    allowed &= group <= cap * (1 + _REL_TOL) + _REL_TOL
    bottleneck = np.where(allowed, cross, np.inf)

    # Pass 1: G[q, b] = least largest crossing for units 0..b-1 in q groups.
    g = np.full(num_units + 1, np.inf)
    g[0] = 0.0
    for _ in range(num_layers):
        g = np.min(np.maximum(g[:, None], bottleneck), axis=0)
    best_cross = g[num_units]
    if not np.isfinite(best_cross):
        return None

    # Pass 2: least sum of squared group FLOPs using groups with crossing <= C*.
    square = np.where(allowed & (bottleneck <= best_cross), group**2, np.inf)
    h = np.full(num_units + 1, np.inf)
    h[0] = 0.0
    argmins = []
    for _ in range(num_layers):
        candidates = h[:, None] + square
        argmins.append(np.argmin(candidates, axis=0))
        h = candidates[argmins[-1], np.arange(num_units + 1)]
    bounds = [num_units]
    for q in range(num_layers - 1, -1, -1):
        bounds.append(int(argmins[q][bounds[-1]]))
    return tuple(reversed(bounds))


def _unit_cuts(heavy: list[int], live: np.ndarray, num_forward: int, piece: int) -> list[int]:
    """Allowed cut positions (a cut at x starts a layer at forward op x, 1 <= x < K).

    One per stretch between consecutive heavy ops (before the first, after the
    last), at the least-live position; stretches longer than ``piece`` positions are
    split evenly and each piece offers its least-live position (the last one on ties).
    """
    starts = [1, *(h + 1 for h in heavy)]
    ends = [*heavy, num_forward - 1]
    cuts = []
    for lo, hi in zip(starts, ends, strict=True):
        hi = min(hi, num_forward - 1)
        if lo > hi:
            continue
        positions = np.arange(lo, hi + 1)
        for chunk in np.array_split(positions, math.ceil(positions.size / piece)):
            # The last least-live position: a matmul keeps its elementwise epilogue.
            cuts.append(int(chunk[chunk.size - 1 - np.argmin(live[chunk][::-1])]))
    return sorted(set(cuts))


@dataclass(frozen=True)
class _Units:
    """The coarsened forward program the kernel partitions.

    ``forward``: forward op ids in program order. Unit ``u`` is forward positions
    ``bounds[u] .. bounds[u + 1] - 1``; ``flops[u]`` its work (anchored ops included);
    ``cross[a, b]`` the activation bytes entering units ``a .. b - 1`` from before.
    """

    forward: tuple[int, ...]
    bounds: np.ndarray
    flops: np.ndarray
    cross: np.ndarray


def _coarsen(graph: OpGraph, num_layers: int) -> _Units:
    """Allowed cuts, unit FLOPs and the crossing bytes of every unit range."""
    forward = [op.id for op in graph.ops if op.phase is Phase.FORWARD]
    position = {op_id: pos for pos, op_id in enumerate(forward)}
    num_forward = len(forward)
    if num_forward == 0:
        raise ValueError(f"graph {graph.name!r} has no forward ops to cluster into layers")

    op_flops = np.zeros(num_forward)
    for op in graph.ops:
        if op.anchor not in position:
            raise ValueError(
                f"op {op.id} ({op.primitive}) of graph {graph.name!r} is anchored to "
                f"{op.anchor}, which is not a forward op"
            )
        op_flops[position[op.anchor]] += op.flops

    # Forward producer/consumer positions of every activation, as parallel arrays.
    producer = {
        t: position[op.id] for op in graph.ops if op.phase is Phase.FORWARD for t in op.outputs
    }
    consumers: dict[int, set[int]] = {}
    for op in graph.ops:
        if op.phase is Phase.FORWARD:
            for t in op.inputs:
                if t in producer:
                    consumers.setdefault(t, set()).add(position[op.id])
    prev_pos: list[int] = []
    cons_pos: list[int] = []
    weight: list[float] = []
    live_diff = np.zeros(num_forward + 1)
    for t, users in consumers.items():
        ordered = sorted(users)
        nbytes = float(graph.tensors[t].nbytes)
        prev_pos += [producer[t], *ordered[:-1]]
        cons_pos += ordered
        weight += [nbytes] * len(ordered)
        live_diff[producer[t] + 1] += nbytes
        live_diff[ordered[-1] + 1] -= nbytes
    live = np.cumsum(live_diff)  # live[x] = bytes live across a cut before position x

    heavy = [
        pos for pos, op_id in enumerate(forward) if graph.ops[op_id].primitive in HEAVY_PRIMITIVES
    ]
    piece = max(1, math.ceil(num_forward / (8 * num_layers)))
    cuts = _unit_cuts(heavy, live, num_forward, piece) if num_forward > 1 else []
    bounds = np.asarray([0, *cuts, num_forward])
    num_units = bounds.size - 1
    unit_flops = np.add.reduceat(op_flops, bounds[:-1])

    # cross[a, b]: tensors with a consumer v and previous producer/consumer u such that
    # bounds[a] in (u, v] and bounds[b] > v, summed by a 2-D difference array.
    cross = np.zeros((num_units + 2, num_units + 2))
    if weight:
        prev_arr, cons_arr, w = np.asarray(prev_pos), np.asarray(cons_pos), np.asarray(weight)
        a_lo = np.searchsorted(bounds, prev_arr, side="right")
        a_hi = np.searchsorted(bounds, cons_arr, side="right") - 1
        keep = a_lo <= a_hi
        a_lo, a_hi, w = a_lo[keep], a_hi[keep], w[keep]
        np.add.at(cross, (a_lo, a_hi + 1), w)
        np.add.at(cross, (a_hi + 1, a_hi + 1), -w)
        cross = np.cumsum(np.cumsum(cross, axis=0), axis=1)
    cross = cross[: num_units + 1, : num_units + 1]
    return _Units(forward=tuple(forward), bounds=bounds, flops=unit_flops, cross=cross)


def cluster_layers(
    graph: OpGraph, num_layers: int, epsilon: float = 0.5
) -> tuple[tuple[int, ...], ...]:
    """Cut ``graph`` into at most ``num_layers`` layers (Alpa eq. 6).

    Returns, per layer, the sorted ids of all its ops: its contiguous range of
    forward ops (program order) plus every backward and update op whose ``anchor``
    lies in that range. Every op is in exactly one layer. Fewer layers than asked
    come back when the coarsened graph cannot make ``num_layers`` (module docstring).

    Example: an MLP whose forward is dot, add, dot, add and whose backward ops
    anchor to them, with L = 2: layer 0 = the first dot and add and their backward
    ops; layer 1 = the rest.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    units = _coarsen(graph, num_layers)
    num_units = units.bounds.size - 1
    count = min(num_layers, num_units)
    layer_bounds = _periodic_bounds(graph, units, count, epsilon)
    if layer_bounds is not None:
        return _layers_from_bounds(graph, units, layer_bounds)
    # One unit heavier than the cap (an LM head bigger than 1.5 blocks) makes eq. 6
    # infeasible; relax the slack (doubling epsilon) rather than drop layers: fewer,
    # unequal layers would defeat reusing one ILP solution across identical layers.
    layer_bounds = _relaxed_kernel(units.flops, units.cross, count, epsilon)
    while layer_bounds is None and count > 1:
        count -= 1
        layer_bounds = cluster_kernel(units.flops, units.cross, count, epsilon)
    if layer_bounds is None:  # pragma: no cover - one layer always meets its cap
        raise RuntimeError("layer clustering found no cutting, not even one layer")
    return _layers_from_bounds(graph, units, layer_bounds)


def _relaxed_kernel(
    flops: np.ndarray, cross: np.ndarray, count: int, epsilon: float
) -> tuple[int, ...] | None:
    """:func:`cluster_kernel`, doubling epsilon while no cutting meets the FLOP cap."""
    bounds = cluster_kernel(flops, cross, count, epsilon)
    slack = max(epsilon, 0.5)
    total = float(np.sum(flops))
    while bounds is None and total > 0 and (1 + slack) * total / count < 2 * total:
        slack *= 2
        bounds = cluster_kernel(flops, cross, count, slack)
    return bounds


def _periodic_bounds(
    graph: OpGraph, units: _Units, count: int, epsilon: float
) -> tuple[int, ...] | None:
    """Eq. 6 with every cut at the same phase of the model's repeated block.

    A transformer's blocks are identical, but eq. 6's tie-break (balanced FLOPs, with
    an embedding and a head to balance against) can cut block 3 before its MLP and
    block 9 after it. Layers that differ cannot share an ILP solution, so when the
    heavy ops repeat with period p (:func:`heavy_period`), cuts are restricted to the
    positions preceded by k·p + φ heavy ops, for each phase φ; the phase whose cutting
    scores best on eq. 6 (bottleneck bytes, then sum of squared FLOPs) wins. None when
    there is no period or too few blocks for ``count`` layers.
    """
    period = heavy_period(graph)
    forward = units.forward
    heavy_before = np.cumsum(
        [0, *(graph.ops[op_id].primitive in HEAVY_PRIMITIVES for op_id in forward)]
    )
    if period is None or count < 2 or count > heavy_before[-1] // period:
        return None  # no blocks, or layers smaller than a block
    inner = np.arange(1, units.bounds.size - 1)
    phase_of_cut = heavy_before[units.bounds[inner]] % period
    for kernel in (cluster_kernel, _relaxed_kernel):  # strict balance first
        best: tuple[tuple[float, float], tuple[int, ...]] | None = None
        for phase in range(period):
            allowed = inner[phase_of_cut == phase]
            if allowed.size + 1 < count:
                continue
            keep = np.asarray([0, *allowed, units.bounds.size - 1])
            flops = np.add.reduceat(units.flops, keep[:-1])
            cross = units.cross[np.ix_(keep, keep)]
            reduced = kernel(flops, cross, count, epsilon)
            if reduced is None:
                continue
            bounds = tuple(int(keep[b]) for b in reduced)
            pairs = list(itertools.pairwise(bounds))
            score = (
                max(float(units.cross[a, b]) for a, b in pairs),
                float(sum(np.sum(units.flops[a:b]) ** 2 for a, b in pairs)),
            )
            if best is None or score < best[0]:
                best = (score, bounds)
        if best is not None:
            return best[1]
    return None


def _layers_from_bounds(
    graph: OpGraph, units: _Units, layer_bounds: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """Per layer, the sorted ids of its forward ops and of the ops anchored to them."""
    layer_of_forward_op = {}
    for layer, (lo, hi) in enumerate(itertools.pairwise(layer_bounds)):
        for op_id in units.forward[units.bounds[lo] : units.bounds[hi]]:
            layer_of_forward_op[op_id] = layer
    layers: list[list[int]] = [[] for _ in range(len(layer_bounds) - 1)]
    for op in graph.ops:
        layers[layer_of_forward_op[op.anchor]].append(op.id)
    return tuple(tuple(sorted(ids)) for ids in layers)


def heavy_period(graph: OpGraph) -> int | None:
    """The number of heavy ops per repeated block, or None without a clear period.

    The forward heavy ops (dot/conv) are written as tokens (primitive, FLOPs). For
    each period ``p`` (at least two repeats) the score is the share of tokens equal
    to the one ``p`` later. The block size is the smallest ``p`` scoring within 0.05
    of the best score, provided that best is at least 0.75.
    """
    heavy = [op for op in graph.forward_ops() if op.primitive in HEAVY_PRIMITIVES]
    count = len(heavy)
    periods = np.arange(1, count // 2 + 1)
    if not periods.size:
        return None
    _, tokens = np.unique(
        np.asarray([f"{op.primitive}:{round(op.flops)}" for op in heavy]), return_inverse=True
    )
    scores = np.asarray([np.mean(tokens[:-p] == tokens[p:]) for p in periods])
    if scores.max() < 0.75:
        return None
    return int(periods[np.argmax(scores >= scores.max() - 0.05)])


def default_num_layers(graph: OpGraph) -> int:
    """A sensible L: the number of repeated blocks, capped at 48.

    The forward heavy ops (dot/conv) are written as tokens (primitive, FLOPs). For
    each period ``p`` (at least two repeats) the score is the share of tokens equal
    to the one ``p`` later. The block size is the smallest ``p`` scoring within 0.05
    of the best score, provided that best is at least 0.75, and ``H // p`` blocks
    are counted (H = heavy ops). A head or tail op such as the LM head barely lowers
    the score; multiples of the true period score as well, hence the smallest; a
    transformer's equal q/k/v projections give period 1 a score, but a lower one.
    Without a period, a block is taken to hold 4 heavy ops (a residual block: 3
    convs plus the shortcut; attention's 4 to 8 matmuls). More than 48 blocks are
    grouped evenly, ``blocks // ceil(blocks / 48)`` layers of whole blocks: 48 is
    GPT-39B's depth and the size the stage DP is tuned for (L^3 work).

    Example: GPT with 48 blocks of 8 matmuls plus the LM head: H = 385, p = 8, 48.
    No heavy op at all: 1 layer.
    """
    forward = graph.forward_ops()
    count = sum(op.primitive in HEAVY_PRIMITIVES for op in forward)
    if count == 0:
        return 1
    period = heavy_period(graph)
    blocks = count // period if period else math.ceil(count / 4)
    if blocks > MAX_DEFAULT_LAYERS:
        blocks //= math.ceil(blocks / MAX_DEFAULT_LAYERS)
    return max(1, min(blocks, len(forward)))
