"""Which phase of the step each op belongs to, and which forward op it is attributed to.

Pure functions over the flattened ops (no JAX): the rules are in
:mod:`alpajob.planner.graph.extract`'s docstring (Phases, Anchors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from alpajob.planner.graph.opgraph import Phase


@dataclasses.dataclass(frozen=True)
class RawOp:
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float
    bytes_accessed: float
    params: tuple[tuple[str, Any], ...]
    multiplier: int


def parameter_preprocessing_last(
    ops: Sequence[RawOp], params: frozenset[int], constants: frozenset[int]
) -> list[RawOp]:
    """``ops`` with every op that reads only parameters (and constants, or the results
    of such ops) moved to just before its first reader.

    Such an op (a parameter cast to the compute type by mixed precision, a reshape or
    broadcast of a scale) can run anywhere before its reader; where a trace puts it
    (the cast of every parameter at the top of the loss) says nothing about which layer
    it belongs to. Placed just before its reader, it lands in that reader's layer, and
    so does the parameter: layer clustering cuts the forward ops in program order, and
    a parameter's stage is that of its first forward reader. The order stays
    topological: a moved op keeps its inputs (parameters) and its place before its
    readers; moved ops bound for the same reader keep their relative order.

    Example: ``c0 = cast(W0); c1 = cast(W1); h = x @ c0; y = h @ c1`` becomes
    ``c0 = cast(W0); h = x @ c0; c1 = cast(W1); y = h @ c1``.
    """
    produced_by = {t: i for i, op in enumerate(ops) for t in op.outputs}
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            if t in produced_by:
                readers.setdefault(produced_by[t], []).append(i)
    movable = [False] * len(ops)
    for i, op in enumerate(ops):
        sources = [t for t in op.inputs if t not in constants]
        movable[i] = bool(sources) and any(t in params for t in sources) and all(
            t in params or (t in produced_by and movable[produced_by[t]]) for t in sources)
    position = list(range(len(ops)))
    for i in reversed(range(len(ops))):
        if movable[i] and readers.get(i):
            position[i] = min(position[r] for r in readers[i])
    order = sorted(range(len(ops)), key=lambda i: (position[i], 0 if position[i] != i else 1, i))
    return [ops[i] for i in order]


def phases(
    ops: Sequence[RawOp],
    producer: dict[int, int],
    loss: int,
    grads: Sequence[int],
    others: Sequence[int],
) -> list[Phase]:
    """Forward = ancestors of ``loss``; backward = other ancestors of ``grads``; update =
    other ancestors of the remaining step outputs (``others``). An op that feeds no
    output (a loop carry dropped by inlining the body once, a ``cond`` index, a JVP
    helper whose consumer JAX dropped) takes the latest phase of its producers, but
    never forward (forward stays exactly the loss's ancestors); with no producers, the
    update phase.
    """

    def ancestors(roots: Sequence[int], seen: set[int]) -> set[int]:
        found: set[int] = set()
        stack = [producer[t] for t in roots if t in producer]
        while stack:
            op_id = stack.pop()
            if op_id in found or op_id in seen:
                continue
            found.add(op_id)
            stack.extend(producer[t] for t in ops[op_id].inputs if t in producer)
        return found

    forward = ancestors([loss], set())
    backward = ancestors(grads, forward)
    update = ancestors(others, forward | backward)
    order = (Phase.FORWARD, Phase.BACKWARD, Phase.UPDATE)
    phases: list[Phase] = []
    for i, op in enumerate(ops):
        if i in forward:
            phases.append(Phase.FORWARD)
        elif i in backward:
            phases.append(Phase.BACKWARD)
        elif i in update:
            phases.append(Phase.UPDATE)
        else:
            ranks = [order.index(phases[producer[t]]) for t in op.inputs if t in producer]
            phases.append(order[max(ranks + [1])] if ranks else Phase.UPDATE)
    return phases


def _parameter_values(
    ops: Sequence[RawOp], forward_ids: Sequence[int], params: set[int],
    constants: frozenset[int],
) -> dict[int, int]:
    """Each parameter, and each forward value computed from one parameter alone (and
    constants), mapped to that parameter: mixed precision's cast of a weight to the
    compute type, a reshape of it. Such a value is the parameter as its readers see
    it, so a reader of the value reads the parameter (:func:`anchors`)."""
    stands_for = {p: p for p in params}
    for i in forward_ids:
        sources = {stands_for.get(t, -1) for t in ops[i].inputs if t not in constants}
        if len(sources) == 1 and -1 not in sources:
            (p,) = sources
            stands_for.update((t, p) for t in ops[i].outputs)
    return stands_for


def _differentiated(uses: Sequence[int], bound: float) -> int:
    """Of the forward ops that read a parameter (``uses``, in order), the one a
    backward op whose cotangent comes from forward op ``bound`` differentiates: the
    latest no later than ``bound`` (the LM head, not the lookup, for a tied
    embedding's ``dlogits @ E``), else the first."""
    return max((u for u in uses if u <= bound), default=uses[0])


def anchors(
    ops: Sequence[RawOp],
    phases: Sequence[Phase],
    producer: dict[int, int],
    owner: dict[int, int],
    params: Sequence[int],
    grads: Sequence[int],
    constants: frozenset[int] = frozenset(),
) -> list[int]:
    """Attribute every op to a forward op (the rules are in the module docstring).

    ``owner`` maps each parameter, and each optimizer-state leaf that belongs to one
    parameter (Adam's moments), to that parameter's tensor id; ``constants`` are the
    captured constants (tensors that are neither produced by an op nor step inputs).
    """
    n = len(ops)
    forward_ids = [i for i in range(n) if phases[i] is Phase.FORWARD]
    last_forward = forward_ids[-1] if forward_ids else 0
    param_set = set(params)
    stands_for = _parameter_values(ops, forward_ids, param_set, constants)
    uses: dict[int, list[int]] = {}  # parameter -> the forward ops reading it, in order
    for i in forward_ids:
        for p in dict.fromkeys(stands_for[t] for t in ops[i].inputs if t in stands_for):
            uses.setdefault(p, []).append(i)
    first_use = {t: found[0] for t, found in uses.items()}

    # The one parameter whose gradient a backward op exclusively feeds (-1 none, -2 many).
    grad_of = {g: k for k, g in enumerate(grads)}
    consumers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            consumers.setdefault(t, []).append(i)
    target = [-1] * n
    for i in range(n - 1, -1, -1):
        if phases[i] is not Phase.BACKWARD:
            continue
        seen: set[int] = set()
        for t in ops[i].outputs:
            if t in grad_of:
                seen.add(grad_of[t])
            for c in consumers.get(t, ()):
                if phases[c] is Phase.BACKWARD and target[c] != -1:
                    seen.add(target[c])
        target[i] = seen.pop() if len(seen) == 1 else (-2 if seen else -1)

    anchor = [last_forward] * n
    primal = [False] * n  # computed from forward values only (a residual)
    reach = [math.inf] * n  # update ops: min first use of params read (transitively)
    free = [False] * n  # a backward/update op computed from constants only (re-anchored below)
    for i, op in enumerate(ops):
        phase = phases[i]
        producers = [producer[t] for t in op.inputs if t in producer]
        free[i] = phase is not Phase.FORWARD and all(
            t in constants or (t in producer and free[producer[t]]) for t in op.inputs
        )
        if phase is Phase.FORWARD:
            anchor[i] = i
            primal[i] = True
        elif phase is Phase.BACKWARD:
            primal[i] = bool(producers) and all(primal[j] for j in producers)
            upstream = [anchor[j] for j in producers if not (primal[j] or free[j])]
            bound = min(upstream, default=last_forward)
            # A parameter read directly (``dy @ W.T``, or its compute-type copy under
            # mixed precision) stands for the latest forward op that read it before the
            # gradient arrived: the op this one differentiates.
            mirrored = [
                _differentiated(uses[p], bound)
                for p in (stands_for.get(t) for t in op.inputs) if p in uses
            ]
            residual = [anchor[j] for j in producers if primal[j]] + mirrored
            anchor[i] = max(residual) if residual else bound
            if target[i] >= 0 and params[target[i]] in uses:
                anchor[i] = max(anchor[i], _differentiated(uses[params[target[i]]], bound))
        else:
            direct = [
                first_use[owner[t]] for t in op.inputs if t in owner and owner[t] in first_use
            ]
            via = [reach[j] for j in producers if phases[j] is Phase.UPDATE]
            reach[i] = min(direct + via, default=math.inf)
            if reach[i] < math.inf:
                anchor[i] = int(reach[i])
            elif producers:
                anchor[i] = min(anchor[j] for j in producers)
    for i in range(n - 1, -1, -1):
        if free[i]:
            users = [anchor[c] for t in ops[i].outputs for c in consumers.get(t, ())]
            anchor[i] = min(users, default=last_forward)
    return anchor
