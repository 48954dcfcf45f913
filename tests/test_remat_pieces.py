"""Block parts: the cutting of a layer for rematerialisation finer than a layer.

The cutting is exact: on every layer of the four zoo families small enough to
enumerate, it costs what the best of all cuttings at the allowed positions costs
(brute force). The pieces cover the layer, start where a parameter is first read,
and cut a GPT layer of four blocks so that it holds less at a time than the layer.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from alpajob.planner.graph.opgraph import Phase
from alpajob.planner.graph.subset import GraphIndex
from alpajob.planner.inter_op.clustering import cluster_layers
from alpajob.planner.inter_op.remat_pieces import (
    LayerPieces,
    best_cut,
    layer_pieces,
    piece_costs,
    piece_of_forward,
)
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo.registry import resolve_model

GPT2 = {"hidden": 64, "layers": 2, "heads": 4, "seqLen": 128, "vocab": 256}
FAMILIES = {"gpt": (GPT2, 2), "moe": ("tiny", 2), "wresnet": ("tiny", 4), "mlp": ("tiny", 2)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def layered(request: Any) -> Any:
    config, num_layers = FAMILIES[request.param]
    graph = graph_of(resolve_model(request.param, config), 8, optimizer="sgd")
    return graph, cluster_layers(graph, num_layers), GraphIndex.build(graph)


def _cost(graph: Any, pieces: LayerPieces, keep: int) -> float:
    transient, kept = pieces.memory(lambda t: graph.tensors[t].nbytes)
    return transient + keep * kept


@pytest.mark.parametrize("keep", [1, 8])
def test_the_cutting_is_the_best_of_all(layered: Any, keep: int) -> None:
    """Against every cutting at the allowed positions: priced piece by piece from
    scratch (``layer_pieces``) where there are at most 2^10, from the per-piece
    tables (up to 2^19) otherwise; the chosen cutting's table price is its price."""
    graph, layers, index = layered
    checked = 0
    for ops in layers:
        costs = piece_costs(graph, ops, index)
        starts, end = costs.starts[1:-1], costs.starts[-1]
        if len(starts) > 19:
            continue
        checked += 1
        cut = best_cut(costs, keep)
        chosen = _cost(graph, layer_pieces(graph, ops, cut, index), keep)
        units = [costs.starts.index(p) for p in cut]
        pairs = list(itertools.pairwise(units))
        assert chosen == pytest.approx(max(costs.transient[a, b] for a, b in pairs)
                                       + keep * sum(costs.kept[a, b] for a, b in pairs))
        if len(starts) <= 10:
            every = [_cost(graph, layer_pieces(graph, ops, (0, *inner, end), index), keep)
                     for r in range(len(starts) + 1) for inner in itertools.combinations(starts, r)]
        else:
            every = []
            for r in range(len(starts) + 1):
                for inner in itertools.combinations(range(1, len(starts) + 1), r):
                    run = list(itertools.pairwise((0, *inner, len(starts) + 1)))
                    every.append(max(costs.transient[a, b] for a, b in run)
                                 + keep * sum(costs.kept[a, b] for a, b in run))
        assert chosen == pytest.approx(min(every), rel=1e-9)
    assert checked


def test_pieces_cover_the_layer_and_start_at_parameters(layered: Any) -> None:
    graph, layers, index = layered
    params = set(graph.params)
    for ops in layers:
        cut = best_cut(piece_costs(graph, ops, index), 1)
        pieces = layer_pieces(graph, ops, cut, index)
        assert sorted(o for piece in pieces.pieces for o in piece) == sorted(ops)
        forward = sorted(o for o in ops if graph.ops[o].phase is Phase.FORWARD)
        placed = piece_of_forward(graph, ops, cut)
        assert [placed[o] for o in forward] == sorted(placed[o] for o in forward)  # contiguous runs
        for start in cut[1:-1]:
            read_before = {t for o in forward[:start] for t in graph.ops[o].inputs}
            assert (set(graph.ops[forward[start]].inputs) & params) - read_before


def test_a_layer_of_four_blocks_is_cut_and_holds_less() -> None:
    graph = graph_of(resolve_model("gpt", {**GPT2, "layers": 4}), 8, optimizer="sgd")
    (ops,) = cluster_layers(graph, 1)
    index = GraphIndex.build(graph)
    costs = piece_costs(graph, ops, index)
    one = costs.transient[0, -1]
    for keep in (1, 8):
        cut = best_cut(costs, keep)
        assert len(cut) > 2, keep
        pieces = layer_pieces(graph, ops, cut, index)
        transient, kept = pieces.memory(
            lambda t: graph.tensors[t].nbytes)
        assert transient + keep * kept < one
        assert transient < 0.6 * one
    # keeping more copies never cuts finer
    assert len(best_cut(costs, 8)) <= len(best_cut(costs, 1))
    assert np.all(np.isinf(costs.transient[np.tril_indices(len(costs.starts))]))  # pieces: a < b
