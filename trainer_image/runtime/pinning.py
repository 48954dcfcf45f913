"""Find the plan's pinned ops in the trainer's own trace, so each stage can pin them.

The planner traced the whole training step (``value_and_grad`` plus the optimizer);
the trainer traces only the loss, one micro-batch. Their forward equations are the
same computation but not always the same list: differentiation can rewrite a
``custom_jvp`` function into its rule's primal ops, and the planner inlines loop
bodies. So the plan names each pinned op by its primitive and output shape
(:class:`~alpajob.api.plan.PinnedOp`), and :func:`match_pins` aligns the two
sequences greedily:

    walk the trainer's equations in program order; for one whose primitive is pinned,
    look at the next ``LOOKAHEAD`` unmatched plan ops and take the first with the same
    primitive and output shape; the search resumes after it.

Both lists are in program order, so a match never goes backwards and a missing or
extra op costs at most one lookahead window. An unmatched equation is simply not
pinned: a sharding constraint never changes values, only where they live, so a wrong
or missing match can cost speed but never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

from alpajob.api.plan import PINNED_PRIMITIVES, PinnedOp, SpecEntry, StagePlan
from alpajob.trainer_image.runtime.split import FlatEqn, SplitProgram, ValueId

#: How many plan ops past the last match a trainer equation may skip to find its own.
LOOKAHEAD = 16


def match_pins(eqns: Sequence[FlatEqn], avals: Sequence[object], pins: Sequence[PinnedOp]) -> dict[ValueId, PinnedOp]:
    """Output value id of each trainer equation -> the plan op it matches."""
    ordered = sorted(pins, key=lambda p: p.op)
    cursor = 0
    matched: dict[ValueId, PinnedOp] = {}
    for eqn in eqns:
        name = eqn.primitive.name
        if name not in PINNED_PRIMITIVES or len(eqn.outputs) != 1:
            continue
        shape = list(getattr(avals[eqn.outputs[0]], "shape", ()))
        for offset, pin in enumerate(ordered[cursor:cursor + LOOKAHEAD]):
            if pin.primitive == name and pin.shape == shape:
                matched[eqn.outputs[0]] = pin
                cursor += offset + 1
                break
    return matched


def stage_pins(split: SplitProgram, plan_stages: Sequence[StagePlan]) -> list[dict[ValueId, list[SpecEntry]]]:
    """Per trainer stage: output value id -> the sharding to pin it to.

    The trainer's and the planner's stage cuts can differ by a few ops; each pinned
    equation keeps the sharding of whichever plan stage held its op, and the stage
    that runs it checks the sharding fits its own mesh.
    """
    every = [pin for stage in plan_stages for pin in stage.pinned_ops]
    # value ids are numbered in program order, so this restores the traced order
    flat = sorted((eqn for stage in split.stages for eqn in stage.eqns if eqn.outputs),
                  key=lambda eqn: eqn.outputs[0])
    matched = match_pins(flat, split.avals, every)
    out: list[dict[ValueId, list[SpecEntry]]] = []
    for stage in split.stages:
        produced = {v for eqn in stage.eqns for v in eqn.outputs}
        out.append({v: pin.sharding for v, pin in matched.items() if v in produced})
    return out
