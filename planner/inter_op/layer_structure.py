"""What the layer clustering fixes about a graph, whatever the micro-batch size.

Every :class:`~alpajob.planner.inter_op.stage_costs.LayerCoster` (one per micro-batch
count and sharding mode) needs the same facts about its layers: which layers are
structurally identical (one ILP serves a class), the order of each layer's tensors
(to map a class representative's solution onto the other layers), and which tensors
cross from one layer to another. None of them depends on the batch size, so a plan
search computes them once (:func:`layer_structure`) and every coster shares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from alpajob.planner.graph.opgraph import OpGraph, local_tensor_order, subgraph_signature
from alpajob.planner.graph.subset import gradient_flow, parameter_derived

#: (tensor, producer layer, consumer layer) of a tensor used across layers.
Crossing = tuple[int, int, int]


@dataclass(frozen=True)
class LayerStructure:
    """Batch-size-independent facts about a graph's layers.

    ``layer_class[k]`` numbers layer k's structure class, ``representative[c]`` the
    first layer of class c; ``orders[k]`` lists layer k's tensors in a canonical
    order and ``position[k]`` inverts it; ``crossings`` holds every tensor used
    across layers; ``step_wise`` the tensors that cross once per step (values made
    from parameters alone, partial gradients of shared parameters); ``incoming[k]``
    the (tensor, producer layer) pairs entering layer k from earlier layers.
    """

    layer_class: tuple[int, ...]
    representative: tuple[int, ...]
    orders: tuple[tuple[int, ...], ...]
    position: tuple[dict[int, int], ...]
    crossings: tuple[Crossing, ...]
    step_wise: frozenset[int]
    incoming: tuple[tuple[tuple[int, int], ...], ...]


def layer_structure(graph: OpGraph, layers: Sequence[Sequence[int]]) -> LayerStructure:
    """Classes, tensor orders and crossings of ``layers`` (op ids) in ``graph``."""
    signatures: dict[str, int] = {}
    layer_class: list[int] = []
    representative: list[int] = []
    for index, ops in enumerate(layers):
        signature = subgraph_signature(graph, ops)
        if signature not in signatures:
            signatures[signature] = len(signatures)
            representative.append(index)
        layer_class.append(signatures[signature])
    orders = tuple(tuple(local_tensor_order(graph, ops)) for ops in layers)
    layer_of_op = np.empty(len(graph.ops), dtype=np.int64)
    for index, ops in enumerate(layers):
        layer_of_op[list(ops)] = index
    producer = graph.producers()
    found: set[Crossing] = set()
    for op in graph.ops:
        consumer_layer = int(layer_of_op[op.id])
        for tensor in op.inputs:
            if tensor in producer:
                producer_layer = int(layer_of_op[producer[tensor]])
                if producer_layer != consumer_layer:
                    found.add((tensor, producer_layer, consumer_layer))
    crossings = tuple(sorted(found))
    incoming: list[list[tuple[int, int]]] = [[] for _ in layers]
    for tensor, src, dst in crossings:
        if src < dst:
            incoming[dst].append((tensor, src))
    return LayerStructure(
        layer_class=tuple(layer_class),
        representative=tuple(representative),
        orders=orders,
        position=tuple({t: i for i, t in enumerate(order)} for order in orders),
        crossings=crossings,
        step_wise=frozenset(gradient_flow(graph)) | frozenset(parameter_derived(graph)),
        incoming=tuple(tuple(pairs) for pairs in incoming),
    )
