"""One training step as a timeline: what each pipeline stage did when.

A :class:`Timeline` is a list of :class:`Span` s, each one stage busy with one thing
(a micro-batch's forward or backward, the update, waiting for a message) from
``start`` to ``end`` seconds after the step began. The planner predicts one from a
plan (:func:`alpajob.planner.plan.timeline.predicted_timeline`), the local runtime
measures one (``alpajob run --trace``); the time a stage spends in no span is its
bubble.

:func:`chrome_trace` writes timelines in the Chrome trace event format that
Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open: one process per timeline
("predicted", "measured"), one thread (row) per stage, one complete event (``"ph":
"X"``) per span, times in microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class SpanKind(StrEnum):
    """What a stage is doing during a span."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"
    COMMUNICATION = "communication"
    FORWARD_BACKWARD = "forward-backward"  # one micro-batch's forward and backward in one executable
    STEP = "step"  # a whole step in one executable (a one-stage plan: forward, backward, update)


@dataclass(frozen=True)
class Span:
    """Stage ``stage`` doing ``kind`` (for micro-batch ``micro_batch``) from ``start``
    to ``end`` seconds after the step began."""

    stage: int
    kind: SpanKind
    micro_batch: int | None
    start: float
    end: float

    @property
    def label(self) -> str:
        """``F3`` / ``B3`` (forward / backward of micro-batch 3), ``X3`` (both in one
        executable), ``U``, ``C3``, ``S`` (a whole step)."""
        letter = {SpanKind.FORWARD: "F", SpanKind.BACKWARD: "B", SpanKind.UPDATE: "U",
                  SpanKind.COMMUNICATION: "C", SpanKind.STEP: "S",
                  SpanKind.FORWARD_BACKWARD: "X"}[self.kind]
        return letter if self.micro_batch is None else f"{letter}{self.micro_batch}"


@dataclass(frozen=True)
class Timeline:
    """The spans of one step over ``num_stages`` stages; ``seconds`` is the step."""

    num_stages: int
    spans: tuple[Span, ...]
    seconds: float

    def busy(self, stage: int) -> float:
        """Seconds stage ``stage`` spends in spans."""
        return sum(s.end - s.start for s in self.spans if s.stage == stage)

    def bubble(self, stage: int) -> float:
        """Seconds stage ``stage`` is in no span (idle)."""
        return max(0.0, self.seconds - self.busy(stage))


def chrome_trace(timelines: Sequence[tuple[str, Timeline]],
                 stage_names: Sequence[str] = ()) -> dict[str, Any]:
    """``{"traceEvents": [...]}`` with one process per named timeline and one thread
    per stage (named ``stage_names[i]`` where given)."""
    events: list[dict[str, Any]] = []
    for pid, (name, timeline) in enumerate(timelines, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for stage in range(timeline.num_stages):
            label = stage_names[stage] if stage < len(stage_names) else f"stage {stage}"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": stage,
                           "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": stage,
                           "args": {"sort_index": stage}})
        for span in timeline.spans:
            events.append({
                "ph": "X", "name": span.label, "cat": span.kind.value, "pid": pid,
                "tid": span.stage, "ts": span.start * 1e6,
                "dur": max(0.0, span.end - span.start) * 1e6,
                "args": {"micro_batch": span.micro_batch},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}
