"""The step a plan predicts, as a timeline (what ``alpajob plan --svg`` draws).

Each stage's instruction list (:func:`~alpajob.planner.inter_op.schedules.
instruction_list`) is replayed on an event clock (:func:`~alpajob.planner.inter_op.
schedules.replay`) with the plan's per-stage times: a micro-batch's forward and
backward together take the stage's ``predicted_seconds``, split by FLOPs (a backward
pass is two forward passes' work, three with rematerialization, which runs the
forward again). The part of each pass that the plan predicts as communication
(``communication_seconds``: the stage's collectives and its cross-mesh transfers,
per micro-batch) is drawn at the pass's end. After its last backward a stage runs
the update (``update_seconds``). Where a stage is in no span it waits: the bubble.

The replay treats the stages as independent devices. On one host whose forced CPU
devices share the cores (``cluster.shared_host``) the plan's step time is the
host's total work instead; the timeline then shows the order, not the host's clock.
"""

from __future__ import annotations

from alpajob.api.plan import Plan
from alpajob.api.spec import Schedule
from alpajob.api.timeline import Span, SpanKind, Timeline
from alpajob.planner.inter_op.schedules import Direction, replay


def forward_share(rematerialize: bool) -> float:
    """A forward's share of a micro-batch's forward+backward work: 1/3, or 1/4 when
    the backward recomputes the forward."""
    return 1 / 4 if rematerialize else 1 / 3


def predicted_timeline(plan: Plan) -> Timeline:
    """The step ``plan`` predicts, stage by stage (module docstring)."""
    m = plan.num_micro_batches
    forward, backward, comm_share = [], [], []
    for stage in plan.stages:
        share = forward_share(stage.rematerialize)
        forward.append([stage.predicted_seconds * share] * m)
        backward.append([stage.predicted_seconds * (1 - share)] * m)
        total = stage.predicted_seconds
        comm_share.append(min(1.0, stage.communication_seconds / total) if total > 0 else 0.0)
    result = replay(Schedule(plan.schedule), forward, backward)
    spans: list[Span] = []
    last = [0.0] * len(plan.stages)
    for i, direction, j, start, end in result.runs:
        kind = SpanKind.FORWARD if direction is Direction.FORWARD else SpanKind.BACKWARD
        talk = (end - start) * comm_share[i]
        spans.append(Span(i, kind, j, start, end - talk))
        if talk > 0:
            spans.append(Span(i, SpanKind.COMMUNICATION, j, end - talk, end))
        last[i] = max(last[i], end)
    for i, stage in enumerate(plan.stages):
        spans.append(Span(i, SpanKind.UPDATE, None, last[i], last[i] + stage.update_seconds))
    seconds = max(s.end for s in spans)
    return Timeline(len(plan.stages), tuple(spans), seconds)
