"""Expert dimensions: which dimension of which tensor indexes a mixture's experts.

Expert parallelism (GShard, DeepSpeed-MoE) places each expert's weights on its own
devices and moves tokens to them with an all-to-all. To cost it as a baseline the
planner must know, for every tensor, whether one of its dimensions runs over the
experts. Nothing in a traced step names them, but the structure does: experts are
parameters *stacked* along a dimension that the matmul consuming them treats as a
batch dimension (``egch,ehf->egcf``: one independent ``[c, h] @ [h, f]`` per expert
``e``). So:

1. **Seeds.** For every ``dot_general``, each batch dimension of an operand that is a
   parameter (possibly through same-shape elementwise ops such as a dtype cast) is an
   expert dimension.
2. **Propagation.** Dimensions that must be split alike are joined (union-find over
   ``(tensor, dim)`` pairs):

   - a ``dot_general``'s batch dimensions: lhs, rhs and output, position by position;
   - an elementwise op's same-shaped operands and outputs, dimension by dimension
     (this joins a parameter with its gradient, its optimizer state and its update);
   - ``broadcast_in_dim``: operand dimension ``i`` and output dimension
     ``broadcast_dimensions[i]`` when their sizes agree;
   - reductions: the kept dimensions of the operand and the output, in order;
   - reshapes that only add or drop dimensions of size 1 (``b[:, None, None]``): the
     other dimensions, in order.

   Transposes and other reshapes join nothing: that is where the tokens change layout,
   and where expert parallelism pays its all-to-all (``[g, e, c, h]`` split on the
   groups ``g`` becomes ``[e, g, c, h]`` split on the experts).

A tensor's expert dimension is the first of its dimensions in a class that holds a
seed. A dense model has none.
"""

from __future__ import annotations

from alpajob.planner.graph.opgraph import Op, OpGraph, TensorRole
from alpajob.planner.intra_op.strategies import OpKind, op_kind

Dim = tuple[int, int]  # (tensor id, dimension)


class _Classes:
    """Union-find over ``(tensor, dim)`` pairs."""

    def __init__(self) -> None:
        self.parent: dict[Dim, Dim] = {}

    def find(self, x: Dim) -> Dim:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while x != root:  # path compression
            self.parent[x], x = root, self.parent.get(x, x)
        return root

    def join(self, a: Dim, b: Dim) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def _joins(op: Op, graph: OpGraph) -> list[tuple[Dim, Dim]]:
    """The pairs of dimensions op ``op`` ties together (module docstring, step 2)."""
    shape = graph.tensor
    kind = op_kind(op.primitive)
    pairs: list[tuple[Dim, Dim]] = []
    if kind is OpKind.DOT and len(op.inputs) == 2 and op.outputs:
        lhs_batch, rhs_batch = op.param("batch", ((), ()))
        lhs, rhs = op.inputs
        for position, (a, b) in enumerate(zip(lhs_batch, rhs_batch, strict=True)):
            pairs.append(((lhs, a), (op.outputs[0], position)))
            pairs.append(((rhs, b), (op.outputs[0], position)))
    elif kind is OpKind.ELEMENTWISE:
        values = (*op.inputs, *op.outputs)
        for out in op.outputs:
            rank = len(shape(out).shape)
            for t in values:
                if t != out and shape(t).shape == shape(out).shape:
                    pairs.extend(((t, d), (out, d)) for d in range(rank))
    elif kind is OpKind.BROADCAST and op.inputs and op.outputs:
        src_shape, out_shape = shape(op.inputs[0]).shape, shape(op.outputs[0]).shape
        for i, d in enumerate(op.param("broadcast_dimensions", ())):
            if src_shape[i] == out_shape[d]:
                pairs.append(((op.inputs[0], i), (op.outputs[0], d)))
    elif kind is OpKind.RESHAPE and op.inputs and op.outputs:
        src_shape, out_shape = shape(op.inputs[0]).shape, shape(op.outputs[0]).shape
        kept_in = [d for d, n in enumerate(src_shape) if n != 1]
        kept_out = [d for d, n in enumerate(out_shape) if n != 1]
        if [src_shape[d] for d in kept_in] == [out_shape[d] for d in kept_out]:
            pairs.extend(((op.inputs[0], a), (op.outputs[0], b))
                         for a, b in zip(kept_in, kept_out, strict=True))
    elif kind is OpKind.REDUCE and op.inputs and op.outputs:
        axes = set(op.param("axes", ()) or ())
        kept = [d for d in range(len(shape(op.inputs[0]).shape)) if d not in axes]
        if len(kept) == len(shape(op.outputs[0]).shape):
            pairs.extend(((op.inputs[0], d), (op.outputs[0], k)) for k, d in enumerate(kept))
    return pairs


def _param_like(graph: OpGraph) -> set[int]:
    """Parameters, and what same-shaped unary elementwise ops make of them (casts)."""
    found = {t for t in graph.params}
    for op in graph.ops:
        if (op_kind(op.primitive) is OpKind.ELEMENTWISE and len(op.inputs) == 1
                and op.inputs[0] in found and len(op.outputs) == 1
                and graph.tensor(op.outputs[0]).shape == graph.tensor(op.inputs[0]).shape):
            found.add(op.outputs[0])
    return found


def expert_dims(graph: OpGraph) -> dict[int, int]:
    """Tensor id -> its expert dimension, for every tensor that has one (see the module
    docstring); empty for a model without stacked experts."""
    params = _param_like(graph)
    seeds: list[Dim] = []
    classes = _Classes()
    for op in graph.ops:
        if op_kind(op.primitive) is OpKind.DOT and len(op.inputs) == 2:
            for operand, dims in zip(op.inputs, op.param("batch", ((), ())), strict=True):
                if operand in params:
                    seeds.extend((operand, d) for d in dims)
        for a, b in _joins(op, graph):
            classes.join(a, b)
    if not seeds:
        return {}
    expert_roots = {classes.find(s) for s in seeds}
    found: dict[int, int] = {}
    for dim in list(classes.parent) + seeds:
        t, d = dim
        if classes.find(dim) in expert_roots and (t not in found or d < found[t]):
            found[t] = d
    return found


def expert_count(graph: OpGraph) -> int | None:
    """The number of experts (the size of a parameter's expert dimension), or None."""
    dims = expert_dims(graph)
    sizes = {graph.tensor(t).shape[d] for t, d in dims.items()
             if graph.tensor(t).role is TensorRole.PARAM}
    return max(sizes) if sizes else None
