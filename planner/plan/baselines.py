"""The plans a user could have written by hand, costed by the same model as ours.

- data parallel: one stage on every device, the batch split everywhere, parameters
  replicated, gradients all-reduced once per step.
- ZeRO-2: data parallel with gradients reduce-scattered and the optimizer state and
  update sharded over every device (parameters all-gathered after the update).
- ZeRO-2 with expert parallelism (DeepSpeed-MoE, the paper's MoE baseline): ZeRO-2,
  except that experts are split over the devices (every tensor with an expert
  dimension, :mod:`~alpajob.planner.graph.experts`, split along it), so tokens reach their
  expert by an all-to-all; only for models with stacked experts.
- Megatron-style 3-D grid: every dp x tp x pp with tp inside a node, layers split as
  evenly as possible over pp stages, each stage on a (dp, tp) logical mesh. The
  sharding inside a stage is the ILP's on that mesh, which is at least as good as
  Megatron's hand-written column/row split (so this baseline is, if anything,
  stronger than Megatron-LM).
- equal layer / equal operator (the paper's ablations, section 8.4): the DP may still
  choose submeshes, but every stage holds the same number of layers, or the same number
  of operators.

Every baseline tries every micro-batch count it is given and keeps its best. A baseline
that cannot fit memory at any setting is None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

import numpy as np

from alpajob.planner.graph.experts import expert_dims
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.inter_op.search import (
    Candidate,
    CostContext,
    StageRequest,
    best_of,
    dp_candidate,
    evaluate_stages,
)
from alpajob.planner.intra_op.solve import ShardingMode


class Baseline(StrEnum):
    """The baselines, named as in the plan document's ``baselines`` object."""

    DATA = "data-parallel"
    ZERO2 = "zero2"
    EXPERT_ZERO2 = "zero2-expert"
    MEGATRON = "megatron-3d"
    EQUAL_LAYER = "equal-layer"
    EQUAL_OPERATOR = "equal-operator"


def whole_cluster(context: CostContext) -> tuple[tuple[int, int], tuple[int, int]]:
    """The submesh covering the cluster, and its natural logical mesh (nodes x devices)."""
    n, m = context.cluster.num_nodes, context.cluster.devices_per_node
    return (n, m), (n, m)


def data_parallel(
    context: CostContext, micro_batches: Sequence[int], mode: ShardingMode = ShardingMode.DATA
) -> Candidate | None:
    """Data parallelism (or ZeRO-2 with ``mode=ZERO2``, with expert parallelism too with
    ``mode=EXPERT_ZERO2``) on the whole cluster. With experts every logical mesh of the
    cluster is tried: splitting the experts over one axis and replicating them over
    the other is how DeepSpeed runs fewer experts than devices (its expert-parallel
    degree)."""
    submesh, natural = whole_cluster(context)
    # With experts the expert-parallel degree is the user's choice: every logical mesh.
    shape = None if mode is ShardingMode.EXPERT_ZERO2 else natural
    last = len(context.layers) - 1
    name = {
        ShardingMode.DATA: Baseline.DATA, ShardingMode.ZERO2: Baseline.ZERO2,
        ShardingMode.EXPERT_ZERO2: Baseline.EXPERT_ZERO2,
    }[mode].value
    return best_of(
        [
            evaluate_stages(context, [StageRequest(0, last, submesh, shape)], b, mode, name)
            for b in micro_batches
        ]
    )


def even_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers 0..L-1 into ``num_stages`` contiguous ranges whose sizes differ by ≤ 1.

    >>> even_ranges(5, 2)
    [(0, 1), (2, 4)]
    """
    bounds = np.linspace(0, num_layers, num_stages + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def megatron_grids(context: CostContext) -> list[list[StageRequest]]:
    """Every dp x tp x pp grid Megatron-LM would run on the cluster (tp within a node,
    even layers per stage), as the stages it asks for. A stage's devices tile nodes as
    every submesh does: a part of one node that divides it, or whole nodes (24 GPUs in
    two stages of 12 is no grid of 8-GPU nodes)."""
    n_devices = context.cluster.num_devices
    per_node = context.cluster.devices_per_node
    n_layers = len(context.layers)
    grids: list[list[StageRequest]] = []
    tp = 1
    while tp <= per_node:
        pp = 1
        while pp <= min(n_layers, n_devices // tp):
            stage_devices = n_devices // pp
            if n_devices % (pp * tp) == 0 and _tiles_nodes(stage_devices, per_node):
                dp = stage_devices // tp
                if stage_devices <= per_node:
                    submesh = (1, stage_devices)
                else:
                    submesh = (stage_devices // per_node, per_node)
                # tp = 1 is the flat data-parallel mesh (1, dp): the same ILPs as the DP's.
                shape = (dp, tp) if tp > 1 else (1, dp)
                grids.append([StageRequest(a, b, submesh, shape) for a, b in even_ranges(n_layers, pp)])
            pp *= 2
        tp *= 2
    return grids


def _tiles_nodes(devices: int, per_node: int) -> bool:
    """A part of one node that divides it, or whole nodes."""
    return per_node % devices == 0 if devices <= per_node else devices % per_node == 0


def megatron_grid(context: CostContext, micro_batches: Sequence[int]) -> Candidate | None:
    """The best of :func:`megatron_grids` (a pipeline needs at least as many
    micro-batches as stages)."""
    return best_of([
        evaluate_stages(context, requests, b, ShardingMode.AUTO, Baseline.MEGATRON.value)
        for requests in megatron_grids(context) for b in micro_batches
        if len(requests) == 1 or b >= len(requests)
    ])


def megatron_own_grids(context: CostContext) -> list[list[StageRequest]]:
    """The grids of :func:`megatron_grids` on logical meshes the inter-op DP does not
    try (:meth:`~alpajob.planner.inter_op.search.CostContext.shapes`, e.g. dp 4 x tp 2
    on one node of 8, whose transpose the DP tries instead): the ILPs only the
    Megatron baseline needs."""
    dp_submeshes = set(context.submeshes())
    return [requests for requests in megatron_grids(context)
            if requests[0].submesh not in dp_submeshes
            or requests[0].shape not in context.shapes(requests[0].submesh)]


def _stage_counts(context: CostContext) -> list[int]:
    limit = min(len(context.layers), context.cluster.num_devices)
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def _only_ranges(ranges: Sequence[tuple[int, int]]):
    allowed = np.zeros((len(ranges) and ranges[-1][1] + 1,) * 2, dtype=bool)
    for a, b in ranges:
        allowed[a, b] = True

    def mask(cost: np.ndarray) -> np.ndarray:
        return np.where(allowed[:, :, None], cost, np.inf)

    return mask


def _fixed_slicing(
    context: CostContext,
    micro_batches: Sequence[int],
    ranges_for: Callable[[int], list[tuple[int, int]]],
    name: str,
) -> Candidate | None:
    """The DP with stage boundaries fixed by ``ranges_for(number of stages)``: it only
    chooses each stage's submesh (and its logical mesh and memory level)."""
    found: list[Candidate | None] = []
    for p in _stage_counts(context):
        mask = _only_ranges(ranges_for(p))
        for b in micro_batches:
            found.append(dp_candidate(context, b, mask=mask, num_stages=p, name=name))
    return best_of(found)


def equal_layer(context: CostContext, micro_batches: Sequence[int]) -> Candidate | None:
    """The DP restricted to stages of equal layer counts (paper's "equal layer")."""
    n_layers = len(context.layers)
    return _fixed_slicing(context, micro_batches, lambda p: even_ranges(n_layers, p),
                          Baseline.EQUAL_LAYER.value)


def operator_ranges(op_counts: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """Cut layers so each of ``num_stages`` stages holds about the same number of ops.

    The cut before layer k is placed where the running op count is closest to
    q · total / num_stages; ranges stay non-empty.
    """
    cumulative = np.cumsum(op_counts)
    total = cumulative[-1]
    cuts = [0]
    for q in range(1, num_stages):
        target = q * total / num_stages
        k = int(np.argmin(np.abs(cumulative - target))) + 1
        k = min(max(k, cuts[-1] + 1), len(op_counts) - (num_stages - q))
        cuts.append(k)
    cuts.append(len(op_counts))
    return [(a, b - 1) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def equal_operator(context: CostContext, micro_batches: Sequence[int]) -> Candidate | None:
    """The DP restricted to stages of equal operator counts (paper's "equal operator")."""
    counts = [len(ops) for ops in context.layers]
    return _fixed_slicing(context, micro_batches, lambda p: operator_ranges(counts, p),
                          Baseline.EQUAL_OPERATOR.value)


def all_baselines(
    context: CostContext, micro_batches: Sequence[int]
) -> dict[str, Candidate | None]:
    """Every baseline's best candidate, by name (None where it never fits memory);
    ZeRO-2 with expert parallelism only for a model with experts."""
    found = {
        Baseline.DATA.value: data_parallel(context, micro_batches, ShardingMode.DATA),
        Baseline.ZERO2.value: data_parallel(context, micro_batches, ShardingMode.ZERO2),
    }
    if has_experts(context.graph):
        found[Baseline.EXPERT_ZERO2.value] = data_parallel(
            context, micro_batches, ShardingMode.EXPERT_ZERO2
        )
    found[Baseline.MEGATRON.value] = megatron_grid(context, micro_batches)
    found[Baseline.EQUAL_LAYER.value] = equal_layer(context, micro_batches)
    found[Baseline.EQUAL_OPERATOR.value] = equal_operator(context, micro_batches)
    return found


def has_experts(graph: OpGraph) -> bool:
    """Whether the step has stacked experts (:func:`~alpajob.planner.graph.experts.expert_dims`)."""
    return bool(expert_dims(graph))
