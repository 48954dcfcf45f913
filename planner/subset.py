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
  kept alive from the forward to the backward pass of each micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from alpajob.planner.graph import Op, OpGraph, Phase, TensorRole

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


def analyse_subset(graph: OpGraph, op_ids: Sequence[int]) -> Subset:
    """Boundary, gradient flow, weights and residuals of ``op_ids`` (one pass over the
    graph for what outside ops read and produce)."""
    ids = tuple(sorted(set(op_ids)))
    ops = {i: graph.ops[i] for i in ids}
    produced = {t: op.id for op in ops.values() for t in op.outputs}
    consumed = {t for op in ops.values() for t in op.inputs}
    boundary_inputs = tuple(
        dict.fromkeys(t for op in ops.values() for t in op.inputs if t not in produced)
    )
    boundary_set = set(boundary_inputs)
    outside_phase: dict[int, Phase] = {}
    consumed_outside: set[int] = set()
    for op in graph.ops:
        if op.id in ops:
            continue
        consumed_outside.update(t for t in op.inputs if t in produced)
        for t in op.outputs:
            if t in boundary_set:
                outside_phase[t] = op.phase
    step_outputs = {graph.loss, *graph.grads, *graph.new_params}
    boundary_outputs = tuple(t for t in produced if t in consumed_outside or t in step_outputs)

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
        op_ids=ids,
        produced=produced,
        boundary_inputs=boundary_inputs,
        boundary_outputs=boundary_outputs,
        grad_param=_grad_flow(graph, ops, produced),
        weights=tuple(weights),
        residuals=tuple(residuals),
        lonely_grads=lonely,
    )
