"""What an op subset (a layer or a stage) reads, writes and keeps alive.

The intra-op pass works on a subset of the training step's ops: one layer, with its
forward, backward and update ops. :func:`analyse_subset` answers the questions the
ILP needs about that subset, from the graph alone:

- boundary inputs: tensors the subset reads but does not produce (parameters,
  optimizer state, the batch, another layer's activations or incoming gradients);
- boundary outputs: tensors it produces that other ops read, or that the step
  returns (loss, gradients, new parameters);
- gradient flow: which tensors carry a parameter's gradient through linear ops only
  (``db = reshape(reduce_sum(dy))`` marks the reduce's output, not ``dy``, which
  scales with the batch); a collective on them is the once-per-step gradient
  synchronisation of gradient accumulation;
- weights (parameters and optimizer state read here, gradients produced here) and
  residuals: forward values (or step inputs) that a backward op of the subset reads,
  kept alive from the forward to the backward pass of each micro-batch;
- the backward's working set: when each tensor the subset's backward computes is
  live (:func:`backward_lifetimes`), for the memory it holds on top of the
  residuals while the backward runs.

What outside ops read and produce is a question about the whole graph (tens of
thousands of ops for a large model). A :class:`GraphIndex` flattens, in one Python
pass, who writes each tensor and which ops read it into arrays; build it once per
graph and pass it to every :func:`analyse_subset` of that graph, which then needs
one vectorised pass instead of a Python loop over every op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpajob.planner.cost.model import launches_kernel
from alpajob.planner.graph.opgraph import Op, OpGraph, Phase, TensorRole

#: Primitives through which a gradient's partial sums flow unchanged (linear).
GRAD_LINEAR = frozenset(
    {
        "convert_element_type", "reshape", "transpose", "add", "add_any", "copy",
        "squeeze", "expand_dims", "reduce_sum",
    }
)


@dataclass(frozen=True, eq=False)
class Subset:
    """The analysis of one op subset (see module docstring); tensor ids throughout."""

    op_ids: tuple[int, ...]
    #: Producer op of each tensor the subset produces.
    produced: dict[int, int]
    boundary_inputs: tuple[int, ...]
    boundary_outputs: tuple[int, ...]
    #: Tensor -> index into ``graph.params`` of the gradient it flows into.
    grad_param: dict[int, int]
    weights: tuple[int, ...]
    residuals: tuple[int, ...]
    #: Gradients produced here that no op of the subset reads (the update is elsewhere).
    lonely_grads: tuple[int, ...]
    #: ``(tensor, first, last)``: a backward tensor live from the subset's ``first``
    #: backward op to its ``last`` (see :func:`backward_lifetimes`).
    lifetimes: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, eq=False)
class GraphIndex:
    """Who reads and writes each tensor of one :class:`OpGraph`, as flat arrays from
    one pass over its ops (:meth:`build`). Immutable; build one per graph, share it.

    ``reader_op[i]`` reads ``reader_tensor[i]`` (one entry per op input), so "which
    of these tensors does an op outside the subset read" is one masked scatter.
    """

    graph: OpGraph
    reader_tensor: np.ndarray = field(repr=False)
    reader_op: np.ndarray = field(repr=False)
    #: Tensor id -> id of the last op that writes it, -1 for a step input.
    producer: np.ndarray = field(repr=False)
    #: The values the step returns: loss, gradients, new parameters.
    step_outputs: frozenset[int] = field(repr=False)

    @classmethod
    def build(cls, graph: OpGraph) -> GraphIndex:
        """The index of ``graph`` (one pass over its ops)."""
        ops = graph.ops
        ids = np.arange(len(ops))

        def flat(per_op: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
            counts = np.fromiter(map(len, per_op), np.int64, len(per_op))
            tensors = np.fromiter(itertools.chain.from_iterable(per_op), np.int64,
                                  int(counts.sum()))
            return tensors, np.repeat(ids, counts)

        reader_tensor, reader_op = flat([op.inputs for op in ops])
        written, writer = flat([op.outputs for op in ops])
        producer = np.full(len(graph.tensors), -1, dtype=np.int64)
        np.maximum.at(producer, written, writer)
        step_outputs = frozenset({graph.loss, *graph.grads, *graph.new_params})
        for array in (reader_tensor, reader_op, producer):
            array.setflags(write=False)
        return cls(graph, reader_tensor, reader_op, producer, step_outputs)

    def read_outside(self, op_ids: Sequence[int]) -> np.ndarray:
        """Per tensor, whether an op not in ``op_ids`` reads it."""
        inside = np.zeros(len(self.graph.ops), dtype=bool)
        inside[np.asarray(op_ids, dtype=np.int64)] = True
        read = np.zeros(len(self.graph.tensors), dtype=bool)
        read[self.reader_tensor[~inside[self.reader_op]]] = True
        return read


def gradient_flow(graph: OpGraph) -> dict[int, int]:
    """Tensor -> index into ``graph.params`` of the gradient it flows into linearly
    (the partial gradients a shared parameter's uses make, and their sums), over
    the whole step."""
    return _grad_flow(graph, dict(enumerate(graph.ops)), graph.producers())


def parameter_derived(graph: OpGraph) -> set[int]:
    """Tensors computed from parameters (and constants) alone: a cast of a tied
    embedding, a reshape of a scale. A stage reading one computes it itself from the
    shared parameter, so it crosses between stages once per step, not per batch."""
    params = set(graph.params)
    constant = {t.id for t in graph.tensors if t.role is TensorRole.CONSTANT}
    derived: set[int] = set()
    for op in graph.ops:
        if op.phase is Phase.UPDATE or not op.inputs:
            continue
        sources = [t in params or t in derived for t in op.inputs]
        if any(sources) and all(s or t in constant for s, t in zip(sources, op.inputs, strict=True)):
            derived.update(op.outputs)
    return derived


def _grad_flow(graph: OpGraph, ops: dict[int, Op], produced: dict[int, int]) -> dict[int, int]:
    flow: dict[int, int] = {}
    stack = [(g, k) for k, g in enumerate(graph.grads) if g in produced]
    while stack:
        tensor_id, k = stack.pop()
        if tensor_id in flow or graph.tensor(tensor_id).batch_dim is not None:
            continue
        flow[tensor_id] = k
        op = ops[produced[tensor_id]]
        if op.primitive in GRAD_LINEAR:
            stack.extend((t, k) for t in op.inputs if t in produced)
    return flow


def analyse_subset(
    graph: OpGraph, op_ids: Sequence[int], index: GraphIndex | None = None
) -> Subset:
    """Boundary, gradient flow, weights and residuals of ``op_ids``.

    ``index`` (of this graph) answers what outside ops read and produce; without it
    one is built, a pass over the whole graph.
    """
    if index is None:
        index = GraphIndex.build(graph)
    elif index.graph is not graph:
        raise ValueError(
            f"the GraphIndex was built for graph {index.graph.name!r}, not for this "
            f"{graph.name!r} object; build one per graph with GraphIndex.build(graph)"
        )
    ids = tuple(sorted(set(op_ids)))
    ops = {i: graph.ops[i] for i in ids}
    produced = {t: op.id for op in ops.values() for t in op.outputs}
    consumed = {t for op in ops.values() for t in op.inputs}
    boundary_inputs = tuple(
        dict.fromkeys(t for op in ops.values() for t in op.inputs if t not in produced)
    )
    read_outside = index.read_outside(ids).tolist()
    boundary_outputs = tuple(
        t for t in produced if read_outside[t] or t in index.step_outputs
    )
    # The phase of the (outside) op that writes each boundary input; step inputs
    # count as forward values.
    writers = index.producer[np.asarray(boundary_inputs, dtype=np.int64)].tolist()
    outside_phase = {
        t: graph.ops[w].phase for t, w in zip(boundary_inputs, writers, strict=True) if w >= 0
    }

    state_roles = (TensorRole.PARAM, TensorRole.OPT_STATE)
    weights = [t for t in boundary_inputs if graph.tensor(t).role in state_roles]
    weights += [g for g in graph.grads if g in produced]
    residuals = []
    backward_reads = {t for op in ops.values() if op.phase is Phase.BACKWARD for t in op.inputs}
    for t in sorted(backward_reads):
        if graph.tensor(t).role in (*state_roles, TensorRole.CONSTANT):
            continue
        if t in produced:
            if ops[produced[t]].phase is Phase.FORWARD:
                residuals.append(t)
        elif outside_phase.get(t, Phase.FORWARD) is Phase.FORWARD:
            residuals.append(t)
    lonely = tuple(g for g in graph.grads if g in produced and g not in consumed)
    return Subset(
        lifetimes=backward_lifetimes(graph, ops, produced, read_outside),
        op_ids=ids,
        produced=produced,
        boundary_inputs=boundary_inputs,
        boundary_outputs=boundary_outputs,
        grad_param=_grad_flow(graph, ops, produced),
        weights=tuple(weights),
        residuals=tuple(residuals),
        lonely_grads=lonely,
    )


def backward_lifetimes(
    graph: OpGraph, ops: dict[int, Op], produced: dict[int, int], read_outside: Sequence[bool]
) -> tuple[tuple[int, int, int], ...]:
    """When each tensor the subset's backward computes is live, as positions among
    its backward ops in program order: from its producer to its last reader here, or
    to the end when an op outside reads it (the cotangent handed to the layer
    before). Gradients of parameters are left out (the runtime adds each into its
    accumulator, counted with the weights), and so are tensors nobody reads.

    A tensor that XLA fuses away is left out too: the output of an elementwise op
    (one that launches no kernel of its own,
    :func:`~alpajob.planner.cost.model.launches_kernel`) read by exactly one op here,
    itself elementwise or a reduction, and by nothing outside. XLA computes it inside
    its reader's loop (a chain of such ops is one fused loop), so it never occupies
    memory. Every other tensor is counted as materialised; XLA also holds some buffers
    this does not know of. Against the compiled stages on CPU
    (``benchmarks/memory_model.py``) the planned peak is 0.66-0.99 of XLA's (Wide-ResNet
    lowest: its convolutions' backward holds temporaries this does not count).
    """
    backward = [op for op in ops.values() if op.phase is Phase.BACKWARD]
    position = {op.id: k for k, op in enumerate(backward)}
    last: dict[int, int] = {}
    readers: dict[int, list[Op]] = {}
    for op in backward:
        for tensor in op.inputs:
            if tensor in produced and produced[tensor] in position:
                last[tensor] = max(last.get(tensor, 0), position[op.id])
                readers.setdefault(tensor, []).append(op)
    grads = set(graph.grads)
    out = []
    for op in backward:
        for tensor in op.outputs:
            if tensor in grads:
                continue
            if read_outside[tensor]:
                end: int | None = len(backward) - 1
            elif _fused_away(op, readers.get(tensor, [])):
                continue
            else:
                end = last.get(tensor)
            if end is not None:
                out.append((tensor, position[op.id], end))
    return tuple(out)


def busiest_bytes(lifetimes: Sequence[tuple[int, int, int]], size: Callable[[int], float]) -> float:
    """The most bytes live at once among ``(tensor, first, last)`` lifetimes
    (:func:`backward_lifetimes`), each tensor ``size(tensor)`` bytes: a sweep over
    the positions, adding a tensor's bytes at its first and removing them after its
    last."""
    if not lifetimes:
        return 0.0
    change = np.zeros(max(last for _, _, last in lifetimes) + 2)
    for tensor, first, last in lifetimes:
        change[first] += size(tensor)
        change[last + 1] -= size(tensor)
    return float(np.cumsum(change).max())


def _fused_away(producer: Op, readers: Sequence[Op]) -> bool:
    """Whether XLA fuses ``producer``'s output into its only reader
    (:func:`backward_lifetimes`)."""
    if launches_kernel(producer.primitive) or len(readers) != 1:
        return False
    reader = readers[0].primitive
    return not launches_kernel(reader) or reader.startswith("reduce_")
